"""Reading one field of the TOML config: the typed getters every section's parser uses, each
raising :class:`ConfigError` with the dotted path of the field (``proxy.config``,
``proxy.security_config``)."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from membership.config import unknown_key_message
from proxy.hosts import join_host_port

MAX_PORT = 65535


class ConfigError(ValueError):
    """A bad configuration; ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config field '{field}': {message}")
        self.field = field


@attrs.frozen
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)


def get_field(section: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in section:
        if default is ...:
            raise ConfigError(path, "is required")
        return default
    value = section[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(path, f"must be {kind_name(kind)}, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(path, f"must be {kind_name(kind)}, got {value!r}")
    return value


def kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table", bool: "a boolean"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


def port_number(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PORT:
        raise ConfigError(path, f"must be a port number 1..{MAX_PORT}, got {value!r}")
    return value


def host_name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be a host name or IP address, got {value!r}")
    return value


def parse_host_port(value: Any, path: str) -> HostPort:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(path, f"must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    try:
        port_num = int(port)
    except ValueError:
        raise ConfigError(path, f"port of {value!r} is not a number") from None
    return HostPort(host_name(host, path), port_number(port_num, path))


def positive(value: float, path: str) -> float:
    if value <= 0:
        raise ConfigError(path, f"must be positive, got {value!r}")
    return value


def secret(section: Mapping[str, Any], name: str, path: str, env: Mapping[str, str],
            inline_ok: bool = True) -> str | None:
    """A secret comes from the env var named by ``<name>_env`` (or, in memory only, from ``<name>``)."""
    if name in section and not inline_ok:
        raise ConfigError(f"{path}.{name}", f"secrets never go in the config file: put it in an environment "
                                            f"variable and name that variable in {path}.{name}_env")
    if f"{name}_env" in section:
        var = get_field(section, f"{name}_env", f"{path}.{name}_env", str)
        value = env.get(var)
        if not value:
            raise ConfigError(f"{path}.{name}_env", f"environment variable {var} is not set or empty")
        return value
    if name in section:
        value = get_field(section, name, f"{path}.{name}", str)
        if not value:
            raise ConfigError(f"{path}.{name}", "must not be empty")
        return value
    return None


def check_keys(section: Mapping[str, Any], path: str, known: frozenset[str]) -> None:
    for key in section:
        if key not in known:
            raise ConfigError(f"{path}.{key}", unknown_key_message(key, known))
