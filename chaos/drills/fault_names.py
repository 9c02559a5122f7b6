"""The names of the drill faults and their two errors (``chaos.drills.faults`` injects them):
a light module the CLI reads for its options without importing the drill machinery."""

from __future__ import annotations

CASCADES = ("kill-two", "freeze-two", "leader-kill-two")  # two nodes of three, one after the other
# Emulated hosts only (chaos.drills.host_faults): one-way drops, a flapping link, two hosts cut off.
HOST_FAULTS = ("partition-one-way", "flap", "partition-two")
# Live membership (issue 15): the fleet grows by two nodes and shrinks back, one change at a time.
MEMBERSHIP_CHANGES = ("grow-shrink",)
FAULTS = (("kill", "freeze", "partition", "leader-kill", "broker-kill", "drain", "rolling-restart") + CASCADES
          + HOST_FAULTS + MEMBERSHIP_CHANGES)
CONTROLS = ("none",)  # no fault: a baseline
FLEET_FAULTS = frozenset(FAULTS) - {"broker-kill"}


class FaultUnavailable(RuntimeError):
    """This fault cannot be injected here; the drill is SKIPPED (never faked)."""


class FaultFailed(RuntimeError):
    """Injecting or undoing the fault failed (message says which step)."""
