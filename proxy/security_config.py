"""The ``[security]`` section: TLS toward clients and brokers, the node's own SASL login.

::

    [security.listeners]                  # TLS on the node's listeners (clients -> proxy)
    cert = "/etc/kproxy/node.crt"         # PEM chain: the node's certificate first
    key = "/etc/kproxy/node.key"          # PEM key (unencrypted)
    client_ca = "/etc/kproxy/ca.pem"      # optional: verify client certificates (mTLS) against it
    client_auth = "required"              # with client_ca: "required" (default) or "optional"
    plaintext = ["bootstrap"]             # optional: listeners left plaintext ("bootstrap" or broker ids)
    reload_interval_s = 5.0               # poll cert/key mtimes this often (and reload on SIGHUP); 0: SIGHUP only

    [security.upstream]                   # TLS to the brokers (proxy -> brokers)
    tls = true
    ca = "/etc/kproxy/kafka-ca.pem"       # optional: the system's CAs otherwise
    check_hostname = true                 # verify the broker's name (default on)
    cert = "..."                          # optional client certificate (the broker asks for mTLS)
    key = "..."

    [security.upstream_sasl]              # the node's own login, for its discovery connections only;
    mechanism = "SCRAM-SHA-512"           # clients' SASL passes through untouched
    username = "kproxy"
    password_env = "KPROXY_UPSTREAM_PASSWORD"

    [security.admin]                      # the admin endpoint over HTTPS
    cert = "..."
    key = "..."

Every path is checked at load: a missing or unreadable file is a ConfigError
naming its field (``kproxy run`` exits 2).

The certificate of a node must name every address it may serve: its own host
and, with address takeover, every other node's host (a survivor stands in on a
vacant node's address and answers TLS there with its own certificate). Issue one
certificate whose subjectAltName lists all node hosts (IP and DNS entries), or
one per node that lists all of them.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

import attrs

from membership.config import unknown_key_message
from proxy.config import ConfigError
from proxy.config_fields import get_field as _get
from proxy.config_fields import secret as _secret

SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
BOOTSTRAP_NAME = "bootstrap"
DEFAULT_RELOAD_INTERVAL_S = 5.0


@attrs.frozen
class ListenerTls:
    cert: str
    key: str
    client_ca: str | None = None
    client_required: bool = True
    plaintext: frozenset[int] = frozenset()  # listeners left plaintext (BOOTSTRAP = -1, broker ids)
    reload_interval_s: float = DEFAULT_RELOAD_INTERVAL_S


@attrs.frozen
class UpstreamTls:
    ca: str | None = None
    check_hostname: bool = True
    cert: str | None = None
    key: str | None = None


@attrs.frozen
class UpstreamSasl:
    """The node's own SASL login (discovery). ``repr`` hides the password: configs get logged."""

    mechanism: str
    username: str
    password: str = attrs.field(repr=False)


@attrs.frozen
class AdminTls:
    cert: str
    key: str


@attrs.frozen
class SecurityConfig:
    listeners: ListenerTls | None = None
    upstream_tls: UpstreamTls | None = None
    upstream_sasl: UpstreamSasl | None = None
    admin: AdminTls | None = None


# The keys of each table of [security]: any other is refused, naming the closest.
TABLE_KEYS: dict[str, frozenset[str]] = {
    "listeners": frozenset({"cert", "key", "client_ca", "client_auth", "plaintext", "reload_interval_s"}),
    "upstream": frozenset({"tls", "ca", "check_hostname", "cert", "key"}),
    "upstream_sasl": frozenset({"mechanism", "username", "password", "password_env"}),
    "admin": frozenset({"cert", "key"}),
}


def parse_security(raw: Mapping[str, Any], env: Mapping[str, str], inline_secrets: bool = True) -> SecurityConfig:
    """``inline_secrets=False`` (a file): the SASL password must come from ``password_env``."""
    for key in raw:
        if key not in TABLE_KEYS:
            raise ConfigError(f"security.{key}", unknown_key_message(key, TABLE_KEYS, what="section"))
        if isinstance(raw[key], dict):
            for inner in raw[key]:
                if inner not in TABLE_KEYS[key]:
                    raise ConfigError(f"security.{key}.{inner}", unknown_key_message(inner, TABLE_KEYS[key]))
    out = SecurityConfig(
        listeners=_listeners(raw["listeners"]) if "listeners" in raw else None,
        upstream_tls=_upstream(raw["upstream"]) if "upstream" in raw else None,
        upstream_sasl=_sasl(raw["upstream_sasl"], env, inline_secrets) if "upstream_sasl" in raw else None,
        admin=_admin(raw["admin"]) if "admin" in raw else None,
    )
    return out


def readable(section: Mapping[str, Any], key: str, path: str, required: bool = True) -> str | None:
    """A file path that exists and can be read now."""
    value = _get(section, key, path, str, ... if required else None)
    if value is None:
        return None
    try:
        with open(value, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(path, f"cannot read {value}: {exc.strerror or exc}") from None
    return os.path.abspath(value)


def check_pair(cert: str, key: str, path: str) -> None:
    """The chain and key load into a TLS context (a key that is not the certificate's fails here)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(path, f"certificate {cert} and key {key} do not load: {exc}") from None


def check_ca(ca: str, path: str) -> None:
    try:
        ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(path, f"{ca} is not a PEM CA bundle: {exc}") from None


def _server_pair(raw: Any, p: str) -> tuple[str, str]:
    """A table's required ``cert`` and ``key`` (a server's): readable, and loading as a pair."""
    if not isinstance(raw, dict):
        raise ConfigError(p, "must be a table")
    cert = readable(raw, "cert", f"{p}.cert")
    key = readable(raw, "key", f"{p}.key")
    assert cert is not None and key is not None
    check_pair(cert, key, f"{p}.cert")
    return cert, key


def _listeners(raw: Any) -> ListenerTls:
    p = "security.listeners"
    cert, key = _server_pair(raw, p)
    client_ca = readable(raw, "client_ca", f"{p}.client_ca", required=False)
    if client_ca is not None:
        check_ca(client_ca, f"{p}.client_ca")
    auth = _get(raw, "client_auth", f"{p}.client_auth", str, "required")
    if auth not in ("required", "optional"):
        raise ConfigError(f"{p}.client_auth", f"must be 'required' or 'optional', got {auth!r}")
    if "client_auth" in raw and client_ca is None:
        raise ConfigError(f"{p}.client_auth", "needs client_ca (the CA client certificates are checked against)")
    plaintext = set()
    for i, name in enumerate(_get(raw, "plaintext", f"{p}.plaintext", list, [])):
        if name == BOOTSTRAP_NAME:
            plaintext.add(-1)
        elif isinstance(name, int) and not isinstance(name, bool) and name >= 0:
            plaintext.add(name)
        else:
            raise ConfigError(f"{p}.plaintext[{i}]", f"must be 'bootstrap' or a broker id, got {name!r}")
    interval = _get(raw, "reload_interval_s", f"{p}.reload_interval_s", float, DEFAULT_RELOAD_INTERVAL_S)
    if interval < 0:
        raise ConfigError(f"{p}.reload_interval_s", "must be 0 (SIGHUP only) or positive")
    return ListenerTls(cert=cert, key=key, client_ca=client_ca, client_required=auth == "required",
                       plaintext=frozenset(plaintext), reload_interval_s=interval)


def _upstream(raw: Any) -> UpstreamTls | None:
    p = "security.upstream"
    if not isinstance(raw, dict):
        raise ConfigError(p, "must be a table")
    if not _get(raw, "tls", f"{p}.tls", bool, True):
        return None
    ca = readable(raw, "ca", f"{p}.ca", required=False)
    if ca is not None:
        check_ca(ca, f"{p}.ca")
    cert = readable(raw, "cert", f"{p}.cert", required=False)
    key = readable(raw, "key", f"{p}.key", required=cert is not None)
    if key is not None and cert is None:
        raise ConfigError(f"{p}.cert", "is required with security.upstream.key")
    if cert is not None and key is not None:
        check_pair(cert, key, f"{p}.cert")
    return UpstreamTls(ca=ca, check_hostname=_get(raw, "check_hostname", f"{p}.check_hostname", bool, True),
                       cert=cert, key=key)


def _sasl(raw: Any, env: Mapping[str, str], inline_secrets: bool) -> UpstreamSasl:
    p = "security.upstream_sasl"
    if not isinstance(raw, dict):
        raise ConfigError(p, "must be a table")
    mechanism = _get(raw, "mechanism", f"{p}.mechanism", str).upper()
    if mechanism not in SASL_MECHANISMS:
        raise ConfigError(f"{p}.mechanism", f"must be one of {list(SASL_MECHANISMS)}, got {mechanism!r}")
    password = _secret(raw, "password", p, env, inline_secrets)
    if password is None:
        raise ConfigError(f"{p}.password", "is required (or password_env); for OAUTHBEARER: the token")
    return UpstreamSasl(mechanism=mechanism, username=_get(raw, "username", f"{p}.username", str, ""),
                        password=password)


def _admin(raw: Any) -> AdminTls:
    cert, key = _server_pair(raw, "security.admin")
    return AdminTls(cert=cert, key=key)
