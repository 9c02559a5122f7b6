"""The unchanged job under spark-submit on a local standalone cluster (master + worker from the pip package)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spark.session import jvm_options
from spark.standalone import LocalStandalone, loopback_env, spark_submit
from tests.spark.traces import small_drill

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_spark_submit_jobs_py_on_standalone_cluster(tmp_path: Path) -> None:
    trace = small_drill().write_jsonl(tmp_path / "trace")
    out = tmp_path / "report"
    cluster = LocalStandalone(tmp_path / "cluster", cores=1, memory="1g")
    cluster.start(timeout_s=120)
    try:
        assert cluster.master is not None and cluster.worker is not None
        command = [
            spark_submit(),
            "--master", cluster.url,
            "--conf", "spark.driver.host=127.0.0.1",
            "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.sql.shuffle.partitions=2",
            "--driver-java-options", jvm_options(),
            "--conf", f"spark.executor.extraJavaOptions={jvm_options()}",
            "--driver-memory", "512m",
            "--executor-memory", "512m",
            "--total-executor-cores", "1",
            str(REPO / "spark" / "jobs.py"), str(trace), "--out", str(out), "--json",
        ]  # fmt: skip
        env = loopback_env(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
        proc = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=420)
        state = cluster.state()
    finally:
        cluster.stop()
    # exactly the two processes we started are gone
    assert cluster.master.returncode is not None and cluster.worker.returncode is not None

    assert proc.returncode == 1, proc.stderr[-3000:]  # 1: the trace has a lost and a duplicated record
    report = json.loads(proc.stdout)
    assert report["rto_ms"]["kill"]["aiokafka"]["max"] == 700.0
    assert report["rto_ms"]["kill"]["java"]["p50"] == 700.0
    assert report["detect_ms"]["kill"]["p50"] == 150.0
    assert report["lost"]["keys"] == ["k3"] and report["duplicated"]["keys"] == ["k5"]
    assert json.loads((out / "report.json").read_text())["events"] == 107
    assert all(Path(p).is_file() for p in report["plots"].values())
    # it ran on the cluster, not in local mode
    assert state is not None
    apps = state["activeapps"] + state["completedapps"]
    assert len(apps) == 1
