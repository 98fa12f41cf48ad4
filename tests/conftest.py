"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import hypothesis
import pytest

# Imported before any test runs: an in-process node calls `gc.freeze()`, and a Hypothesis
# imported after that (by its pytest plugin, at the end of a run of one module that does
# not import it) warns that trio's registered random has no referrers, as the frozen
# module holding it is out of `gc.get_referrers`' sight: with warnings as errors, the
# run fails after every test passed.

hypothesis.settings.register_profile("derandomized", derandomize=True, database=None)
"""`./run test` runs the property tests a second time under it (see `run`)."""


@pytest.fixture(scope="session", autouse=True)
def own_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """`quorumq simulate run` records each run under $XDG_CACHE_HOME for `replay`: the
    tests' runs go to a directory of their own, not the user's ~/.cache."""
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache-home"))
    yield
    if before is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for every Spark test (start-up takes 12-20 s here), with
    the `quorumq` format registered. Its Python workers run this interpreter."""
    from pyspark.sql import SparkSession

    import spark_source

    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("quorumq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stopTimeout", "10s")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    spark_source.register(session)
    try:
        yield session
    finally:
        session.stop()
