"""A PySpark data source for Durable Streams, the format ``durable-streams``: batch and
streaming reads, and a sink. Its use, rows, options and guarantees: docs/spark-streaming.md.

Register ``DurableStreamsDataSource`` once per session (``register(spark)``). Its parts:
``spark_options`` (options), ``spark_plan`` (planning), ``spark_partitions`` and
``spark_rows`` (reading), ``spark_reader`` and ``spark_stream_reader`` (``read``,
``readStream``), ``spark_sink`` (``write``, ``writeStream``).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from .spark_options import ReadOptions
from .spark_reader import DurableStreamsReader
from .spark_rows import SCHEMA
from .spark_sink import DurableStreamsStreamWriter, DurableStreamsWriter, WriteOptions
from .spark_stream_reader import DurableStreamsStreamReader

NAME = "durable-streams"


class DurableStreamsDataSource(DataSource):
    """Durable Streams for Spark: ``spark.dataSource.register(DurableStreamsDataSource)``,
    then ``format("durable-streams")``: docs/spark-streaming.md."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return DurableStreamsReader(ReadOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return DurableStreamsStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ValueError("streams are append-only: use mode('append')")
        return DurableStreamsWriter(WriteOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise ValueError("streams are append-only: use outputMode('append')")
        return DurableStreamsStreamWriter(WriteOptions.parse(self.options), schema)


def register(spark: Any) -> None:
    """``spark.dataSource.register(DurableStreamsDataSource)``."""
    spark.dataSource.register(DurableStreamsDataSource)
