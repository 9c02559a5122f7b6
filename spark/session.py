"""One place that knows how to start Spark for kproxy.

Sized for a 2-core machine and CI time: local[2], no UI, few shuffle
partitions, Arrow for toPandas, everything bound to 127.0.0.1, a small driver
heap. Under ``spark-submit`` the master and resources come from the command
line; ``get_session`` then only adds the SQL settings.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[2]"
DEFAULT_SHUFFLE_PARTITIONS = 4
DEFAULT_DRIVER_MEMORY = "1g"
LOOPBACK = "127.0.0.1"

# Serial GC: no GC thread pool to start, and a 1-2 GiB heap on 2 cores does
# not gain from a concurrent collector. KPROXY_SPARK_JVM_OPTIONS replaces it;
# the test suite adds -XX:TieredStopAtLevel=1 (C1 only: ~40% less CPU on tiny
# traces, but ~50% slower on 10M events, so not the default).
DEFAULT_JVM_OPTIONS = "-XX:+UseSerialGC"
JVM_OPTIONS_ENV = "KPROXY_SPARK_JVM_OPTIONS"

# Settings that only take effect when this process launches the JVM.
_LAUNCH_CONF: dict[str, str] = {
    "spark.driver.host": LOOPBACK,
    "spark.driver.bindAddress": LOOPBACK,
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


def jvm_options() -> str:
    return os.environ.get(JVM_OPTIONS_ENV, DEFAULT_JVM_OPTIONS)

# Settings that can be changed on a running session.
_SQL_CONF: dict[str, str] = {
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "true",
}


def configure_environment() -> None:
    """Environment the JVM and Python workers read at launch (loopback only)."""
    os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # The project pins pandas 3, which PySpark 4.3 warns about on import; the
    # toPandas path the jobs use works (tested).
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    warnings.filterwarnings("ignore", message="The copy keyword is deprecated")


def under_spark_submit() -> bool:
    """True when spark-submit launched this Python process (JVM already up)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_session(
    master: str | None = None,
    *,
    app_name: str = "kproxy-report",
    shuffle_partitions: int = DEFAULT_SHUFFLE_PARTITIONS,
    driver_memory: str | None = None,
    log_level: str = "ERROR",
    extra_conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """The active session if there is one (unchanged), else a new one.

    ``master=None`` means spark-submit's master, or local[2] outside it.
    """
    configure_environment()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    elif not under_spark_submit():
        builder = builder.master(DEFAULT_MASTER)
    conf: dict[str, str] = dict(_LAUNCH_CONF)
    conf["spark.driver.extraJavaOptions"] = conf["spark.executor.extraJavaOptions"] = jvm_options()
    conf["spark.driver.memory"] = driver_memory or os.environ.get("KPROXY_SPARK_DRIVER_MEMORY", DEFAULT_DRIVER_MEMORY)
    conf.update(_SQL_CONF)
    conf["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    conf["spark.log.level"] = log_level
    if extra_conf:
        conf.update(extra_conf)
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
