"""``spark.read``: the batch reader."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from .spark_options import ReadOptions, discover
from .spark_partitions import plan_partitions, read_partition
from .spark_plan import joined


class DurableStreamsReader(DataSourceReader):
    """``spark.read``: the streams from ``startingOffsets`` to ``endingOffsets`` (default:
    from their start to their tails when the query is planned)."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        options = self.options
        if options.starting == "latest":
            raise ValueError("startingOffsets=latest reads nothing in a batch query")
        start = options.starting if isinstance(options.starting, dict) else {}
        if isinstance(options.ending, dict):
            end = options.ending
        else:
            client = options.client()
            try:
                # With its incarnation: a stream created again before it is read ends there.
                streams = discover(client, options)
                end = {path: joined(info.tail, info.created) for path, info in streams.items()}
            finally:
                client.close()
        return plan_partitions(start, end, options, streaming=False)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition)
