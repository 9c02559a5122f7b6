"""One small local Spark session for the whole spark test suite.

local[2], UI off, 2 shuffle partitions, Arrow on, driver bound to 127.0.0.1
(SPARK_LOCAL_IP too), 1 GiB driver heap: see spark/session.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark.session import JVM_OPTIONS_ENV, configure_environment, get_session

# Tiny traces: C1-only JIT costs ~40% less CPU than the default tiered JIT.
# Inherited by every JVM the suite starts (fixture session, notebook kernel,
# CLI subprocess, standalone master/worker).
TEST_JVM_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
os.environ.setdefault(JVM_OPTIONS_ENV, TEST_JVM_OPTIONS)




def pytest_configure(config: pytest.Config) -> None:
    # pandas 3 deprecation inside PySpark's own toPandas conversion
    config.addinivalue_line("filterwarnings", "ignore:The copy keyword is deprecated")


@pytest.fixture(scope="session")
def spark_session() -> Iterator[SparkSession]:
    configure_environment()
    session = get_session("local[2]", app_name="kproxy-tests", shuffle_partitions=2, driver_memory="1g")
    yield session
    session.stop()
