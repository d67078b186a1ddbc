"""A backup on disk: a directory of parts and a sealed manifest. Files only, no Redis.

Layout (``FORMAT``)::

    keys-00000.bin ...   records: key, absolute expiry (ms, -1 none), DUMP payload
    listed.json          members and scores of the shape-dependent sorted sets (plan.py)
    manifest.json        what was taken, when, from what; every part's size and SHA-256;
                         a summary of every stream (offsets, bytes, producers, ...)
    manifest.sha256      the manifest's SHA-256: written last, so a backup without it is
                         incomplete (a backup that was cut short), and a changed manifest shows

A record is ``>I`` key length, the key, ``>q`` expiry, ``>Q`` payload length, the payload.
The checksums find truncation, corruption and edits; they are not a signature (whoever can
write the backup can write new checksums): keep backups where only operators can write.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

FORMAT = "durable-streams-backup/1"
MANIFEST, SEAL, LISTED = "manifest.json", "manifest.sha256", "listed.json"
PART_BYTES = 256 << 20  # a part is closed past this (so no single file is huge)
_KEY, _EXPIRY, _PAYLOAD = struct.Struct(">I"), struct.Struct(">q"), struct.Struct(">Q")
_READ = 1 << 20


class BackupError(Exception):
    """A backup that cannot be used as it is: said in one line."""


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ):
            digest.update(block)
    return digest.hexdigest()


class Writer:
    """Writes records into parts in ``folder`` (new, or empty), then the manifest."""

    def __init__(self, folder: Path) -> None:
        if folder.exists() and any(folder.iterdir()):
            raise BackupError(f"{folder} is not empty: a backup goes to a new or empty directory")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.parts: dict[str, dict[str, Any]] = {}
        self.records = 0
        self.largest: tuple[bytes, int] = (b"", 0)  # the largest value: a target must accept its size
        self._file: BinaryIO | None = None
        self._name = ""
        self._digest = hashlib.sha256()
        self._size = 0

    def add(self, key: bytes, expiry: int, payload: bytes) -> None:
        if self._file is None or self._size >= PART_BYTES:
            self._close_part()
            self._name = f"keys-{len(self.parts):05d}.bin"
            self._file = (self.folder / self._name).open("wb")
        frame = b"".join(
            (_KEY.pack(len(key)), key, _EXPIRY.pack(expiry), _PAYLOAD.pack(len(payload)), payload)
        )
        self._file.write(frame)
        self._digest.update(frame)
        self._size += len(frame)
        self.records += 1
        if len(payload) > self.largest[1]:
            self.largest = (key, len(payload))

    def _close_part(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.parts[self._name] = {"bytes": self._size, "sha256": self._digest.hexdigest()}
        self._file, self._digest, self._size = None, hashlib.sha256(), 0

    def finish(self, manifest: dict[str, Any], listed: dict[str, list[list[Any]]]) -> dict[str, Any]:
        """Close the parts, write ``listed.json`` and the manifest, then its seal."""
        self._close_part()
        data = orjson.dumps(listed)
        (self.folder / LISTED).write_bytes(data)
        self.parts[LISTED] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        largest = {"key": self.largest[0].decode("utf-8", "replace"), "bytes": self.largest[1]}
        manifest = {"format": FORMAT, **manifest, "records": self.records, "largest": largest}
        manifest["files"] = self.parts
        body = orjson.dumps(manifest, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        (self.folder / MANIFEST).write_bytes(body)
        _fsync_all(self.folder)
        (self.folder / SEAL).write_text(hashlib.sha256(body).hexdigest() + "\n")
        _fsync_all(self.folder)
        return manifest


def _fsync_all(folder: Path) -> None:
    """Every file in ``folder`` on disk, and the directory's entries for them."""
    for name in os.listdir(folder):
        with (folder / name).open("rb") as f:
            os.fsync(f.fileno())
    entries = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(entries)
    finally:
        os.close(entries)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, once its seal matches; BackupError otherwise."""
    if not (folder / MANIFEST).is_file():
        raise BackupError(f"{folder}: no {MANIFEST}: not a backup, or one that did not finish")
    body = (folder / MANIFEST).read_bytes()
    try:
        seal = (folder / SEAL).read_text().strip()
    except OSError:
        raise BackupError(f"{folder}: no {SEAL}: the backup did not finish") from None
    if hashlib.sha256(body).hexdigest() != seal:
        raise BackupError(f"{folder}/{MANIFEST} does not match {SEAL}: changed or damaged")
    manifest = orjson.loads(body)
    if manifest.get("format") != FORMAT:
        raise BackupError(f"{folder}: format {manifest.get('format')!r}, this build reads {FORMAT}")
    return manifest


def check_files(folder: Path, manifest: dict[str, Any]) -> None:
    """Every part there, whole and unchanged (sizes, then SHA-256); BackupError otherwise."""
    for name, expected in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            raise BackupError(f"{folder}: {name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            said = expected["bytes"]
            raise BackupError(f"{folder}/{name}: {size} bytes, the manifest says {said} (truncated?)")
        if _sha256_of(path) != expected["sha256"]:
            raise BackupError(f"{folder}/{name}: its SHA-256 is not the manifest's: changed or damaged")


def records(folder: Path, manifest: dict[str, Any]) -> Iterator[tuple[bytes, int, bytes]]:
    """Every record: (key, expiry, payload), part after part."""
    for name in sorted(n for n in manifest["files"] if n.startswith("keys-")):
        with (folder / name).open("rb") as f:
            while head := f.read(_KEY.size):
                key = _exactly(f, _KEY.unpack(head)[0], name)
                (expiry,) = _EXPIRY.unpack(_exactly(f, _EXPIRY.size, name))
                (length,) = _PAYLOAD.unpack(_exactly(f, _PAYLOAD.size, name))
                yield key, expiry, _exactly(f, length, name)


def _exactly(f: BinaryIO, size: int, name: str) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise BackupError(f"{name}: a record cut short")
    return data


def listed(folder: Path) -> dict[str, list[list[Any]]]:
    return orjson.loads((folder / LISTED).read_bytes())
