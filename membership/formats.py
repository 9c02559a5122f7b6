"""Format versions of the replicated fleet state: node-by-node upgrades, pure.

The state every replica holds, its snapshots and the commands in the Raft log
are written in one *format* (an integer). A kproxy release reads and writes a
range of formats (:data:`SUPPORTED`); during a rolling upgrade the fleet holds
nodes of two releases, so:

* every node advertises its range in its ``Join`` (the state records it);
* the fleet's committed format (``FleetState.format``) is set by the first
  Join to that node's lowest format, and only ever goes up, by a leader's
  ``SetFormat``, to the highest format every member supports, once every member
  (every configured one has joined) advertises it (:func:`next_format`). Until
  then the fleet stays at the format it has, so old nodes keep reading it;
* a Join from a node whose range does not include the committed format is
  rejected, and that node refuses to serve, saying which formats it supports
  (:func:`refusal`): it could not read the fleet's state;
* every command names the format that introduced it (``SINCE_FORMAT``, 1 for
  the first ones); the state rejects a command newer than its format, so a new
  node never writes what an old one cannot read.

Upgrade recipe (README): restart nodes one at a time on the new release (its
range includes the fleet's format); once the last one has joined, the leader
commits the new format by itself. A node whose range excludes the fleet's
format (too old, or too new: it dropped the fleet's format) is refused.

``KPROXY_FORMATS`` (``"2"``, ``"1-2"``) overrides a node's range: a test hook
that lets one commit play two releases (tests/integration/test_formats.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from topology import ProxyId

#: The format of the first versioned release; the commands of that release carry SINCE_FORMAT 1.
FIRST_FORMAT = 1
#: No format committed yet (an empty state, before the first Join).
NO_FORMAT = 0
FORMATS_ENV = "KPROXY_FORMATS"


@attrs.frozen(slots=True)
class FormatRange:
    """The formats a node reads and writes: ``lo`` .. ``hi``, inclusive."""

    lo: int
    hi: int

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"a format range needs 1 <= lo <= hi, got {self.lo}..{self.hi}")

    def __contains__(self, fmt: object) -> bool:
        return isinstance(fmt, int) and self.lo <= fmt <= self.hi

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}..{self.hi}"


#: What this release reads and writes.
SUPPORTED = FormatRange(FIRST_FORMAT, FIRST_FORMAT)


def parse_range(text: str) -> FormatRange:
    """``"2"`` -> 2..2, ``"1-2"`` or ``"1..2"`` -> 1..2; ValueError naming the text otherwise."""
    parts = text.strip().replace("..", "-").split("-")
    try:
        numbers = [int(p) for p in parts]
        if len(numbers) == 1:
            return FormatRange(numbers[0], numbers[0])
        if len(numbers) == 2:
            return FormatRange(numbers[0], numbers[1])
    except ValueError:
        pass
    raise ValueError(f"{FORMATS_ENV}={text!r}: expected a format or a range such as '1-2'")


def refusal(node: str, fleet_format: int, mine: FormatRange) -> str | None:
    """Why ``node`` (reading ``mine``) cannot serve in a fleet at ``fleet_format``, or None."""
    if fleet_format == NO_FORMAT or fleet_format in mine:
        return None
    return (f"node {node} supports state formats {mine}, the fleet's committed format is {fleet_format}: "
            f"it cannot read the fleet's state and does not join (run a release that supports format "
            f"{fleet_format})")


def next_format(current: int, advertised: Mapping[ProxyId, FormatRange], members: Iterable[ProxyId]) -> int | None:
    """The format the leader should commit next, or None to stay at ``current``.

    The highest format that every one of ``members`` advertises, if higher than
    ``current``; None while a member has not advertised a range (not joined yet:
    it might be an old node) or when they share nothing higher."""
    if current == NO_FORMAT:
        return None  # the first Join sets it
    ranges = []
    for member in members:
        if member not in advertised:
            return None
        ranges.append(advertised[member])
    if not ranges:
        return None
    common_hi = min(r.hi for r in ranges)
    if common_hi <= current or any(common_hi not in r for r in ranges):
        return None
    return common_hi


def readable_across_formats(cls: type) -> type:
    """Pickling of an attrs class whose later releases add fields (with defaults): an
    instance pickled by an older release unpickles with the new fields at their
    defaults, instead of attrs' default of leaving them unset (an AttributeError at the
    first read, on the Raft tick thread). Apply after ``attrs.frozen``."""
    fields = attrs.fields(cls)

    def getstate(self: object) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields}

    def setstate(self: object, state: dict[str, object]) -> None:
        for f in fields:
            if f.name in state:
                value = state[f.name]
            elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
                value = f.default.factory(self) if f.default.takes_self else f.default.factory()
            elif f.default is attrs.NOTHING:
                raise ValueError(f"{cls.__name__}.{f.name}: missing from the pickled value and has no default")
            else:
                value = f.default
            object.__setattr__(self, f.name, value)

    cls.__getstate__ = getstate  # type: ignore[attr-defined]
    cls.__setstate__ = setstate  # type: ignore[attr-defined]
    return cls
