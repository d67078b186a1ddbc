"""The tenants' usage files in the archive (docs/tenants.md, "Usage metering"): where they
are and the rules a bill counts them by, shared by the meter that writes them
(workers/meter.py), the bill (workers/usage_bill.py) and the tenants API's history
(http/tenants.py).

Files: ``<archive>/_usage/hour=<YYYY-MM-DDTHH>/<part>.parquet``, rows ``hour`` (timestamp
of the hour's start, UTC), ``tenant``, ``counter``, ``value`` (int64). A row counts on the
UTC day its hour starts in.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta

from .files import Archive

USAGE_DIR = "_usage"  # under the archive root; '_': Spark's listing of the root skips it
DAY_MS = 86_400_000
EPOCH = date(1970, 1, 1)
_HOUR_DIR = re.compile(r"hour=(\d{4}-\d{2}-\d{2})T\d{2}")

Sum = tuple[str, date, str, int]  # (tenant, day, counter, sum of value)


def hour_dir(hour: int) -> str:
    """The directory of an hour's files: ``hour=2026-01-31T13`` (no ':' in object names)."""
    return f"hour={datetime.fromtimestamp(hour, UTC):%Y-%m-%dT%H}"


def usage_file(hour: int, part: str) -> str:
    """A part's file, relative to the archive root: the same part, the same name."""
    return f"{USAGE_DIR}/{hour_dir(hour)}/{part}.parquet"


def hour_window(first: date | None, last: date | None) -> tuple[int | None, int | None]:
    """The hours (``hour`` in Unix ms) the days [first, last] count: [start, end)."""
    start = (first - EPOCH).days * DAY_MS if first else None
    end = ((last - EPOCH).days + 1) * DAY_MS if last else None
    return start, end


def day_of(hour_ms: int) -> date:
    """The UTC day a usage row counts on: the one its hour starts in."""
    return EPOCH + timedelta(days=hour_ms // DAY_MS)


def hour_dirs(names: Iterable[str], first: date | None, last: date | None) -> list[str]:
    """The ``hour=`` directory names whose day is in [first, last] (a listing's pruning:
    the rows are still filtered by their ``hour``)."""
    chosen = []
    for name in names:
        match = _HOUR_DIR.fullmatch(name)
        if match:
            day = date.fromisoformat(match.group(1))
            if (first is None or first <= day) and (last is None or day <= last):
                chosen.append(name)
    return sorted(chosen)


def sums(
    archive: str, first: date | None = None, last: date | None = None, tenant: str | None = None
) -> list[Sum]:
    """The usage files under ``archive`` (an fsspec URL) in [first, last], summed per
    (tenant, day, counter); only ``tenant``'s when given. Reads with pyarrow (blocking:
    a gateway calls it in a thread)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    usage = Archive(f"{archive.rstrip('/')}/{USAGE_DIR}")
    start, end = hour_window(first, last)
    every = usage.files()  # (none when there is no _usage/ yet)
    chosen = set(hour_dirs({f.split("/", 1)[0] for f in every}, first, last))
    found: dict[tuple[str, date, str], int] = defaultdict(int)
    for file in (f for f in every if f.split("/", 1)[0] in chosen):
        table = usage.read(file, ["hour", "tenant", "counter", "value"])
        if tenant is not None:
            table = table.filter(pc.equal(table.column("tenant"), tenant))
        table = table.set_column(0, "hour", table.column("hour").cast(pa.int64()))  # Unix ms
        for row in table.to_pylist():
            hour = row["hour"]
            if (start is None or hour >= start) and (end is None or hour < end):
                found[(row["tenant"], day_of(hour), row["counter"])] += row["value"]
    return [(t, d, c, v) for (t, d, c), v in found.items()]
