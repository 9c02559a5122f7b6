"""Config reload (SIGHUP, ``POST /reload``): what a running node changes now, what needs a restart.

Pure: :func:`plan_reload` compares the config in effect with the file read again and returns a
:class:`ReloadPlan`: the config the node runs with from now on (the one in effect, with the
fields of :data:`RELOADABLE` taken from the file), the changed fields it applies, and the
changed fields it does not (each named as in the file: ``limits.listen_backlog``,
``nodes[p1].workers``, ``security.listeners.cert``). The I/O shells (proxy.runtime,
proxy.supervisor) read the file, apply the plan, log it and answer it.

What applies now and where it takes effect:

* ``logging.level``: every line from now on;
* ``limits.max_connections``, ``limits.accepts_per_source_per_s``: the next new connection
  (proxy.admission); connections held are never closed by a lower limit;
* ``limits.max_frame_bytes``, ``limits.high_water_bytes``, ``limits.splice_min_bytes``: new
  connections; ``limits.connect_timeout_s``: the next broker connection;
* ``limits.drain_timeout_s``: the next graceful drain (SIGTERM);
* ``upstream.refresh_interval_s``: the next broker discovery round;
* ``admin.token``: the next admin request (its environment variable is read again only if its
  name changed: a process's environment does not change).

Certificates are not config fields: their files are read again on every reload (proxy.tls).
Everything else (addresses, ports, listeners' backlog, Fetch version cap, workers, the fleet's
Raft settings, TLS file paths, log format) is bound at start: named in ``needs_restart``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from proxy.config import Config, Limits

LIMITS_NOW = ("max_connections", "accepts_per_source_per_s", "max_frame_bytes", "high_water_bytes",
              "splice_min_bytes", "connect_timeout_s", "drain_timeout_s")
RELOADABLE = frozenset({"logging.level", "upstream.refresh_interval_s", "admin.token"}
                       | {f"limits.{name}" for name in LIMITS_NOW})

# Config's attributes by their names in the file; ``source`` (where it was read from) is no field.
_FILE_NAMES = {"upstream": "upstream.bootstrap", "refresh_interval_s": "upstream.refresh_interval_s",
               "port_base": "ports.base", "port_map": "ports.map", "log_level": "logging.level",
               "log_format": "logging.format", "admin_token": "admin.token", "tap_dir": "debug.tap_dir"}


@attrs.frozen
class ReloadPlan:
    config: Config  # what the node runs with after the reload
    applied: tuple[str, ...]  # changed fields in effect now
    needs_restart: tuple[str, ...]  # changed fields that keep their old value until a restart

    @property
    def changed(self) -> bool:
        return bool(self.applied or self.needs_restart)

    def to_json(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "needs_restart": list(self.needs_restart)}


def _diff(old: Any, new: Any, path: str) -> Iterable[str]:
    """Dotted names of the leaves that differ (attrs values recursed, the rest compared whole)."""
    if old == new:
        return
    if attrs.has(type(old)) and type(old) is type(new):
        for f in attrs.fields(type(old)):
            yield from _diff(getattr(old, f.name), getattr(new, f.name), f"{path}.{f.name}")
        return
    yield path


def _nodes_diff(old: Iterable[Any], new: Iterable[Any]) -> Iterable[str]:
    before, after = {n.id: n for n in old}, {n.id: n for n in new}
    for node_id in sorted(before.keys() | after.keys()):
        if node_id not in before or node_id not in after:
            yield f"nodes[{node_id}]"
        else:
            yield from _diff(before[node_id], after[node_id], f"nodes[{node_id}]")


def changed_fields(old: Config, new: Config) -> list[str]:
    """Every field that differs between two configs, named as in the file, sorted."""
    out: list[str] = []
    for f in attrs.fields(Config):
        if f.name == "source":
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name == "nodes":
            out.extend(_nodes_diff(a, b))
        else:
            out.extend(_diff(a, b, _FILE_NAMES.get(f.name, f.name)))
    return sorted(out)


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """What reloading ``new`` over ``old`` (the config in effect) does; see the module doc."""
    changed = changed_fields(old, new)
    applied = tuple(c for c in changed if c in RELOADABLE)
    limits: Limits = attrs.evolve(old.limits, **{name: getattr(new.limits, name) for name in LIMITS_NOW})
    config = attrs.evolve(old, limits=limits, log_level=new.log_level, admin_token=new.admin_token,
                          refresh_interval_s=new.refresh_interval_s)
    return ReloadPlan(config, applied, tuple(c for c in changed if c not in RELOADABLE))
