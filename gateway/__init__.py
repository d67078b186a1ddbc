"""A Redis-backed, horizontally scaled Durable Streams server."""

__version__ = "0.1.0"
