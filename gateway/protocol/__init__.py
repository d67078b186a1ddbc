"""The Durable Streams protocol's rules and the values they work on, without I/O.

Offsets, headers, cursors, JSON mode, SSE framing, caching, the pub/sub notice
format, the stream models (``models.py``) and which headers each response
carries. Nothing here imports aiohttp, redis or asyncio, or touches a socket
or a file (a contract in pyproject.toml checks it): every rule can be tested
as a plain function, and every layer above may use it.
"""
