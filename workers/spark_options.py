"""The Spark data source's read options (``ReadOptions``), the parsing the sink's options
share, and the streams a read's options name (``discover``). The options are described in
docs/spark-streaming.md."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from .spark_plan import split
from .streams_client import Client, StreamInfo, start_position


def _offsets_option(text: str | None, keywords: tuple[str, ...]) -> str | dict[str, str]:
    """``earliest``/``latest`` or a JSON object of path -> offset (``<offset>@<created>``,
    as a query's offsets hold them, too)."""
    value = (text or keywords[0]).strip()
    if value.lower() in keywords:
        return value.lower()
    try:
        doc = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(
            f"expected {' or '.join(keywords)} or a JSON object of path -> offset: {value!r}"
        ) from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise ValueError(f"expected a JSON object of path -> offset (strings): {value!r}")
    for value in doc.values():
        offset, created = split(value)
        start_position(offset)  # -1 or this server's offset, else ValueError
        if created is not None and not created.isdigit():
            raise ValueError(f"expected <offset>@<creation time, ms>: {value!r}")
    return doc


def _paths_option(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        paths = json.loads(text)
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError("paths: a JSON array of strings, or paths separated by commas")
    else:
        paths = [p.strip() for p in text.split(",")]
    return sorted({p.strip("/") for p in paths if p.strip("/")})


def positive_int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    """Option ``name`` as a positive integer, ``default`` when not given."""
    value = options.get(name)
    if value in (None, ""):
        return default
    number = int(str(value))
    if number <= 0:
        raise ValueError(f"{name} must be positive: {value!r}")
    return number


def base_url(options: Mapping[str, str]) -> str:
    """The ``url`` option (Spark's ``load(path)``/``save(path)`` as ``path``): required."""
    url = options.get("url") or options.get("path")
    if not url:
        raise ValueError(
            'the "url" option is required: the streams\' base URL, e.g. http://host:4437/v1/stream'
        )
    return url


@dataclass(frozen=True)
class ReadOptions:
    url: str
    token: str | None = None
    prefix: str = ""
    paths: tuple[str, ...] | None = None  # explicit streams instead of a prefix
    starting: str | dict[str, str] = "earliest"
    ending: str | dict[str, str] = "latest"
    max_bytes_per_trigger: int | None = None
    partition_bytes: int = 8 << 20
    poll_ms: int = 200
    timeout: float = 30.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        url = base_url(options)
        if options.get("prefix") and options.get("paths"):
            raise ValueError('give "prefix" or "paths", not both')
        paths = options.get("paths")
        return cls(
            url=url,
            token=options.get("token") or None,
            prefix=options.get("prefix") or "",
            paths=tuple(_paths_option(paths)) if paths else None,
            starting=_offsets_option(options.get("startingOffsets"), ("earliest", "latest")),
            ending=_offsets_option(options.get("endingOffsets"), ("latest",)),
            max_bytes_per_trigger=positive_int(options, "maxBytesPerTrigger", None),
            partition_bytes=positive_int(options, "partitionBytes", 8 << 20) or 8 << 20,
            poll_ms=int(options.get("minPollIntervalMs") or 200),
            timeout=float(options.get("timeout") or 30),
        )

    def client(self) -> Client:
        return Client(self.url, self.token, self.timeout)


def discover(client: Client, options: ReadOptions) -> dict[str, StreamInfo]:
    """The streams a query reads, by path: the named ones that exist, or the listing."""
    if options.paths is not None:
        found = {path: client.info(path) for path in options.paths}
        return {path: info for path, info in found.items() if info is not None}
    return {info.path: info for info in client.list_streams(options.prefix)}
