"""The Parquet archive that holds streams' older data.

``segments.py``: a segment (one file's range) as a plain value, its file name
and the read rule (no I/O); ``schema.py``: the Parquet schema and how log
entries become a table; ``files.py``: the files themselves, on a local
directory or any fsspec URL; ``cold.py``: the gateway's reader of them.
The archive worker (``workers/archiver.py``) writes with ``schema`` and
``files``; the gateway reads with ``cold``. Nothing here talks to Redis.
"""
