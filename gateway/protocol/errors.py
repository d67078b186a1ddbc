"""The one exception the protocol layers raise; the app turns it into a response."""

from __future__ import annotations


class ProtocolError(Exception):
    """A request the protocol answers with an error status and a short body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def bad_request(message: str) -> ProtocolError:
    return ProtocolError(400, message)
