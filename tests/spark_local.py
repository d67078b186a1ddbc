"""A local Spark session with the ``durable-streams`` data source, and the small steps the
data source's tests share (tests/test_spark_source.py, tests/test_spark_sink.py).

Spark's Python workers must import this project: PYSPARK_PYTHON is this interpreter.
Spark calls block, and the gateway runs on the test's event loop: they run in threads.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

JAVA = shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))
JSON, BYTES = "application/json", "application/octet-stream"


@contextlib.contextmanager
def local_spark(master: str) -> Iterator[Any]:
    """A session on ``master`` with the data source registered (skipped without Java)."""
    if not JAVA:
        pytest.skip("Spark needs Java (17+)")
    from pyspark.sql import SparkSession

    from workers.spark_source import DurableStreamsDataSource

    # The Python workers that run the source must import workers.spark_source: this venv.
    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master(master)
        .appName("durable-streams-source-test")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(DurableStreamsDataSource)
    try:
        yield session
    finally:
        session.stop()
        if before is None:
            os.environ.pop("PYSPARK_PYTHON", None)
        else:
            os.environ["PYSPARK_PYTHON"] = before


def activate(spark: Any) -> None:
    """A Python data source sink is looked up through the JVM thread's active session,
    which a thread of asyncio.to_thread has none of yet."""
    spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)


def load(spark: Any, base: str, token: str | None, stream: bool = False, **options: Any) -> Any:
    reader = (spark.readStream if stream else spark.read).format("durable-streams").option("url", base)
    if token:
        reader = reader.option("token", token)
    for key, option in options.items():
        reader = reader.option(key, option)
    return reader.load()


async def create(http: aiohttp.ClientSession, url: str, content_type: str) -> None:
    async with http.put(url, headers={"Content-Type": content_type}) as r:
        assert r.status in (200, 201), await r.text()


async def append(http: aiohttp.ClientSession, url: str, content_type: str, body: bytes) -> None:
    async with http.post(url, data=body, headers={"Content-Type": content_type}) as r:
        assert r.status in (200, 204), (r.status, await r.text())
