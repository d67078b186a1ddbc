"""``durable-streams backup | restore | verify``: the commands of gateway/backup/."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

from .. import config
from ..backup import bundle, remote
from ..redis_io.preflight import reason
from ..telemetry import logs
from .embedded import redis_url_or_running

_ABOUT = {
    "backup": (
        "take a consistent backup of a running deployment (Redis and the archive's manifest)",
        "Write every stream (each exactly as it was at one moment after the backup began), every "
        "subscription and the deployment's own keys from Redis (every primary of a Cluster) into "
        "DIR (a local directory, or object storage: s3://bucket/prefix, written locally then uploaded, "
        "its seal last), with a sealed manifest: per-stream offsets, producers, links and a digest of "
        "its bytes, and the archive files the streams' segments name (the archive itself is not "
        "copied: keep it, e.g. S3 with versioning). Writes go on meanwhile. docs/operations.md, Backups.",
    ),
    "restore": (
        "restore a backup into an empty Redis (one Redis or a Cluster, whatever the backup's shape)",
        "Check the whole backup (seal, sizes, SHA-256 of every part) and that the target holds "
        "none of our keys, then write it; a restore that fails part way removes what it wrote. "
        "Keys whose expiry passed since the backup are left out.",
    ),
    "verify": (
        "compare a running deployment (or a restore) with a backup's manifest",
        "Print every difference (missing streams, other incarnations, bytes up to the backup's "
        "tail, content type, floor, TTL, closed state, producers, links, archive files); exit 1 "
        "if any. Streams that only grew since the backup are counted, not differences, unless --exact.",
    ),
}


def register(commands: argparse._SubParsersAction[Any]) -> None:
    for name, (short, long) in _ABOUT.items():
        parser = commands.add_parser(
            name, help=short, description=long, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        where = "--to" if name == "backup" else "--from"
        parser.add_argument(
            where, dest="where", required=True, metavar="DIR",
            help="the backup's directory, or its object storage URL (s3://bucket/prefix: needs s3fs)",
        )  # fmt: skip
        if name == "verify":
            parser.add_argument("--exact", action="store_true", help="any change since it is a difference")
        config.add_arguments(parser, config.taken_by(name))
        parser.set_defaults(main=main, command_name=name)


def main(ns: argparse.Namespace) -> int:
    settings = config.from_namespace(ns)
    logs.configure(settings.log_level, settings.log_format)
    try:
        url = redis_url_or_running(settings.redis_url, settings.data_dir)
        with _located(ns.command_name, ns.where) as folder:
            return asyncio.run(_run(ns.command_name, settings, url, folder, getattr(ns, "exact", False)))
    except bundle.BackupError as exc:
        print(f"durable-streams {ns.command_name}: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"durable-streams: {exc}", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _located(command: str, where: str) -> Iterator[Path]:
    """The backup's local directory: ``where`` itself, or a staging copy of object storage."""
    if not remote.is_remote(where):
        yield remote.local_path(where)
    elif command == "backup":
        with remote.upload_when_done(where, _say) as folder:
            yield folder
    else:
        with remote.downloaded(where) as folder:
            yield folder


MIN_TIMEOUT = 120.0  # seconds a backup command waits for one Redis reply, at least


def _say(line: str) -> None:
    print(line, flush=True)


async def _run(command: str, settings: config.Settings, url: str, folder: Path, exact: bool) -> int:
    # Imported here, not with the command line: they import prometheus-client, which must
    # not be imported before `serve --workers` sets PROMETHEUS_MULTIPROC_DIR (main.py).
    from ..archive.files import Archive
    from ..backup.digest import reader
    from ..backup.restore import restore_backup
    from ..backup.take import take_backup
    from ..backup.verify import verify_backup
    from ..redis_io.connections import general
    from ..redis_io.scripts import connect_scripts
    from ..streams.forks import Forks

    # A script that serializes a large stream may take longer than a request's timeout.
    cluster, timeout = settings.redis_cluster, max(settings.redis_timeout, MIN_TIMEOUT)
    redis = general(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
    scripts = connect_scripts(url, cluster=cluster, max_connections=32, timeout=timeout)
    try:
        await _redis(scripts.load())
        archive = Archive(settings.archive_location)
        reads = reader(scripts, archive)
        if command == "restore":
            forks = Forks(scripts, reads, reads.page_bytes)
            await _redis(restore_backup(redis, forks, cluster, folder, _say))
            return 0
        if command == "backup":
            try:
                await _redis(take_backup(scripts, redis, reads, folder, settings.archive_location, _say))
            except BaseException as exc:  # (a refusal before writing is a BackupError)
                staged = folder.parent.name.startswith(remote.STAGING)  # removed with its directory
                sealed = (folder / bundle.SEAL).exists()
                if not isinstance(exc, bundle.BackupError) and not staged and not sealed:
                    print(
                        f"durable-streams backup: {folder} holds an unfinished backup: remove it",
                        file=sys.stderr,
                    )
                raise
            return 0
        return 1 if await _redis(verify_backup(redis, reads, archive, folder, exact, _say)) else 0
    finally:
        await redis.aclose()
        await scripts.aclose()


async def _redis(step: Awaitable[Any]) -> Any:
    """The step's result; a Redis failure as one line (RuntimeError)."""
    try:
        return await step
    except bundle.BackupError:
        raise
    except (OSError, ConnectionError, TimeoutError) as exc:
        raise RuntimeError(f"redis: {reason(exc)}") from None
    except Exception as exc:
        if type(exc).__module__.startswith("redis"):
            raise RuntimeError(f"redis: {reason(exc)}") from None
        raise
