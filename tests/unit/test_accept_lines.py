"""proxy.accept_lines: the hosts with the fewest connections waiting are served first, one per host per round."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.accept_lines import AcceptLines


def test_a_host_with_one_connection_waiting_goes_before_a_host_with_hundreds():
    lines: AcceptLines[str] = AcceptLines()
    for k in range(300):
        lines.put("10.0.0.1", f"dense-{k}")
    lines.put("10.0.0.2", "sparse")
    assert lines.take(1) == ["sparse"]
    assert lines.take(2) == ["dense-0", "dense-1"]  # then arrival order within the host
    assert len(lines) == 298


def test_rounds_take_one_per_host_shortest_lines_first():
    lines: AcceptLines[str] = AcceptLines()
    for source, n in (("a", 3), ("b", 1), ("c", 2)):
        for k in range(n):
            lines.put(source, f"{source}{k}")
    assert lines.take(10) == ["b0", "c0", "a0", "c1", "a1", "a2"]
    assert len(lines) == 0 and lines.take(5) == []


@given(st.lists(st.tuples(st.sampled_from("abcde"), st.integers()), max_size=200), st.integers(1, 50))
def test_every_item_comes_out_once_and_each_host_in_its_order(puts, n):
    lines: AcceptLines[tuple[str, int]] = AcceptLines()
    for k, (source, _) in enumerate(puts):
        lines.put(source, (source, k))
    out = []
    while len(lines):
        got = lines.take(n)
        assert 0 < len(got) <= n
        out.extend(got)
    assert sorted(out) == sorted((s, k) for k, (s, _) in enumerate(puts))
    for source in "abcde":
        mine = [k for s, k in out if s == source]
        assert mine == sorted(mine)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from("xy")), max_size=100), st.integers(0, 20))
def test_drop_removes_exactly_the_matching_items_and_keeps_the_rest_in_their_order(puts, taken):
    lines: AcceptLines[tuple[str, str, int]] = AcceptLines()
    for k, (source, listener) in enumerate(puts):
        lines.put(source, (source, listener, k))
    first = lines.take(taken)
    dropped = lines.drop(lambda item: item[1] == "x")
    assert all(item[1] == "x" for item in dropped)
    rest = []
    while len(lines):
        rest.extend(lines.take(7))
    assert not any(item[1] == "x" for item in rest)
    assert sorted(first + dropped + rest) == sorted((s, x, k) for k, (s, x) in enumerate(puts))
    for source in "abc":
        mine = [k for s, _, k in rest if s == source]
        assert mine == sorted(mine)
