"""What the command-line client prints: bytes and JSON on stdout, a progress bar on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

JSON_TYPE = "application/json"


def emit(data: bytes) -> None:
    """Bytes to stdout as they are, after any text printed before them."""
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def print_json(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def json_lines(body: bytes) -> bytes:
    """A JSON stream's chunk (an array of messages) as one compact message per line."""
    messages = json.loads(body) if body.strip() else []
    return b"".join(
        json.dumps(m, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for m in messages
    )


def is_json_type(content_type: str | None) -> bool:
    """Whether a Content-Type is a JSON stream's (parameters and case aside)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON_TYPE


def offset_position(offset: str | None) -> int | None:
    """The byte position in an offset of this server's form (``<generation>_<position>``), for
    the progress bar only: offsets are opaque, another server's give no bar."""
    if not offset:
        return None
    tail = offset.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


class Progress:
    """A byte-count bar on stderr, only when stderr is a terminal (never in a pipe or a log)."""

    def __init__(self, start: int | None, total: int | None) -> None:
        self.on = sys.stderr.isatty() and start is not None and total is not None and total > (start or 0)
        self.start, self.total = max(start or 0, 0), total or 0

    def show(self, position: int | None) -> None:
        if not self.on or position is None:
            return
        done = min(max(position - self.start, 0), self.total - self.start)
        share = done / (self.total - self.start)
        bar = "#" * int(share * 30)
        sys.stderr.write(f"\r[{bar:<30}] {share:4.0%} {done}/{self.total - self.start} bytes")
        sys.stderr.flush()

    def end(self) -> None:
        if self.on:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
