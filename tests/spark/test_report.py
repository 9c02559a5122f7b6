"""run_report and `kproxy report` on the small hand-made drill (tests/spark/traces.py).

small_drill: one kill at 2000 ms; producer p1 (aiokafka) and consumer c1
(java) both have a 700 ms gap across it; node_down after 150 ms, commit 30 ms
later; c1 never reads k3 (lost) and reads k5 twice (duplicated).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from tests.spark.traces import ns, small_drill

pytestmark = pytest.mark.spark

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["report", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def unhealthy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_drill().write_jsonl(tmp_path_factory.mktemp("unhealthy") / "trace")


@pytest.fixture(scope="module")
def unhealthy(spark_session, unhealthy_trace):  # type: ignore[no-untyped-def]
    """`kproxy report TRACE --out OUT --json` once; (click result, printed report)."""
    result = invoke(str(unhealthy_trace), "--out", str(unhealthy_trace.parent / "out"), "--json")
    return result, json.loads(result.stdout)


@pytest.fixture(scope="module")
def report(unhealthy):  # type: ignore[no-untyped-def]
    return unhealthy[1]


def test_cli_unhealthy_exits_1_and_prints_the_report(unhealthy, unhealthy_trace):  # type: ignore[no-untyped-def]
    result, printed = unhealthy
    assert result.exit_code == 1, result.output
    assert printed == json.loads((unhealthy_trace.parent / "out" / "report.json").read_text())


def test_report_figures(report, unhealthy_trace):  # type: ignore[no-untyped-def]
    one = {"p50": 700.0, "p99": 700.0, "max": 700.0, "clients": 1, "unrecovered": 0}
    assert report["rto_ms"] == {"kill": {"aiokafka": one, "java": one}}
    assert report["detect_ms"]["kill"] == {"p50": 150.0, "p99": 150.0, "max": 150.0, "n": 1, "faults": 1}
    assert report["commit_ms"]["kill"] == {"p50": 30.0, "p99": 30.0, "max": 30.0, "n": 1, "faults": 1}
    assert report["failover_ms"]["kill"]["max"] == 180.0
    # clients back: p1's first ack after the fault at 2600, c1's first read at 2650; commit at 2180
    assert [(f["clients_back_ns"], f["back_ms"]) for f in report["faults"]] == [(ns(2650), 470.0)]
    assert report["lost"] == {
        "count": 1,
        "keys": ["k3"],
        "records": [{"run_id": "d1", "topic": "t", "key": "k3", "seq": 3}],
        "truncated": False,
    }
    assert report["duplicated"]["count"] == 1
    assert report["duplicated"]["keys"] == ["k5"]
    assert report["duplicated"]["records"] == [
        {"run_id": "d1", "topic": "t", "group": "g1", "key": "k5", "seq": 5, "times": 2}
    ]
    assert report["healthy"] is False
    assert [(r["run_id"], r["events"], r["clients"], r["faults"]) for r in report["runs"]] == [("d1", 107, 2, 1)]
    assert report["events"] == 107 and report["format"] == "jsonl" and report["files"] == 3
    assert report["trace_dir"] == str(unhealthy_trace.resolve())


def test_report_files(report, unhealthy_trace):  # type: ignore[no-untyped-def]
    out = unhealthy_trace.parent / "out"
    assert set(report["plots"]) == {"throughput", "rto_cdf", "failover"}
    for path in report["plots"].values():
        assert Path(path).parent == out.resolve()
        assert Path(path).read_bytes()[:8] == PNG_MAGIC
    summary = (out / "summary.txt").read_text()
    assert "UNHEALTHY: 1 lost, 1 duplicated" in summary
    assert "k3" in summary and "700.0" in summary
    timeline = (out / "timeline.csv").read_text().splitlines()
    # run d1 spans 900 (drill_start) .. 5000 (drill_end): buckets 0..41
    assert timeline[0] == "run_id,bucket,t_ms,acks,consumes,faults"
    assert len(timeline) == 1 + 42


def test_cli_healthy_exits_0_and_prints_the_summary(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    builder = small_drill(clean=True)
    # a second drill, a drain: no node_down, commit 12.5 ms after the fault; no client left
    builder.fleet("d1", "drill_start", 6000, fault="drain")
    builder.fleet("d1", "fault", 6500, fault="drain", node="p3")
    builder.fleet("d1", "assignment_committed", 6512.5, epoch=4)
    builder.fleet("d1", "drill_end", 7000, fault="drain")
    trace = builder.write_jsonl(tmp_path / "trace")
    result = invoke(str(trace))
    assert result.exit_code == 0, result.output
    assert "HEALTHY: no lost and no duplicated records" in result.stdout
    assert "700.0" in result.stdout  # the RTO table
    written = json.loads((trace / "report" / "report.json").read_text())  # default --out
    assert written["lost"]["count"] == 0 and written["duplicated"]["count"] == 0
    assert written["rto_ms"]["kill"]["java"]["max"] == 700.0
    assert "drain" not in written["rto_ms"]  # no client was running during the drain
    # nanosecond timestamps stay exact integers next to a missing one
    assert [(f["fault"], f["node_down_ns"], f["committed_ns"], f["commit_ms"]) for f in written["faults"]] == [
        ("kill", ns(2150), ns(2180), 30.0),
        ("drain", None, ns(6512.5), 12.5),
    ]
    assert written["detect_ms"]["drain"] == {"p50": None, "p99": None, "max": None, "n": 0, "faults": 1}


def test_cli_malformed_trace_exits_2_naming_file_and_line(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    trace = small_drill().write_jsonl(tmp_path / "trace")
    path = trace / "c1.jsonl"
    content = path.read_text().splitlines()
    content[9] = content[9].replace('"offset":9', '"offset":9.0')
    path.write_text("\n".join(content) + "\n")
    result = invoke(str(trace))
    assert result.exit_code == 2
    assert f"{path}:10: field 'offset' must be a JSON integer, got 9.0" in result.stderr


def test_cli_missing_directory_exits_2(tmp_path):  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2


def test_listing_is_capped_and_counts_stay_exact(spark_session, unhealthy_trace, tmp_path):  # type: ignore[no-untyped-def]
    from spark import jobs, load

    trace = jobs.extract_trace(spark_session, unhealthy_trace)
    tables = jobs.transform_all(trace.events)
    try:
        capped = load.build_report(tables, trace, tmp_path / "capped", max_listed=0)
    finally:
        tables.release()
        trace.release()
    assert capped["lost"] == {"count": 1, "keys": [], "records": [], "truncated": True}
    assert (capped["duplicated"]["count"], capped["duplicated"]["extra_deliveries"]) == (1, 1)
    assert capped["duplicated"]["truncated"] is True


def test_trace_without_faults_reports_no_rto_and_still_draws(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    from spark.jobs import run_report

    builder = small_drill(clean=True)
    builder.events = [e for e in builder.events if e["source"] == "client"]  # a baseline run: no drill
    trace = builder.write_jsonl(tmp_path / "trace")
    report = run_report(trace, tmp_path / "out")
    assert report["faults"] == [] and report["rto_ms"] == {} and report["detect_ms"] == {}
    assert report["healthy"] is True
    assert [(r["run_id"], r["faults"]) for r in report["runs"]] == [("d1", 0)]
    for path in report["plots"].values():
        assert Path(path).read_bytes()[:8] == PNG_MAGIC


def test_cli_reports_every_run_of_a_drill_out_directory(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    """`kproxy drill run --out X` then `kproxy report X`: the traces are one level down,
    <run_id>/trace/*.jsonl, beside each run's logs; a row per run and the totals."""
    out = tmp_path / "drills"
    small_drill().write_jsonl(out / "kill-1-111" / "trace")
    clean = small_drill(clean=True)
    for event in clean.events:
        event["run_id"] = "d2"
    clean.write_jsonl(out / "kill-2-222" / "trace")
    (out / "kill-1-111" / "logs").mkdir()
    (out / "kill-1-111" / "logs" / "p1.log").write_text("a node's log, not a trace\n")
    result = invoke(str(out), "--json")
    assert result.exit_code == 1, result.output  # run d1 lost and duplicated a record
    report = json.loads(result.stdout)
    assert report["files"] == 6 and report["events"] == 2 * 107  # clean: k3 read once more, k5 once less
    assert [(r["run_id"], r["faults"], r["fault_types"], r["clients"], r["rto_max_ms"], r["lost"], r["duplicated"])
            for r in report["runs"]] == [("d1", 1, "kill", 2, 700.0, 1, 1), ("d2", 1, "kill", 2, 700.0, 0, 0)]
    summary = (out / "report" / "summary.txt").read_text()
    assert "Runs" in summary and "total (2 runs)" in summary
    total = next(line for line in summary.splitlines() if "total (2 runs)" in line)
    assert [cell for cell in total.split() if cell != "│"][-3:] == ["700.0", "1", "1"]


def test_demo_final_screen_reports_and_tables_each_family(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    """The end of `make demo` (`kproxy demo --replay OUT`, on the hand-made drill): `kproxy report`
    over the drill's --out, where the plots are, then a row per client family in whole ms."""
    out = tmp_path / "demo" / "trace"
    small_drill().write_jsonl(out / "kill-1-111" / "trace")
    result = CliRunner().invoke(cli, ["demo", "--replay", str(out)], catch_exceptions=False,
                                env={"COLUMNS": "100"})
    assert result.exit_code == 1, result.output  # k3 lost, k5 duplicated
    text = result.output
    assert f"kproxy report {out}" in text
    assert f"report: {out.resolve() / 'report'}/report.json" in text
    for name in ("throughput.png", "rto_cdf.png", "failover_breakdown.png"):
        assert str(out.resolve() / "report" / name) in text
    rows = {cells[0]: cells[1:] for cells in (
        [c for c in line.replace("│", " ").split()] for line in text.splitlines()) if cells and cells[0] in (
        "aiokafka", "java")}
    # family: clients, RTO p50/p99/max (whole ms), lost, duplicated
    assert rows == {"aiokafka": ["1", "700", "700", "700", "1", "0"], "java": ["1", "700", "700", "700", "0", "1"]}
    assert text.rstrip().splitlines()[-1] == "records lost or duplicated (see the report)"


def test_demo_family_table_fits_80_columns():
    from rich.console import Console

    from cli.demo_cmd import family_table
    from chaos.measures import FamilyOutcome

    console = Console(width=80, record=True)
    console.print(family_table([FamilyOutcome("kafka-python", 1, 123456.0, 123456.0, 123456.0, 10000, 10000)]))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 and "…" not in line for line in lines), lines
    assert any("duplicated" in line and "kafka-python" not in line for line in lines)
    assert any("kafka-python" in line and "123456" in line for line in lines)


def test_breakdown_plot_stacks_detected_committed_and_clients_back():
    import pandas as pd

    from spark import plots

    fault = {"run_id": "d1", "fault_idx": 0, "fault": "kill", "detect_ms": 150.0, "commit_ms": 30.0, "back_ms": 470.0}
    ax = plots.failover_breakdown(pd.DataFrame([fault])).axes[0]
    assert [(p.get_x(), p.get_width()) for p in ax.patches] == [(0.0, 150.0), (150.0, 30.0), (180.0, 470.0)]
