"""The seeded fleet simulator (membership.sim) over the real MemberCore, and proof that it can fail.

Replay one seed: ``python -m membership.sim --seed 123`` (or
``KPROXY_SIM_SEED=123 pytest tests/unit/test_simulation.py``); more seeds:
``KPROXY_SIM_SEEDS=2000``.
"""

from __future__ import annotations

import os

import attrs
import pytest

from membership import sim
from membership.control import MemberCore, Publish
from membership.serving import ServingMap, addresses_for, stand_in_duties
from membership.sim import Simulation, SimulationFailure, run_seeds

pytestmark = pytest.mark.unit

DEFAULT_SEEDS = 150


def _seeds() -> list[int]:
    one = os.environ.get("KPROXY_SIM_SEED")
    if one is not None:
        return [int(one)]
    count = int(os.environ.get("KPROXY_SIM_SEEDS", DEFAULT_SEEDS))
    base = int(os.environ.get("KPROXY_SIM_SEED_BASE", 0))
    return list(range(base, base + count))


def test_simulation_many_seeds():
    stats = run_seeds(_seeds())
    print(f"simulated: {stats}")
    assert stats["worst_convergence_s"] <= sim.LIVENESS_BOUND_S
    assert stats["maps_published"] > stats["seeds"]  # the cores really ran


def test_a_seed_replays_exactly():
    a, b = Simulation(11), Simulation(11)
    a.run()
    b.run()
    assert a.trace == b.trace and a.log == b.log
    assert len(a.trace) > 10


def test_the_command_line_replays_a_seed(capsys):
    assert sim.main(["--seed", "3"]) == 0
    assert "seeds=1" in capsys.readouterr().out


def _failures(seeds: range, core_factory=MemberCore) -> list[str]:
    failures = []
    for seed in seeds:
        try:
            Simulation(seed, core_factory).run()
        except SimulationFailure as exc:
            assert f"seed {seed}" in str(exc) and f"--seed {seed}" in str(exc)
            failures.append(str(exc))
    return failures


def test_detects_a_state_machine_that_ignores_expected_epochs(monkeypatch):
    from membership import state as state_mod

    def careless(self, expected_epoch, up, owners, check=True):
        if up == self.up and owners == self.owners:
            return self._unchanged()
        return self._next(up=up, owners=owners)

    monkeypatch.setattr(state_mod.FleetState, "_decide", careless)
    assert _failures(range(100))


class _Tampered(MemberCore):
    """A core whose published maps pass through ``tamper``."""

    def tamper(self, m: ServingMap) -> ServingMap:
        raise NotImplementedError

    def tick(self, now, live, heard_all, raft):
        out = super().tick(now, live, heard_all, raft)
        for i, action in enumerate(out):
            if isinstance(action, Publish):
                self.serving = self.tamper(action.map)
                out[i] = Publish(self.serving)
        return out


class _KeepsFirstOwners(_Tampered):
    """Never moves an identity once it has an owner (a dead owner included)."""

    def tamper(self, m: ServingMap) -> ServingMap:
        first = self.__dict__.setdefault("_first", {})
        owners = {b: first.setdefault(b, p) for b, p in m.owners}
        addresses, error = addresses_for(owners, m.nodes, owners)
        return attrs.evolve(m, owners=owners, addresses=addresses, error=error)


class _StandsInForEveryone(_Tampered):
    """Stand-in duties for every other node, vacant or not."""

    def tamper(self, m: ServingMap) -> ServingMap:
        return attrs.evolve(m, stand_ins=stand_in_duties(m.owner_map(), m.nodes, [n.id for n in m.nodes], idle=()))


class _AdvertisesEverythingItself(_Tampered):
    """Advertises its own address for every identity, whoever owns it."""

    def tamper(self, m: ServingMap) -> ServingMap:
        me = m.node(self.node_id)
        return attrs.evolve(m, addresses={b: me.address_for(b) for b, _ in m.owners}) if me else m


@pytest.mark.parametrize(
    ("core", "expected"),
    [
        (_KeepsFirstOwners, ("two owners", "dead or draining", "not balanced", "no convergence")),
        (_StandsInForEveryone, ("wrong stand-in duty",)),
        (_AdvertisesEverythingItself, ("advertises",)),
    ],
)
def test_detects_a_broken_core(core, expected):
    failures = _failures(range(40), core)
    assert failures, f"{core.__name__} went unnoticed"
    assert any(any(e in f for e in expected) for f in failures), failures[0][:500]
