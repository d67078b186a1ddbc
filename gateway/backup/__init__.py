"""Backups of a deployment: taken live (take.py), restored into any shape (restore.py),
compared with a running deployment (verify.py); the key plan (plan.py), the files on disk
(bundle.py), object storage (remote.py) and the per-stream summary and digest (digest.py).
docs/operations.md, Backups."""

from collections.abc import Callable

Say = Callable[[str], None]  # where a command's lines go (print, a log)
