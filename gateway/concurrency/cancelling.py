"""A cancellation that a library swallowed, taken back.

A task cancelled while a library awaits for it should end with ``CancelledError``. Not
always: redis-py 8.1, cancelled while it refreshes a cluster's slot map, can answer as if
nothing happened (traced: ``ClusterNode.execute_command`` returns normally with the cancel
pending), or raise an error of its own in its clean-up instead. A loop that goes on after
an answer, or retries on ``Exception``, then goes round for ever: the task's cancel request
stays counted (``Task.cancelling()``), and on Python 3.11 every ``asyncio.timeout`` entered
afterwards takes its next expiry for that request's and turns it into ``TimeoutError``, so
the task cannot be stopped any more (a fan-out that never closed hung the test run). Such
loops ask ``raise_if_cancelled`` (or ``cancel_requested``) after a library call.
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
