"""The smallest SSE client the benchmarks and tests need: (event, data) per data line.

Multi-line data events come as one pair per line (the records sent here have
no newlines). The optional space after ``data:`` is dropped, as the SSE spec says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp


async def sse_lines(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    event = ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, line[5:].removeprefix(" ")
