"""A cancellation that a library swallowed, taken back.

A task cancelled while a library awaits for it should end with ``CancelledError``. Not
always: redis-py's clean-up in ``finally`` blocks (it disconnects the connection a cancelled
command was using) can raise an error of its own, which replaces the ``CancelledError``;
a loop that retries on ``Exception`` then takes the cancellation for a failure and goes
round again, for ever. The task's cancel request stays counted (``Task.cancelling()``), and
on Python 3.11 every ``asyncio.timeout`` entered afterwards takes its next expiry for that
request's and turns it into ``TimeoutError``: the task cannot be stopped any more (a
fan-out that never closed hung the test run). Loops that catch ``Exception`` ask
``raise_if_cancelled`` first.
"""

from __future__ import annotations

import asyncio


def cancel_requested() -> bool:
    """Whether the current task was asked to stop (``Task.cancel``) and has not taken the
    request back (as ``asyncio.timeout`` does with its own), whatever became of the
    ``CancelledError`` the request threw."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelled() -> None:
    """``CancelledError``, if ``cancel_requested()``."""
    if cancel_requested():
        raise asyncio.CancelledError
