"""The notebook runs headless on the small hand-made drill and shows the jobs' numbers and plots."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.spark.traces import small_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "spark" / "notebooks" / "failover_replay.ipynb"


def test_notebook_executes_and_shows_plots_and_numbers(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    trace = small_drill().write_jsonl(tmp_path / "trace")
    monkeypatch.setenv("KPROXY_TRACE_DIR", str(trace))
    monkeypatch.setenv("KPROXY_REPORT_DIR", str(tmp_path / "report"))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert any("parameters" in cell.metadata.get("tags", []) for cell in nb.cells)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.output_type == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) == 3  # throughput, RTO CDF, detection/commit
    text = "\n".join(
        out.get("text", "") if out.output_type == "stream" else out.get("data", {}).get("text/plain", "")
        for out in outputs
    )
    assert "107 events from 3 jsonl file(s)" in text
    assert '"p50": 700.0' in text  # RTO of p1 and c1
    assert '"p50": 150.0' in text  # detect
    assert '"p50": 30.0' in text  # commit
    assert "lost: 1 ['k3']" in text
    assert "duplicated: 1 ['k5']" in text
    assert (tmp_path / "report" / "report.json").is_file()
