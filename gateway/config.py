"""Settings: one definition per setting, read from flags or environment.

Each field of ``Settings`` is declared once, with ``setting``: its type and default,
its help, its parser, and the commands that take it. Every flag ``--some-name`` is
also ``DURABLE_STREAMS_SOME_NAME`` in the environment (flags win), so the same
settings serve a laptop and a container; the configuration reference
(docs/hooks/reference.py) is generated from the same declarations.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import NoReturn, TypeVar
from urllib.parse import urlsplit

ENV_PREFIX = "DURABLE_STREAMS_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


# -- values ------------------------------------------------------------------------
#
# Every value, from a flag or the environment, goes through its parser below: a bad
# one is one line naming the flag, the variable and the value (exit code 2), never a
# traceback from deep inside the start. argparse applies a parser to a flag's value,
# and to a default that is a string, i.e. a value taken from the environment, so an
# environment variable that a flag overrides is not looked at.

Parse = Callable[[str], object]
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
CONSOLE_MODES = ("auto", "on", "off")
REDIS_SCHEMES = ("redis", "rediss", "unix")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip().replace("_", ""))
        except ValueError:
            raise ValueError("is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise ValueError(f"is out of range ({low} to {high})" if high is not None else f"is below {low}")
        return value

    return parse


def _number(*, positive: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError("is not a number") from None
        if not math.isfinite(value):
            raise ValueError("is not a finite number")
        if value < 0 or (positive and value == 0):
            raise ValueError("must be above 0" if positive else "must not be negative")
        return value

    return parse


# Content codings the gateway can produce (http/compression.py), for --compression.
CODINGS = ("zstd", "br", "gzip")


def _codings(raw: str) -> str:
    """Codings in order of preference, comma-separated ('' for none)."""
    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in CODINGS]
    if unknown:
        raise ValueError(f"names unknown codings {', '.join(unknown)} (known: {', '.join(CODINGS)})")
    if len(set(names)) != len(names):
        raise ValueError("names a coding twice")
    return ",".join(names)


def _boolean(raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("is not a boolean (true/false, yes/no, on/off, 1/0)")


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        word = raw.strip().lower()
        if word not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return word

    return parse


def _log_level(raw: str) -> str:
    """One of LOG_LEVELS; logging's other spellings (warn, critical) are taken too."""
    word = raw.strip().lower()
    return _one_of(*LOG_LEVELS)({"warn": "warning", "critical": "error", "fatal": "error"}.get(word, word))


def _redis_url(raw: str) -> str:
    scheme = urlsplit(raw.strip()).scheme
    if scheme not in REDIS_SCHEMES:
        raise ValueError("is not a Redis URL (redis://host:port/db, rediss://... or unix:///path)")
    return raw.strip()


def _url_prefix(raw: str) -> str:
    if not raw.startswith("/"):
        raise ValueError("must start with '/'")
    return raw


# redis.conf's units (k = 1000, kb = 1024, ...) and the binary ones spelt out.
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 2**10, "kib": 2**10, "m": 10**6, "mb": 2**20, "mib": 2**20}
_SIZE_UNITS |= {"g": 10**9, "gb": 2**30, "gib": 2**30}
_SIZE = re.compile(r"([0-9]+) *([a-z]*)")


@dataclass(frozen=True)
class MemoryMark:
    """--write-pause-memory: ``bytes`` of used_memory, or a ``share`` of maxmemory; neither: off."""

    bytes: int = 0
    share: float = 0.0


def memory_mark(raw: str) -> MemoryMark:
    """``512mb``, ``2gb``, ``1073741824`` (bytes), ``85%`` (of maxmemory), or ``0``/``off``."""
    text = raw.strip().lower().replace("_", "")
    if text in ("0", "off"):
        return MemoryMark()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise ValueError("is not a percentage (e.g. 90%)") from None
        if not 0 < percent <= 100:  # NaN fails this too
            raise ValueError("must be a percentage above 0 and at most 100")
        return MemoryMark(share=percent / 100)
    match = _SIZE.fullmatch(text)
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise ValueError("is not a size (e.g. 512mb, 2gb), a share of maxmemory (e.g. 90%) or off")
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size < _SIZE_UNITS["mb"]:  # e.g. "90" meant as 90%: every write would pause
        raise ValueError("is below 1mb, which would pause every write (a share of maxmemory ends in %)")
    return MemoryMark(bytes=size)


def _memory_mark_text(raw: str) -> str:
    memory_mark(raw)  # checked here; features/backpressure.py reads it
    return raw.strip().lower()


_POSITIVE = _number(positive=True)
_BY_TYPE: dict[str, Parse] = {"int": _whole(0), "float": _number(), "bool": _boolean}  # "str": any text


# -- declaring a setting -----------------------------------------------------------

# The commands that take settings (gateway/cli/: serve, migrate, fleet, doctor; workers/commands.py:
# archive, deliver, webhook-keys), and those that take the settings every process shares.
BACKUP = ("backup", "restore", "verify")  # gateway/cli/backup.py
UPGRADE = ("migrate", "fleet")  # gateway/cli/migrate.py
COMMANDS = ("serve", "archive", "deliver", "webhook-keys", *UPGRADE, "doctor", *BACKUP)
SHARED = ("serve", "archive", "deliver", "webhook-keys")
SERVE, ARCHIVE, DELIVER = ("serve",), ("archive",), ("deliver",)
_SPEC = "durable_streams"  # the key of a field's Spec in its metadata
_T = TypeVar("_T")


@dataclass(frozen=True)
class Spec:
    """What a setting is besides its type and default: ``help`` (argparse's: ``%%`` for a
    ``%``), ``parse`` (None: any value of the field's type, numbers not negative), the
    ``commands`` that take it, and environment variables read after its own (``also_env``)."""

    help: str
    parse: Parse | None = None
    commands: tuple[str, ...] = SERVE
    also_env: tuple[str, ...] = ()


def setting(
    default: _T,
    help: str,
    *,
    parse: Parse | None = None,
    commands: Iterable[str] = SERVE,
    also_env: tuple[str, ...] = (),
) -> _T:
    """A ``Settings`` field: its default, and its Spec in the field's metadata."""
    spec = Spec(help, parse, tuple(commands), also_env)
    unknown = set(spec.commands) - set(COMMANDS)
    if not spec.help or unknown:  # a mistake in this module: fail at import, not in a command
        raise ValueError(f"a setting needs help and known commands (unknown: {sorted(unknown)})")
    return field(default=default, metadata={_SPEC: spec})


@dataclass(frozen=True)
class Settings:
    host: str = setting("127.0.0.1", "address to listen on", commands=SHARED)
    port: int = setting(4437, "port to listen on (4437 is the protocol's)", parse=_whole(1, 65535))
    redis_url: str | None = setting(
        None,
        "Redis to use, e.g. redis://host:6379/0; unset: start an embedded "
        "redis-server in --data-dir (AOF, fsync on every write)",
        parse=_redis_url,
        also_env=("REDIS_URL",),
        commands=(*SHARED, *UPGRADE, "doctor", *BACKUP),
    )
    redis_cluster: bool = setting(
        False,
        "--redis-url is a node of a Redis Cluster (redis-py's RedisCluster.from_url: the "
        "other nodes are found from it); streams are spread over its shards by hash slot",
        commands=(*SHARED, *UPGRADE, "doctor", *BACKUP),
    )
    min_replicas_ack: int = setting(
        0,
        "acknowledge a write only once this many replicas have it (WAIT; WAITAOF, "
        "their disks, on a Redis 7.2+ cluster whose nodes all keep an AOF); 0: once the primary has it "
        "(docs/scaling.md, Replica durability)",
        commands=SHARED,
    )
    min_replicas_ack_timeout: float = setting(
        1.0,
        "seconds a write waits for --min-replicas-ack replicas; then the "
        "client gets 504 (append) or 503: stored on the primary, not confirmed by enough replicas",
        parse=_POSITIVE,
        commands=SHARED,
    )
    data_dir: str = setting(
        "./data", "where the embedded Redis keeps its data", commands=(*SHARED, *UPGRADE, "doctor", *BACKUP)
    )
    prefix: str = setting("/v1/stream", "URL prefix streams live under", parse=_url_prefix)
    max_body_bytes: int = setting(
        64 * 1024 * 1024,
        "largest request body accepted; larger ones get 413 (the official clients batch "
        "concurrent appends into one request: keep it at tens of MiB)",
        parse=_whole(1),
    )
    # Ursula's snapshot blobs (http/snapshots.py)
    max_snapshot_bytes: int = setting(
        128 * 1024 * 1024,
        "largest snapshot blob accepted (PUT /{bucket}/{stream}/snapshot/{offset}); larger "
        "ones get 413. Held in memory while it is stored: counted in --max-inflight-body-bytes",
        parse=_whole(1),
    )
    max_chunk_bytes: int = setting(
        256 * 1024 * 1024,
        "most bytes one catch-up read answers (a JSON answer ends at the first message starting "
        "past it); the rest follows from its Stream-Next-Offset. Streamed page by page, never "
        "held whole: the official clients' catch-up-only reads (live: false) take one answer "
        "as the whole stream, so keep it above your streams' sizes",
        parse=_whole(1),
    )
    read_page_bytes: int = setting(
        1024 * 1024,
        "bytes a read takes from Redis or the archive at a time: a streamed catch-up answer "
        "holds about two pages, and a live answer (long-poll, an SSE data event) carries at most one",
        parse=_whole(1024),
    )
    max_inflight_read_bytes: int = setting(
        256 * 1024 * 1024,
        "read pages one process holds at once across streamed catch-up answers; past it a "
        "read waits for a page to be sent (backpressure, not a refusal)",
        parse=_whole(1024),
    )
    compression: str = setting(
        "zstd,br,gzip",
        "content codings offered to catch-up reads of JSON and text streams, in the server's "
        "order of preference (the client's Accept-Encoding q-values first); '' turns compression off",
        parse=_codings,
    )
    compression_min_bytes: int = setting(
        1024,
        "catch-up answers shorter than this are sent uncompressed",
        parse=_whole(0),
    )
    read_inline_bytes: int = setting(
        64 * 1024,
        "reads longer than this fetch their data with a plain XRANGE after the script "
        "instead of through Lua (one more round trip; a quarter of Redis' work, and JSON "
        "messages split by the gateway rather than by Lua)",
    )
    max_path_bytes: int = setting(1024, "longest stream path accepted", parse=_whole(1))
    max_json_messages: int = setting(
        0,
        "most JSON messages one request may append (a larger array gets 413); 0: no "
        "cap beyond --max-body-bytes (messages are stored in bounded groups: no script runs long for them)",
        parse=_whole(0),
    )
    max_inflight_body_bytes: int = setting(
        256 * 1024 * 1024,
        "request body bytes one process holds at once, across requests; "
        "beyond it new bodies get 503 with Retry-After",
        parse=_whole(1),
    )
    body_timeout: float = setting(
        60.0, "seconds a client may take to send a whole request body (then 408)", parse=_POSITIVE
    )
    write_timeout: float = setting(
        30.0,
        "seconds a live response (SSE) may wait for a client to take its data "
        "before the connection is dropped",
        parse=_POSITIVE,
    )
    redis_timeout: float = setting(
        5.0,
        "seconds to wait for a Redis reply; an append unanswered by then gets 504 "
        "(outcome unknown: retry it only as an idempotent producer)",
        parse=_POSITIVE,
        commands=("serve", "deliver", *UPGRADE, "doctor", *BACKUP),
    )
    shutdown_seconds: float = setting(
        30.0,
        "on SIGTERM, after --shutdown-delay-seconds, seconds in-flight requests get to "
        "finish before the process exits",
    )
    # Kept serving after SIGTERM, not ready, until load balancers stop sending here: the chart's
    # readiness probe (every 2 s, 2 failures) takes up to 4 s to notice, plus 1 s for the change
    # to reach the proxies; and 5 s + a short drain fits `docker stop`'s 10 s.
    shutdown_delay_seconds: float = setting(
        5.0,
        "on SIGTERM, seconds the gateway keeps accepting requests before it stops "
        "listening and drains: /readyz answers 503 at once, live responses (SSE, long-polls) end with "
        "their resume offset, and every response says Connection: close, so load balancers and proxies "
        "stop sending here and stop reusing its connections first (no 502s); cover the readiness probe's "
        "period x failure threshold plus the load balancer's reaction (0: stop at once). SIGINT skips it",
    )
    keepalive_seconds: float = setting(
        75.0,
        "seconds a connection may sit idle, or take to send a request's head "
        "(line and headers), before it is closed; longer than common load-balancer idle timeouts",
        parse=_POSITIVE,
    )
    long_poll_timeout: float = setting(
        20.0, "seconds a long-poll waits for data before answering 204", parse=_POSITIVE
    )
    sse_cycle_seconds: float = setting(
        60.0,
        "seconds after which an SSE response ends so clients reconnect (CDN collapsing)",
        parse=_POSITIVE,
    )
    sse_heartbeat_seconds: float = setting(
        15.0, "seconds between SSE comment lines on an idle connection", parse=_POSITIVE
    )
    notice_payload_bytes: int = setting(
        8192,
        "appends up to this size travel inside the pub/sub notice, so live "
        "readers get them without a Redis read (0: always read)",
    )
    require_durable: bool = setting(
        False,
        "refuse to start when the Redis could lose acknowledged writes "
        "(appendonly off, or appendfsync not 'always')",
    )
    workers: int = setting(
        1, "worker processes sharing the port (more than 1 runs under gunicorn)", parse=_whole(1)
    )
    log_level: str = setting(
        "info", "debug, info, warning or error", parse=_log_level, commands=(*SHARED, *UPGRADE, *BACKUP)
    )
    log_format: str = setting(
        "text",
        "text (one line per record) or json (one JSON object per line: ts, level, logger, "
        "message and the record's fields)",
        parse=_one_of(*LOG_FORMATS),
        commands=(*SHARED, *UPGRADE, *BACKUP),
    )
    access_log: bool = setting(
        False,
        "log one line per request: method, path (query values that may be secrets, such as "
        "a signed URL's signature, redacted), status, bytes, duration, client address",
    )
    # http/fastpath.py
    fast_appends: bool = setting(
        True,
        "answer plain stream appends on the connection, before aiohttp's request "
        "machinery (about half an append's CPU); off: every request takes aiohttp's path",
    )
    redis_max_connections: int = setting(
        64,
        "Redis connections per process; requests beyond them wait (up to 10 s) for a free one",
        parse=_whole(1),
    )
    # the archive (serve reads it; `durable-streams archive` writes it)
    archive_url: str | None = setting(
        None,
        "where archived Parquet files live: a directory or an fsspec URL such as "
        "s3://bucket/prefix (needs s3fs); unset: <data-dir>/archive",
        commands=(*SHARED, "doctor", *BACKUP),
    )
    archive_hints: bool = setting(
        True,
        "tell archive workers which streams got appends (one Redis call per second per "
        "process); turn off when no archive worker runs, so hints do not pile up in Redis",
    )
    # streams/registry.py: a __registry__ stream of creates and deletes
    stream_registry: bool = setting(
        False,
        "keep a __registry__ JSON stream of every create and delete, as upstream's "
        "reference server does (its test UI finds streams so); best effort: GET <prefix>/__ds/streams is "
        "the exact listing",
    )
    archive_cache_bytes: int = setting(
        128 * 1024 * 1024, "memory for archive files decoded for cold reads (per process)"
    )
    archive_hot_bytes: int = setting(
        1024 * 1024, "newest bytes of each stream kept in Redis (0 allowed)", commands=ARCHIVE
    )
    archive_hot_seconds: float = setting(
        300.0, "entries younger than this stay in Redis (0 allowed)", commands=ARCHIVE
    )
    archive_min_bytes: int = setting(
        4 * 1024 * 1024,
        "archive a stream once this much is past the hot window ... (also: a file "
        "below this size is rewritten with the next piece of its stream and day; 0: never)",
        commands=ARCHIVE,
    )
    archive_max_delay: float = setting(
        600.0,
        "... or once its oldest such entry has been past the hot window this many seconds",
        commands=ARCHIVE,
    )
    archive_file_bytes: int = setting(
        128 * 1024 * 1024, "largest Parquet file", parse=_whole(1), commands=ARCHIVE
    )
    archive_interval: float = setting(
        1.0, "seconds between looks for work when idle", parse=_POSITIVE, commands=ARCHIVE
    )
    archive_reconcile_seconds: float = setting(
        60.0,
        "seconds between scans for streams with lost hints and for "
        "archives of deleted or expired streams (one worker scans at a time)",
        parse=_POSITIVE,
        commands=ARCHIVE,
    )
    archive_lease_seconds: float = setting(
        30.0,
        "how long a stream stays claimed by a worker that stopped answering "
        "(renewed after every file; a crashed worker's streams are taken over after this)",
        parse=_POSITIVE,
        commands=ARCHIVE,
    )
    archive_stall_seconds: float = setting(
        120.0,
        "the worker's /healthz (on --metrics-port) answers 503 once its loop has "
        "made no progress (a pass, a stream, a lease renewal) for this long: a liveness probe restarts a "
        "hung worker. Above any legitimate gap: an idle loop beats every --archive-interval, a busy one "
        "per stream and on every lease renewal (each third of --archive-lease-seconds)",
        parse=_POSITIVE,
        commands=ARCHIVE,
    )
    metrics_port: int = setting(
        0,
        "serve Prometheus metrics (and, for the archive worker, /healthz) on this port at --host (0: off)",
        parse=_whole(0, 65535),
        commands=("archive", "deliver"),
    )
    retention_seconds: float = setting(
        0.0,
        "drop archived data older than this while the stream goes on; reads "
        "of it answer 410 (0: keep everything)",
        commands=ARCHIVE,
    )
    # State compaction (docs/compaction.md): which streams (serve), how (the archive worker)
    compaction_prefixes: str = setting(
        "",
        "comma-separated path prefixes whose JSON streams are created compacted by key "
        "(Stream-Compaction: state) unless the PUT says Stream-Compaction: none",
    )
    compaction_lag_seconds: float = setting(
        300.0,
        "messages of a compacted stream younger than this are never compacted (0 allowed)",
        parse=_number(),
        commands=ARCHIVE,
    )
    compaction_lag_bytes: int = setting(
        1024 * 1024,
        "... nor the last this many bytes of it (0 allowed)",
        parse=_whole(0),
        commands=ARCHIVE,
    )
    compaction_interval_seconds: float = setting(
        10.0,
        "at most one compaction run of a stream in this many seconds (a run folds what it kept "
        "again: a busy stream is not re-folded on every append's hint)",
        parse=_number(),
        commands=ARCHIVE,
    )
    compaction_archive_ratio: float = setting(
        0.5,
        "fold a compacted stream's archived segments again (rewriting those with messages to "
        "drop) once what was folded since the last time reaches this share of what that kept",
        parse=_number(),
        commands=ARCHIVE,
    )
    compaction_tombstone_seconds: float = setting(
        86400.0,
        "how long a compacted delete is kept once folded: a reader away longer than this "
        "behind the compacted part must start over",
        parse=_number(),
        commands=ARCHIVE,
    )
    # access control (README, Security): on as soon as any credential source is set
    auth_tokens_file: str | None = setting(
        None,
        "JSON file of static bearer tokens (or their SHA-256), each with grants "
        "(read/write/admin on path prefixes); README, Security",
    )
    auth_jwt_key_file: str | None = setting(
        None,
        "verify JWT bearer tokens with this key: a PEM public key (RS256, ES256, "
        "EdDSA) or a file holding an HS256 secret",
    )
    auth_jwks_url: str | None = setting(
        None,
        "verify JWT bearer tokens against the keys published at this JWKS URL "
        "(cached; refetched on an unknown key id, so rotation needs no restart)",
    )
    auth_jwt_algorithms: str = setting(
        "",
        "JWT algorithms accepted, comma-separated (default: HS256 for a "
        "secret, RS256/ES256/EdDSA for a public key or JWKS)",
    )
    auth_jwt_audience: str | None = setting(
        None,
        "the 'aud' JWTs must carry (required with JWT verification: a token "
        "the same issuer signed for another service is refused)",
    )
    auth_jwt_issuer: str | None = setting(None, "JWTs must carry this 'iss'")
    auth_jwt_claim: str = setting(
        "streams",
        'the JWT claim holding grants, e.g. {"read": ["chat/"]} or '
        "\"read:chat/ write:chat/42/\" ('scope' reads the standard claim that way)",
    )
    auth_jwks_cache_seconds: float = setting(
        300.0, "how long fetched JWKS keys are used before they are fetched again"
    )
    auth_anonymous: str = setting(
        "", "grants for requests without credentials, e.g. 'read:public/' (empty: none)"
    )
    auth_signing_key_file: str | None = setting(
        None,
        "file holding the HMAC key of signed URLs ("
        "mints them at /auth/sign; for browsers and EventSource, which cannot send headers)",
    )
    auth_signed_url_max_seconds: float = setting(
        3600.0, "longest lifetime a signed URL may be given", parse=_POSITIVE
    )
    trusted_proxy_hops: int = setting(
        0,
        "proxies in front of the gateway that append to X-Forwarded-For (e.g. 1 "
        "for an ingress): anonymous clients are then told apart by the address the outermost one saw",
    )
    public_url: str | None = setting(
        None,
        "the server's public base URL (e.g. https://streams.example.com): Location "
        "headers are built from it instead of the request's Host",
    )
    cors_origins: str | None = setting(
        None,
        "origins browsers may call from, comma-separated, or '*' (default: local "
        "origins with auth off, none with auth on)",
    )
    cors_methods: str = setting("GET, HEAD, POST, PUT, DELETE, OPTIONS", "methods allowed cross-origin")
    cors_credentials: bool = setting(
        False, "allow cross-origin requests with cookies/HTTP auth (needs explicit origins)"
    )
    admin_port: int = setting(
        0,
        "serve /metrics, /healthz and /readyz on this port only, not on the public "
        "one (0: on the public port; /metrics then needs admin access when auth is on)",
        parse=_whole(0, 65535),
    )
    rate_limits: str = setting(
        "",
        "token buckets kept in Redis, shared by all gateways, e.g. "
        "'write:=100/s+200 read:chat/=50/s anonymous:read:=10/s' (README, Security)",
    )
    tenants: bool = setting(
        False,
        "tenants (docs/tenants.md): every stream request is a tenant's (its credential's, "
        "else --tenant-paths'), whose quotas its writes' scripts check exactly, on one Redis "
        "(not on Redis Cluster yet); usage is metered per tenant (archive workers move it to Parquet)",
        commands=(*SERVE, *ARCHIVE),
    )
    tenant_metrics_top: int = setting(
        50,
        "with --tenants: tenants labelled in /metrics per process (the first served); the rest are "
        'tenant="other" (the tenants API ranks every tenant)',
        parse=_whole(0, 10_000),
    )
    tenant_claim: str = setting(
        "tenant", "with --tenants: the JWT claim naming a credential's tenant (token files: 'tenant')"
    )
    tenant_paths: str = setting(
        "",
        "with --tenants: the tenant of requests without credentials (and of signed URLs), by "
        "stream path prefix, e.g. 'public/=demo acme/=acme' (the longest prefix wins; none: 403)",
    )
    max_live_connections: int = setting(
        20000, "live reads (SSE, long-poll) one process holds at once; more get 503"
    )
    max_live_per_credential: int = setting(
        1000, "live reads one credential (or anonymous client address) may hold on one process; more get 503"
    )
    # write backpressure (features/backpressure.py): writes pause before Redis is full
    write_pause_memory: str = setting(
        "90%",
        "refuse writes (PUT, POST with data: 503 + Retry-After) while Redis' used_memory "
        "is above this, so the archive, deletes and reads keep room to work: a size (512mb, 2gb: "
        "redis.conf's units) or a share of Redis' maxmemory (85%%; none when Redis has no maxmemory); "
        "on Redis Cluster per primary (its streams pause). 0 or off: never",
        parse=_memory_mark_text,
    )
    write_pause_archive_lag: float = setting(
        0.0,
        "refuse writes while the stream that has waited longest for an archive "
        "worker has waited this many seconds (ds_archive_lag_seconds; 0: never)",
    )
    write_pause_retry_after: int = setting(
        1,
        "the Retry-After, in seconds, of writes refused by --write-pause-memory or --write-pause-archive-lag",
        parse=_whole(1),
    )
    # the web console (gateway/http/console.py): auto, on or off
    console: str = setting(
        "auto",
        "serve the web console at <prefix>/__ds/console/: on, off, or auto (on unless access "
        "control is on without --auth-signing-key-file: its live tail needs signed URLs)",
        parse=_one_of(*CONSOLE_MODES),
    )
    # subscriptions (README, Subscriptions): the API on every gateway, delivery by
    # `durable-streams deliver` workers
    webhook_allow: str = setting(
        "",
        "webhook targets exempt from the SSRF rules (https only, public addresses only): "
        "comma-separated networks and host names, e.g. '127.0.0.0/8,localhost,*.svc.cluster.local' (they "
        "may use http:// and private addresses); checked at creation and at every delivery",
        commands=("serve", "deliver"),
    )
    subscription_max_streams: int = setting(
        1000, "most explicit streams one subscription request may name", parse=_whole(1)
    )
    webhook_timeout: float = setting(
        10.0,
        "seconds a webhook receiver has to answer a delivery (then it is retried)",
        parse=_POSITIVE,
        commands=DELIVER,
    )
    webhook_concurrency: int = setting(
        256, "webhook deliveries one worker has in flight at once", parse=_whole(1), commands=DELIVER
    )
    webhook_signing_key_file: str | None = setting(
        None,
        "an Ed25519 private key (PKCS#8 PEM, e.g. from a Secret) to sign "
        "webhooks with: added to the keys in Redis and signing from now on; unset: a key made and "
        "kept in Redis (`durable-streams webhook-keys rotate` replaces it)",
        commands=DELIVER,
    )
    deliver_poll_seconds: float = setting(
        0.1,
        "how often a delivery worker looks at what is due (wakes, retries, leases)",
        parse=_POSITIVE,
        commands=DELIVER,
    )
    deliver_sweep_seconds: float = setting(
        5.0,
        "how often a delivery worker looks at every outbox for wakes it was not "
        "told of (Redis Cluster: 16384 small reads)",
        parse=_POSITIVE,
        commands=DELIVER,
    )

    @property
    def auth_enabled(self) -> bool:
        """Access control is on once any source of credentials or grants is configured."""
        return bool(
            self.auth_tokens_file
            or self.auth_jwt_key_file
            or self.auth_jwks_url
            or self.auth_signing_key_file
            or self.auth_anonymous.strip()
        )

    @property
    def compaction_prefix_list(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.compaction_prefixes.split(",") if p.strip())

    @property
    def archive_location(self) -> str:
        return self.archive_url or os.path.join(self.data_dir, "archive")


# Every setting's Spec, in the order of the fields (the order of --help and the reference).
SPECS: Mapping[str, Spec] = {f.name: f.metadata[_SPEC] for f in fields(Settings)}


def taken_by(command: str) -> tuple[str, ...]:
    """The settings ``durable-streams <command>`` takes."""
    if command not in COMMANDS:
        raise ValueError(f"no command {command!r} takes settings")
    return tuple(name for name, spec in SPECS.items() if command in spec.commands)


def env_names(name: str) -> tuple[str, ...]:
    """The environment variables a setting is read from, the first set (not blank) winning."""
    return (env_name(name), *SPECS[name].also_env)


class SettingsParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit code 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def shown(name: str, raw: str) -> str:
    """A value as an error message may show it: a URL's password is not shown."""
    if name == "redis_url" and "@" in raw:
        # Whatever precedes the last "@" may be credentials, however malformed the URL
        # (a mistyped scheme leaves urlsplit no password to find).
        scheme, sep, rest = raw.partition("://")
        host = rest.rpartition("@")[2] if sep else raw.rpartition("@")[2]
        return repr(f"{scheme}{sep}***@{host}" if sep else f"***@{host}")
    return repr(raw)


def _parser(name: str, type_name: str, check: Callable[[str], object] | None) -> Parse:
    """``name``'s parser for argparse: ValueError becomes ArgumentTypeError with the whole story."""
    base = SPECS[name].parse or _BY_TYPE.get(type_name) or str

    def parse(raw: str) -> object:
        try:
            value = base(raw)
            if check is not None:
                try:
                    check(raw)
                except ValueError as exc:
                    raise ValueError(f"is not valid: {exc}") from None
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{shown(name, raw)} {exc} (flag {flag_name(name)}, env {' or '.join(env_names(name))})"
            ) from None
        return value

    parse.__name__ = name  # argparse names the parser in some messages
    return parse


def _env_default(name: str, default: object) -> object:
    """The environment's value, as a string for argparse to parse (or the field's default)."""
    for variable in env_names(name):
        # A blank variable is an unset one (compose files write `X: ${X:-}`): the default.
        raw = os.environ.get(variable, "").strip()
        if raw:
            return raw
    return default


def add_arguments(
    parser: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    checks: Mapping[str, Callable[[str], object]] | None = None,
) -> None:
    """Add ``--flag`` options (defaulting to the environment) for the settings named
    (e.g. ``taken_by(command)``; None: all). ``checks``: further validators of some
    settings' text (ValueError: a bad value), e.g. the rule parsers of layers above this
    one; those of settings not named are not used."""
    wanted = None if names is None else set(names)
    for f in fields(Settings):
        if wanted is not None and f.name not in wanted:
            continue
        type_name = str(f.type).removesuffix(" | None")
        parse = _parser(f.name, type_name, (checks or {}).get(f.name))
        default = _env_default(f.name, f.default)
        help_text = f"{SPECS[f.name].help} [env {env_name(f.name)}; default: %(default)s]"
        if type_name == "bool":
            action = parser.add_argument(
                flag_name(f.name), action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            action.type = parse  # only for a default from the environment (a string)
        else:
            parser.add_argument(flag_name(f.name), type=parse, default=default, help=help_text)


def from_env() -> Settings:
    """Settings from the environment alone (how gunicorn-launched workers get them)."""
    parser = SettingsParser(prog="durable-streams")
    add_arguments(parser)
    return from_namespace(parser.parse_args([]))


def from_namespace(ns: argparse.Namespace) -> Settings:
    values = {f.name: getattr(ns, f.name) for f in fields(Settings) if hasattr(ns, f.name)}
    return Settings(**values)


def conflict(settings: Settings) -> str | None:
    """What makes a combination of settings unusable (each setting valid alone), or None."""
    url = settings.redis_url or ""
    if settings.redis_cluster and not url:
        return "--redis-cluster needs --redis-url (a node of the cluster); the embedded Redis is one node"
    if settings.redis_cluster and urlsplit(url).scheme == "unix":
        return "--redis-cluster needs a redis:// or rediss:// --redis-url: cluster nodes are found by address"
    if settings.redis_cluster and urlsplit(url).path not in ("", "/", "/0"):
        return "--redis-cluster: a Redis Cluster has database 0 only; drop the /<db> from --redis-url"
    if settings.min_replicas_ack and not url:
        return "--min-replicas-ack needs --redis-url: the embedded Redis has no replicas"
    if settings.tenants and settings.redis_cluster:
        return "--tenants needs one Redis primary: a tenant's quotas and streams are checked by one script"
    if settings.write_pause_archive_lag and not settings.archive_hints:
        return "--write-pause-archive-lag needs --archive-hints: the lag is measured on the archive hints"
    if settings.min_replicas_ack and settings.min_replicas_ack_timeout >= settings.redis_timeout:
        return "--min-replicas-ack-timeout must be below --redis-timeout (the wait is part of the call)"
    return None
