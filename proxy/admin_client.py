"""The client of the nodes' admin endpoint (``proxy/admin.py``): views and actions over HTTP.

``NodeAdmin`` is one node's endpoint: ``GET`` views (``/status``, ``/healthz``) without a token,
``POST`` actions (``/drain/ID``, ``/undrain/ID``, ``/kill``) with the fleet's bearer token.
``ClusterAdmin`` is a fleet seen through those endpoints: discovered from any one node
(its ``/status`` names every node's endpoint, ``admin_endpoints``), one picture of the
fleet (``fleet_view``) and its health, and the actions sent to the leader. The operator
commands (``kproxy cluster ... --admin URL``) use it as is; the local launcher
(``chaos.testbed.fleet.LocalFleet``) adds the processes it started.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import httpx

from proxy.config import http_url
from proxy.hosts import join_host_port
from proxy.status import FleetView, NodeEndpoint, NodeStatus

DEFAULT_ADMIN_PORT = 9400
DEFAULT_BOOTSTRAP_PORT = 9092


class AdminError(RuntimeError):
    """An admin endpoint did not answer, refused, or the fleet did not reach the state asked for."""


class AdminRefused(AdminError):
    """The request itself is wrong: an unknown node, a missing or refused admin token, no fleet
    at the address given. The operator commands exit 2 on it (1 on any other AdminError)."""


def describe_http_error(exc: Exception) -> str:
    """An httpx error as an operator reads it: ``connection refused``, ``timed out``, never a repr."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    text = str(exc).strip()
    if isinstance(exc, httpx.ConnectError):
        # "[Errno 111] Connection refused" -> "connection refused"
        text = text.split("] ", 1)[-1] if text.startswith("[Errno") else text
        return text[:1].lower() + text[1:] if text else "cannot connect"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return text or type(exc).__name__


class NodeAdmin:
    """One node as its admin endpoint sees it: GET views, token-authorised POST actions.

    No process of ours: ``pid`` is None, ``alive()`` says whether it answers, and ``signal``
    asks the node to signal itself (``POST /kill``).
    """

    def __init__(self, node_id: str, host: str, admin_port: int, token: str | None = None, *,
                 bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT, bootstrap_host: str | None = None) -> None:
        """``bootstrap_host``: where clients reach the node when that is not ``host`` (a
        floating address, proxy.addresses)."""
        self.node_id = node_id
        self.host = host
        self.bootstrap_host = bootstrap_host or host
        self.admin_port = admin_port
        self.bootstrap_port = bootstrap_port
        self.pid: int | None = None
        self._token = token
        self._http: httpx.Client | None = None  # persistent: a new client per call costs 100+ ms CPU

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client()
        return self._http

    @property
    def admin_url(self) -> str:
        return http_url(self.host, self.admin_port)

    def token(self) -> str:
        if not self._token:
            raise AdminRefused("no admin token: actions need the fleet's bearer token "
                             "(--token-env names the environment variable that holds it)")
        return self._token

    def get(self, path: str, timeout: float = 2.0) -> httpx.Response:
        return self.http.get(self.admin_url + path, timeout=timeout)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> httpx.Response:
        return self.http.post(self.admin_url + path, json=body or {}, timeout=timeout,
                              headers={"Authorization": f"Bearer {self.token()}"})

    def alive(self) -> bool:
        try:
            return self.get("/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def signal(self, name: str) -> None:
        """The drill through the admin API: the node sends itself the signal."""
        try:
            r = self.post("/kill", {"signal": name})
        except httpx.HTTPError as exc:
            raise AdminError(f"node {self.node_id}: POST /kill failed: {describe_http_error(exc)}") from None
        if r.status_code in (401, 403):
            raise AdminRefused(f"node {self.node_id}: {_refusal(r)}")
        if r.status_code != 200:
            raise AdminError(f"node {self.node_id}: POST /kill answered {r.status_code}: {r.text[:200]}")


class ClusterAdmin:
    """A fleet through its nodes' admin endpoints: views, health, and actions."""

    def __init__(self, nodes: list[NodeAdmin], upstream: list[str]) -> None:
        self.nodes: dict[str, NodeAdmin] = {n.node_id: n for n in nodes}
        self.upstream = upstream

    @classmethod
    def discover(cls, admin_url: str, token: str | None = None, timeout: float = 5.0) -> "ClusterAdmin":
        """A running fleet, wherever it runs, known by one node's admin endpoint: that node's
        ``/status`` names every node's endpoint (``admin_endpoints``). Views work without a
        token; actions (drain, undrain, kill through ``POST /kill``) need the fleet's admin token."""
        parts = urllib.parse.urlsplit(admin_url if "://" in admin_url else f"http://{admin_url}")
        if not parts.hostname:
            raise AdminRefused(f"{admin_url!r} is not an admin URL (http://HOST:PORT)")
        first = NodeAdmin("?", parts.hostname, parts.port or DEFAULT_ADMIN_PORT, token)
        try:
            r = first.get("/status", timeout=timeout)
            r.raise_for_status()
            status = NodeStatus.from_json(r.json())
        except httpx.HTTPError as exc:
            raise AdminRefused(f"no fleet status from {first.admin_url}: {describe_http_error(exc)}") from None
        except ValueError as exc:  # StatusError is a ValueError
            raise AdminRefused(f"no fleet status from {first.admin_url}: not a kproxy status ({exc})") from None
        endpoints = status.admin_endpoints or {status.node: first.admin_url}
        nodes = []
        for node_id, url in sorted(endpoints.items()):
            u = urllib.parse.urlsplit(url)
            member = status.members.get(node_id)
            nodes.append(NodeAdmin(node_id, u.hostname or "", u.port or DEFAULT_ADMIN_PORT, token,
                                   bootstrap_port=member.bootstrap_port if member else DEFAULT_BOOTSTRAP_PORT,
                                   bootstrap_host=member.host if member else None))
        return cls(nodes, [f"{b.host}:{b.port}" for b in status.brokers])

    # ---------------------------------------------------------- accessors
    @property
    def node_ids(self) -> list[str]:
        return list(self.nodes)

    @property
    def bootstrap(self) -> list[str]:
        return [join_host_port(n.bootstrap_host, n.bootstrap_port) for n in self.nodes.values()]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(self.bootstrap)

    def node_address(self, node_id: str) -> str:
        return self._node(node_id).host

    def _node(self, node_id: str) -> NodeAdmin:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise AdminRefused(f"no node {node_id!r} in this fleet (nodes: {', '.join(self.node_ids)})") from None

    # -------------------------------------------------------------- views
    def status(self, node_id: str | None = None, timeout: float = 1.0) -> NodeStatus:
        """GET /status of one node (default: the first that answers)."""
        candidates = [self._node(node_id)] if node_id else list(self.nodes.values())
        errors = []
        for n in candidates:
            try:
                r = n.get("/status", timeout=timeout)
                r.raise_for_status()
                return NodeStatus.from_json(r.json())
            except httpx.HTTPError as exc:
                errors.append(f"{n.node_id}: {describe_http_error(exc)}")
            except ValueError as exc:  # StatusError is a ValueError
                errors.append(f"{n.node_id}: not a kproxy status ({exc})")
        raise AdminError("no node answered /status: " + "; ".join(errors))

    def statuses(self, timeout: float = 1.0) -> dict[str, NodeStatus | None]:
        """Every node's status; None for a node that does not answer (or answers nonsense)."""
        out: dict[str, NodeStatus | None] = {}
        for n in self.nodes.values():
            try:
                r = n.get("/status", timeout=timeout)
                out[n.node_id] = NodeStatus.from_json(r.json()) if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                out[n.node_id] = None
        return out

    def endpoints(self) -> list[NodeEndpoint]:
        return [NodeEndpoint(n.node_id, n.host, n.pid, n.alive()) for n in self.nodes.values()]

    def fleet_view(self, timeout: float = 1.0) -> FleetView:
        """One picture of the fleet: the leader's table, every node's role and liveness."""
        statuses = self.statuses(timeout)
        return FleetView.build(self.endpoints(), statuses, self.bootstrap)

    def leader(self) -> str | None:
        return self.fleet_view().leader

    def wait_healthy(self, timeout: float = 30.0, *, allow_dead: bool = False) -> FleetView:
        """Until: a leader, every identity on a live node, one epoch (dead nodes allowed if asked)."""
        deadline = time.monotonic() + timeout
        problems: list[str] = ["not checked"]
        while time.monotonic() < deadline:
            view = self.fleet_view()
            problems = view.health_problems(allow_dead=allow_dead)
            if not problems:
                return view
            time.sleep(0.1)
        raise AdminError(f"fleet not healthy within {timeout}s: {problems}")

    def wait_balanced(self, timeout: float = 30.0) -> FleetView:
        """Until healthy and every live, non-draining node's load is within one of the others'."""
        deadline = time.monotonic() + timeout
        loads: dict[str, int] = {}
        while time.monotonic() < deadline:
            view = self.fleet_view()
            loads = view.loads()
            if not view.health_problems() and loads and max(loads.values()) - min(loads.values()) <= 1:
                return view
            time.sleep(0.1)
        raise AdminError(f"fleet not balanced within {timeout}s: identities per node {loads}")

    def wait_moves_done(self, timeout: float = 15.0) -> bool:
        """Until no node has a connection still moving (``/status`` ``moving``: draining, its
        identity handed back or the node draining, not closed yet; a busy client's goes at the
        drain deadline, ``limits.drain_timeout_s``) and every node answers; False at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = self.statuses()
            if all(s is not None and s.moving == 0 for s in statuses.values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)  # polling the nodes' status: no notification to wait on

    def wait_steady(self, timeout: float = 30.0) -> FleetView:
        """Until ready for the next fault: balanced (a fleet whose addresses float also waits
        until every address is back on its own node: ``chaos.testbed.fleet.LocalFleet``)."""
        return self.wait_balanced(timeout)

    # ------------------------------------------------------------- actions
    def signal_node(self, node_id: str, sig: str) -> None:
        self._node(node_id).signal(sig.upper())

    def _action(self, path: str, via: str | None = None, body: dict[str, Any] | None = None,
                avoid: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
        """POST an action to one node (default: the leader, else any node that answers;
        never ``avoid``)."""
        order = [via] if via else ([self.leader()] + self.node_ids)
        errors = []
        for node_id in dict.fromkeys(order):
            if node_id is None or node_id == avoid:
                continue
            try:
                r = self._node(node_id).post(path, body, timeout=timeout)
            except httpx.HTTPError as exc:
                errors.append(f"{node_id}: {describe_http_error(exc)}")
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code in (401, 403, 404) or _refused(r):
                raise AdminRefused(f"{path} refused by {node_id}: {_refusal(r)}")
            errors.append(f"{node_id}: {_refusal(r)}")
            if r.status_code == 400:
                break
        raise AdminError(f"{path} failed: " + "; ".join(errors))

    def drain(self, node_id: str) -> dict[str, Any]:
        self._node(node_id)
        return self._action(f"/drain/{node_id}")

    def undrain(self, node_id: str) -> dict[str, Any]:
        self._node(node_id)
        return self._action(f"/undrain/{node_id}")

    def reload(self, node_id: str) -> dict[str, Any]:
        """The node reads its config file (and certificates) again: ``applied``, ``needs_restart``."""
        self._node(node_id)
        return self._action("/reload", via=node_id)
    def add_node(self, node_id: str, host: str, *, bootstrap_port: int | None = None, raft_port: int | None = None,
                 rack: str | None = None, timeout: float = 40.0) -> dict[str, Any]:
        """Add a member (a live Raft membership change, proxy.admin.membership_actions); start its
        process afterwards. Refused (AdminRefused) when it would lose quorum or a change is in flight."""
        body: dict[str, Any] = {"host": host}
        for key, value in (("bootstrap_port", bootstrap_port), ("raft_port", raft_port), ("rack", rack)):
            if value is not None:
                body[key] = value
        return self._action(f"/add-node/{node_id}", body=body, timeout=timeout)

    def remove_node(self, node_id: str, timeout: float = 40.0) -> dict[str, Any]:
        """Drain a member, then remove it from Raft and the fleet (run by another member:
        the leader unless it is the one leaving). Stop its process afterwards."""
        return self._action(f"/remove-node/{node_id}", avoid=node_id, timeout=timeout)


def _refused(r: httpx.Response) -> bool:
    """A 409 that says the action may not run now (quorum, a change in flight), not that it failed."""
    try:
        return r.status_code == 409 and bool(r.json().get("refused"))
    except ValueError:
        return False


def _refusal(r: httpx.Response) -> str:
    """``HTTP 401: missing or wrong bearer token`` from an admin endpoint's JSON error body."""
    try:
        reason = r.json().get("error")
    except ValueError:
        reason = None
    return f"HTTP {r.status_code}: {reason or r.text[:200].strip() or r.reason_phrase}"
