"""A backup kept in object storage (any fsspec URL: ``s3://bucket/prefix``, ``gs://…``), as the
archive is (gateway/archive/files.py).

A backup is written in a local staging directory and uploaded when it is whole, the seal
(``manifest.sha256``) last: a backup whose upload stopped part way has no seal and is refused
as unfinished. Restore and verify download one into a staging directory first and check it
there exactly as a local backup (seal, sizes, SHA-256 of every part), so what a store changed
or lost is caught before anything is written. Staging needs free local space the size of the
backup, in the system's temporary directory (``TMPDIR``).

fsspec's ``put``/``get`` do the transfers (multipart uploads, retries): nothing hand-written
here but the order.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fsspec

from . import Say
from .bundle import SEAL, BackupError

STAGING = "ds-backup-"  # the staging directories' name prefix


def is_remote(where: str) -> bool:
    """Whether ``where`` names object storage, not a local directory."""
    return "://" in where and not where.startswith("file://")


def local_path(where: str) -> Path:
    return Path(where.removeprefix("file://"))


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # e.g. s3:// without s3fs installed
        raise BackupError(f"{url}: {exc}") from None


@contextlib.contextmanager
def upload_when_done(url: str, say: Say) -> Iterator[Path]:
    """A staging directory to write the backup in; uploaded to ``url`` (which must hold
    nothing yet) once the block ends without error, the seal last."""
    fs, root = _fs(url)
    if fs.exists(root) and fs.ls(root, detail=False):
        raise BackupError(f"{url} is not empty: a backup goes to a new or empty location")
    staging = Path(tempfile.mkdtemp(prefix=STAGING))
    try:
        yield staging / "backup"
        names = sorted(p.name for p in (staging / "backup").iterdir())
        for name in [n for n in names if n != SEAL] + [SEAL]:
            fs.put_file(str(staging / "backup" / name), f"{root}/{name}")
        say(f"backup: uploaded to {url} ({len(names)} files, the seal last)")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def downloaded(url: str) -> Iterator[Path]:
    """The backup at ``url``, in a staging directory for the block."""
    fs, root = _fs(url)
    try:
        names = sorted(name.rsplit("/", 1)[-1] for name in fs.ls(root, detail=False))
    except FileNotFoundError:
        raise BackupError(f"{url}: nothing there") from None
    if SEAL not in names:
        raise BackupError(f"{url}: no {SEAL}: not a backup, or one whose upload did not finish")
    staging = Path(tempfile.mkdtemp(prefix=STAGING))
    try:
        for name in names:
            fs.get_file(f"{root}/{name}", str(staging / name))
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
