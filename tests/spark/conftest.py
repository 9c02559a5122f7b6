"""One small local Spark session for the whole spark test suite.

local[2], UI off, 2 shuffle partitions, Arrow on, driver bound to 127.0.0.1
(SPARK_LOCAL_IP too), 1 GiB driver heap: see spark/session.py.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from spark.session import JVM_OPTIONS_ENV, configure_environment, get_session

# Tiny traces: C1-only JIT costs ~40% less CPU than the default tiered JIT.
# Inherited by every JVM the suite starts (fixture session, notebook kernel,
# CLI subprocess, standalone master/worker).
TEST_JVM_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
os.environ.setdefault(JVM_OPTIONS_ENV, TEST_JVM_OPTIONS)


def _stand_in_for_pandas_on_spark() -> None:
    """Let ``assertDataFrameEqual`` compare Spark DataFrames under pandas 3.

    With pandas and pyarrow installed, ``assertDataFrameEqual`` imports
    ``pyspark.pandas`` (pandas-on-Spark) only to ask whether an argument is one
    of its frames. PySpark 4.3's pandas-on-Spark does not import under pandas 3
    (it needs names pandas 3 removed), so every call fails before comparing.
    When (and only when) that import fails, register empty stand-ins: no
    argument is ever a pandas-on-Spark frame, and the Spark DataFrame
    comparison runs unchanged. Nothing in spark/ uses pandas-on-Spark.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            import pyspark.pandas  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "pyspark.pandas" or m.startswith("pyspark.pandas.")]:
            del sys.modules[name]
        stand_in = types.ModuleType("pyspark.pandas")
        stand_in.DataFrame = type("DataFrame", (), {})  # type: ignore[attr-defined]
        utils = types.ModuleType("pyspark.testing.pandasutils")
        utils.PandasOnSparkTestUtils = type("PandasOnSparkTestUtils", (), {})  # type: ignore[attr-defined]
        sys.modules["pyspark.pandas"] = stand_in
        sys.modules["pyspark.testing.pandasutils"] = utils


_stand_in_for_pandas_on_spark()


def pytest_configure(config: pytest.Config) -> None:
    # PySpark 4.3 warns on import that it does not fully support pandas 3;
    # the paths the jobs use (toPandas with Arrow) are exercised by these tests.
    config.addinivalue_line("filterwarnings", "ignore:PySpark does not yet fully support pandas:FutureWarning")
    # pandas 3 deprecation inside PySpark's own toPandas conversion
    config.addinivalue_line("filterwarnings", "ignore:The copy keyword is deprecated")


@pytest.fixture(scope="session")
def spark_session() -> Iterator[SparkSession]:
    configure_environment()
    session = get_session("local[2]", app_name="kproxy-tests", shuffle_partitions=2, driver_memory="1g")
    yield session
    session.stop()
