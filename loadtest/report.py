"""A benchmark's figures: printed, and kept as ``<out>.json`` (the numbers) and ``<out>.md``
(the table the docs quote) under loadtest/results/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def publish(out: str, result: dict[str, Any], lines: list[str]) -> None:
    text = "\n".join(lines)
    print(text)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(text + "\n")
