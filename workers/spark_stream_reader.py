"""``spark.readStream``: the streaming reader (its offsets and exactly-once: docs/spark-streaming.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    SupportsTriggerAvailableNow,
)

from .spark_options import ReadOptions, discover
from .spark_partitions import plan_partitions, read_partition
from .spark_plan import joined, plan_ends
from .streams_client import Client, StreamInfo, StreamsError, position

log = logging.getLogger("durable_streams.spark")  # one logger for the whole data source


class DurableStreamsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream``: offsets and exactly-once are in docs/spark-streaming.md."""

    def __init__(self, options: ReadOptions) -> None:
        if options.ending != "latest":
            raise ValueError("endingOffsets is for batch queries")
        self.options = options
        self._client: Client | None = None
        self._target: dict[str, StreamInfo] | None = None  # Trigger.AvailableNow: tails at its start
        self._favored: set[str] = set()
        self._listed: tuple[float, dict[str, StreamInfo]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # what executors get: no connection, no caches
        return {"options": self.options, "_client": None, "_target": None, "_favored": set(), "_listed": None}

    def _connection(self) -> Client:
        if self._client is None:
            self._client = self.options.client()
        return self._client

    def _streams(self, start: Mapping[str, str]) -> dict[str, StreamInfo]:
        now = time.monotonic()
        if self._listed is not None and now - self._listed[0] < self.options.poll_ms / 1000:
            streams = self._listed[1]
        else:
            client = self._connection()
            streams = discover(client, self.options)
            if self.options.paths is None:
                # Not listed: gone, or not visible for a moment? HEAD says (once: a gone
                # stream leaves the offsets).
                for path in sorted(set(start) - set(streams)):
                    info = client.info(path)
                    if info is None:
                        log.warning("%s: deleted or expired (404/410): no longer read", path)
                    else:
                        streams[path] = info
            else:
                for path in sorted(set(start) - set(streams)):
                    log.warning("%s: deleted or expired (404/410): no longer read", path)
            self._listed = (now, streams)
        if self._target is not None:  # AvailableNow: nothing past the tails it started with
            capped = {}
            for path, target in list(self._target.items()):
                info = streams.get(path)
                if info is None:
                    continue
                if target.created and info.created and target.created != info.created:
                    target = self._target[path] = info  # created again since: its tail now is the target
                capped[path] = target if position(target.tail) <= position(info.tail) else info
            streams = capped
        return streams

    def initialOffset(self) -> dict[str, str]:
        starting = self.options.starting
        if isinstance(starting, dict):
            return dict(sorted(starting.items()))
        if starting == "latest":
            streams = discover(self._connection(), self.options)
            return {
                path: joined(info.tail, info.created)
                for path, info in sorted(streams.items())
                if position(info.tail) > 0
            }
        return {}

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_bytes_per_trigger
        return ReadMaxBytes(limit) if limit else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._listed = None
        self._target = dict(self._streams({}))

    def latestOffset(self, start: dict[str, str], limit: ReadLimit) -> dict[str, str]:
        try:
            streams = self._streams(start)
        except StreamsError as exc:
            if exc.status not in (0, 429) and exc.status < 500:
                raise  # refused (401, 403, 404 for the listing...): the query stops, saying why
            log.warning("could not list the streams (%s): no new data this time", exc)
            return start
        budget = limit.max_bytes if isinstance(limit, ReadMaxBytes) else None
        end, self._favored = plan_ends(start, streams, budget, self._favored)
        # Spark compares offsets as JSON text: keys in one order (sorted), and the start
        # itself when nothing moved (no batch then).
        return start if end == start else end

    def reportLatestOffset(self) -> dict[str, str] | None:
        if self._listed is None:
            return None
        return {path: joined(info.tail, info.created) for path, info in self._listed[1].items()}

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        return plan_partitions(start, end, self.options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition)

    def commit(self, end: dict[str, str]) -> None:
        pass  # nothing to release: the server keeps every offset readable

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
