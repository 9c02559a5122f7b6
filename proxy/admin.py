"""Admin endpoint: HTTP on the node's address, bearer token for actions.

``GET /status`` (JSON), ``GET /metrics`` (Prometheus text), ``GET /healthz``,
``GET /readyz``, ``GET /clients`` (bearer token: the node's client connections, which its
peers keep for tickle ACKs; ``?after=V&wait=S`` waits until they differ from version ``V``,
proxy.addresses.peers), ``POST /drain`` (this node), ``POST /drain/<node>`` (any node,
through the fleet), ``POST /undrain/<node>``, ``POST /kill`` (the drill:
``{"signal": "KILL"|"STOP"|"TERM"}``, the node signals itself), ``POST /add-node/<node>``
(``{"host": H}``, optional ``bootstrap_port``, ``raft_port``, ``rack``; the other
ports follow this node's) and ``POST /remove-node/<node>``: live membership changes
(:func:`membership_actions`). A change that may not start now (quorum, one at a
time) answers 409 with ``"refused": true``.

It runs the standard library's threading HTTP server in its own thread: admin
traffic is tiny and must keep answering even when the data path's loop is
busy. Handlers get their data through the callables they are given; anything
touching the data path hops to its loop.
"""

from __future__ import annotations

import hmac
import json
import logging
import selectors
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("kproxy.admin")

Action = Callable[[dict[str, Any]], dict[str, Any]]


# The longest long poll of ``GET /clients?after=V&wait=S`` (proxy.addresses.peers).
MAX_CLIENTS_WAIT_S = 30.0


def clients_query(path: str) -> tuple[int | None, float]:
    """``after`` and ``wait`` (capped at ``MAX_CLIENTS_WAIT_S``) of a ``/clients?after=V&wait=S``
    path: (None, 0) for a plain request; ``ValueError`` naming the parameter for a malformed one."""
    q = parse_qs(urlsplit(path).query)
    if "after" not in q:
        return None, 0.0
    try:
        after = int(q["after"][0])
    except ValueError:
        raise ValueError(f"after must be a version number, got {q['after'][0]!r}") from None
    try:
        wait = float(q.get("wait", ["0"])[0])
    except ValueError:
        raise ValueError(f"wait must be a number of seconds, got {q['wait'][0]!r}") from None
    if not 0 <= wait < float("inf"):
        raise ValueError(f"wait must be a number of seconds >= 0, got {wait}")
    return after, min(wait, MAX_CLIENTS_WAIT_S)


class ActionRefused(ValueError):
    """The action may not run now (answered 409 with ``"refused": true``); the message says why."""


#: How long a membership change may take before the action answers 409 (not done in time).
MEMBER_CHANGE_TIMEOUT_S = 30.0


def membership_actions(member: Callable[[], Any]) -> dict[str, Action]:
    """``add-node`` and ``remove-node`` on the fleet member ``member()`` returns
    (None: no fleet). The new node's ports follow this node's (same port scheme,
    Raft port, bootstrap port) unless the body names them."""
    from membership.config import MemberSpec
    from membership.roster import ChangeRefused
    from topology import ProxyNode

    def fleet_member() -> Any:
        m = member()
        if m is None:
            raise LookupError("no fleet: membership changes need [fleet]")
        return m

    def add_node(body: dict[str, Any]) -> dict[str, Any]:
        m = fleet_member()
        me: MemberSpec = m.config.me
        node_id, host = str(body.get("node") or ""), str(body.get("host") or "")
        if not node_id or not host:
            raise ValueError("add-node needs the node's id (in the path) and its host ({\"host\": ...})")
        try:
            node = ProxyNode(node_id, host, int(body.get("bootstrap_port") or me.node.bootstrap_port),
                             rack=body.get("rack"), ports=me.node.ports)
            spec = MemberSpec(node, host, int(body.get("raft_port") or me.raft_port))
            epoch = m.add_member(spec, timeout=MEMBER_CHANGE_TIMEOUT_S)
        except ChangeRefused as exc:
            raise ActionRefused(str(exc)) from None
        except TypeError as exc:  # a bad id, host or port in the body (attrs validators)
            raise ValueError(f"add-node {node_id}: {exc}") from None
        return {"node": node_id, "added": True, "epoch": epoch, "raft_address": spec.raft_address,
                "members": [s.id for s in m.roster()]}

    def remove_node(body: dict[str, Any]) -> dict[str, Any]:
        m = fleet_member()
        node_id = str(body.get("node") or "")
        try:
            epoch = m.remove_member(node_id, timeout=MEMBER_CHANGE_TIMEOUT_S)
        except ChangeRefused as exc:
            raise ActionRefused(str(exc)) from None
        return {"node": node_id, "removed": True, "epoch": epoch, "members": [s.id for s in m.roster()]}

    return {"add-node": add_node, "remove-node": remove_node}


class AdminHandler(BaseHTTPRequestHandler):
    """One admin request; ``admin`` is set on a subclass per server."""

    admin: AdminServer
    protocol_version = "HTTP/1.1"
    server_version = "kproxy-admin"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("admin request", extra={"request": fmt % args})

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        # Headers and body in one write: two small writes stall a keep-alive
        # client for the delayed-ACK interval (~40 ms).
        self._headers_buffer.append(b"\r\n" + body)  # type: ignore[attr-defined]
        self.flush_headers()

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj, default=str).encode())

    def do_GET(self) -> None:  # noqa: N802
        try:
            if self.path == "/status":
                self._json(200, self.admin.status())
            elif self.path == "/metrics":
                self._send(200, self.admin.metrics(), "text/plain; version=0.0.4")
            elif self.path == "/healthz":
                self._json(200, {"ok": True})
            elif self.path.partition("?")[0] == "/clients" and self.admin.clients is not None:
                if self._authorized():
                    try:
                        after, wait_s = clients_query(self.path)
                    except ValueError as exc:
                        self._json(400, {"error": str(exc)})
                        return
                    self._json(200, self.admin.clients(after, wait_s))
            elif self.path == "/readyz":
                ok = self.admin.ready()
                self._json(200 if ok else 503, {"ready": ok})
            else:
                self._json(404, {"error": f"no such endpoint {self.path}"})
        except Exception as exc:  # an admin bug must not kill the thread
            log.exception("admin GET failed")
            self._json(500, {"error": repr(exc)})

    def _authorized(self) -> bool:
        """The request carries the bearer token; if not, the refusal is sent."""
        if self.admin.token is None:
            self._json(403, {"error": "no admin token configured: actions are disabled"})
            return False
        auth = self.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.admin.token}".encode()):
            self._json(401, {"error": "missing or wrong bearer token"})
            return False
        return True

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if 0 < length <= 65536 else b""
        if not self._authorized():
            return
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            self._json(400, {"error": f"bad JSON body: {exc}"})
            return
        parts = [p for p in self.path.split("/") if p]
        if not parts or parts[0] not in self.admin.actions:
            self._json(404, {"error": f"no such action {self.path}"})
            return
        if len(parts) > 1:
            body["node"] = parts[1]
        try:
            self._json(200, self.admin.actions[parts[0]](body))
        except LookupError as exc:
            self._json(404, {"error": str(exc)})
        except ActionRefused as exc:
            self._json(409, {"error": str(exc), "refused": True})
        except (ValueError, TimeoutError) as exc:
            self._json(409, {"error": str(exc)})
        except Exception as exc:
            log.exception("admin action failed")
            self._json(500, {"error": repr(exc)})


class _IPv6HTTPServer(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class AdminServer:
    def __init__(self, host: str, port: int, *, token: str | None, status: Callable[[], dict[str, Any]],
                 metrics: Callable[[], bytes], ready: Callable[[], bool], actions: dict[str, Action],
                 ssl_context: ssl.SSLContext | None = None,
                 clients: Callable[[int | None, float], dict[str, Any]] | None = None) -> None:
        """``ssl_context``: serve HTTPS (proxy.tls.admin_context); the handshake runs in the
        request's thread, not in the accept loop."""
        self.token = token
        self.status = status
        self.metrics = metrics
        self.ready = ready
        self.actions = actions
        self.clients = clients
        handler = type("Handler", (AdminHandler,), {"admin": self})
        try:
            server = _IPv6HTTPServer if ":" in host else ThreadingHTTPServer  # an IPv6 literal such as ::1
            self.httpd = server((host, port), handler)
        except OSError as exc:  # one line naming the listener and its address, not a traceback
            raise OSError(exc.errno, f"admin listener (HTTP) {host}:{port}: {(exc.strerror or str(exc)).lower()}") from None
        self.httpd.daemon_threads = True
        if ssl_context is not None:
            self.httpd.socket = ssl_context.wrap_socket(self.httpd.socket, server_side=True,
                                                        do_handshake_on_connect=False)
        self.httpd.timeout = 0  # handle_request() after our own select: never waits again
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kproxy-admin", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        """The accept loop. Not ``serve_forever``: it wakes every ``poll_interval`` (0.5 s) to
        look for a shutdown, most of an idle node's admin thread CPU; this one waits on the
        listener and on a socket :meth:`stop` writes to, nothing else."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.httpd, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _events in selector.select():
                    if key.fileobj is self.httpd and not self._stopping.is_set():
                        self.httpd.handle_request()

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:  # the loop is gone already
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()
