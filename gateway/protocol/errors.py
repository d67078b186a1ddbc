"""The one exception the protocol layers raise; the app turns it into a response."""

from __future__ import annotations


class ProtocolError(Exception):
    """A request the protocol answers with an error status and a short body."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        body: dict[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.body = body  # a JSON error body (the subscription APIs'), sent instead of the message


def coded(status: int, code: str, message: str, **extra: object) -> ProtocolError:
    """An error with the JSON body the subscription APIs answer: ``{"error": {"code", "message", ...}}``."""
    return ProtocolError(status, message, body={"error": {"code": code, "message": message, **extra}})


def bad_request(message: str) -> ProtocolError:
    return ProtocolError(400, message)
