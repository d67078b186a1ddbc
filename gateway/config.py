"""Settings: one definition per setting, read from flags or environment.

Every flag ``--some-name`` is also ``DURABLE_STREAMS_SOME_NAME`` in the
environment (flags win), so the same settings serve a laptop and a container.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

ENV_PREFIX = "DURABLE_STREAMS_"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 4437
    redis_url: str | None = None
    data_dir: str = "./data"
    prefix: str = "/v1/stream"
    max_body_bytes: int = 4 * 1024 * 1024
    max_chunk_bytes: int = 4 * 1024 * 1024
    read_inline_bytes: int = 64 * 1024
    max_path_bytes: int = 1024
    max_json_messages: int = 1000
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    body_timeout: float = 60.0
    write_timeout: float = 30.0
    redis_timeout: float = 5.0
    shutdown_seconds: float = 30.0
    keepalive_seconds: float = 75.0
    long_poll_timeout: float = 20.0
    sse_cycle_seconds: float = 60.0
    sse_heartbeat_seconds: float = 15.0
    notice_payload_bytes: int = 8192
    require_durable: bool = False
    workers: int = 1
    log_level: str = "info"
    redis_max_connections: int = 64
    # the archive (serve reads it; `durable-streams archive` writes it)
    archive_url: str | None = None
    archive_hints: bool = True
    archive_cache_bytes: int = 128 * 1024 * 1024
    archive_hot_bytes: int = 1024 * 1024
    archive_hot_seconds: float = 300.0
    archive_min_bytes: int = 4 * 1024 * 1024
    archive_max_delay: float = 600.0
    archive_file_bytes: int = 128 * 1024 * 1024
    archive_interval: float = 1.0
    archive_reconcile_seconds: float = 60.0
    archive_lease_seconds: float = 30.0
    metrics_port: int = 0
    retention_seconds: float = 0.0
    # access control (README, Security): on as soon as any credential source is set
    auth_tokens_file: str | None = None
    auth_jwt_key_file: str | None = None
    auth_jwks_url: str | None = None
    auth_jwt_algorithms: str = ""
    auth_jwt_audience: str | None = None
    auth_jwt_issuer: str | None = None
    auth_jwt_claim: str = "streams"
    auth_jwks_cache_seconds: float = 300.0
    auth_anonymous: str = ""
    auth_signing_key_file: str | None = None
    auth_signed_url_max_seconds: float = 3600.0
    trusted_proxy_hops: int = 0
    public_url: str | None = None
    cors_origins: str | None = None
    cors_methods: str = "GET, HEAD, POST, PUT, DELETE, OPTIONS"
    cors_credentials: bool = False
    admin_port: int = 0
    rate_limits: str = ""
    max_live_connections: int = 20000
    max_live_per_credential: int = 1000

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
    def archive_location(self) -> str:
        return self.archive_url or os.path.join(self.data_dir, "archive")


# Which command takes which settings (the rest are `serve`'s alone).
COMMON = ("host", "redis_url", "data_dir", "archive_url", "log_level")
WORKER = (
    "archive_hot_bytes",
    "archive_hot_seconds",
    "archive_min_bytes",
    "archive_max_delay",
    "archive_file_bytes",
    "archive_interval",
    "archive_reconcile_seconds",
    "archive_lease_seconds",
    "retention_seconds",
    "metrics_port",
)


HELP = {
    "host": "address to listen on",
    "port": "port to listen on (4437 is the protocol's)",
    "redis_url": "Redis to use, e.g. redis://host:6379/0; unset: start an embedded "
    "redis-server in --data-dir (AOF, fsync on every write)",
    "data_dir": "where the embedded Redis keeps its data",
    "prefix": "URL prefix streams live under",
    "max_body_bytes": "largest request body accepted; larger ones get 413",
    "max_chunk_bytes": "most bytes one read response returns (clients continue from Stream-Next-Offset)",
    "read_inline_bytes": "reads of byte streams longer than this fetch their data with a plain XRANGE "
    "after the script instead of through Lua (one more round trip; a quarter of Redis' work)",
    "max_path_bytes": "longest stream path accepted",
    "max_json_messages": "most JSON messages one request may append (a larger array gets 413): "
    "each is one Redis entry, and the script that stores them runs alone on Redis",
    "max_inflight_body_bytes": "request body bytes one process holds at once, across requests; "
    "beyond it new bodies get 503 with Retry-After",
    "body_timeout": "seconds a client may take to send a whole request body (then 408)",
    "write_timeout": "seconds a live response (SSE) may wait for a client to take its data "
    "before the connection is dropped",
    "redis_timeout": "seconds to wait for a Redis reply; an append unanswered by then gets 504 "
    "(outcome unknown: retry it only as an idempotent producer)",
    "keepalive_seconds": "seconds a connection may sit idle, or take to send a request's head "
    "(line and headers), before it is closed; longer than common load-balancer idle timeouts",
    "shutdown_seconds": "on SIGTERM, seconds in-flight requests get to finish before the process "
    "exits (live responses end at once)",
    "long_poll_timeout": "seconds a long-poll waits for data before answering 204",
    "sse_cycle_seconds": "seconds after which an SSE response ends so clients reconnect (CDN collapsing)",
    "sse_heartbeat_seconds": "seconds between SSE comment lines on an idle connection",
    "notice_payload_bytes": "appends up to this size travel inside the pub/sub notice, so live "
    "readers get them without a Redis read (0: always read)",
    "require_durable": "refuse to start when the Redis could lose acknowledged writes "
    "(appendonly off, or appendfsync not 'always')",
    "workers": "worker processes sharing the port (more than 1 runs under gunicorn)",
    "redis_max_connections": "Redis connections per process; requests beyond them wait (up to 10 s) "
    "for a free one",
    "log_level": "debug, info, warning or error",
    "archive_url": "where archived Parquet files live: a directory or an fsspec URL such as "
    "s3://bucket/prefix (needs s3fs); unset: <data-dir>/archive",
    "archive_hints": "tell archive workers which streams got appends (one Redis call per second per "
    "process); turn off when no archive worker runs, so hints do not pile up in Redis",
    "archive_cache_bytes": "memory for archive files decoded for cold reads (per process)",
    "archive_hot_bytes": "newest bytes of each stream kept in Redis (0 allowed)",
    "archive_hot_seconds": "entries younger than this stay in Redis (0 allowed)",
    "archive_min_bytes": "archive a stream once this much is past the hot window ...",
    "archive_max_delay": "... or once its oldest such entry is this many seconds old",
    "archive_file_bytes": "largest Parquet file; smaller ones of a stream and day are merged up to it",
    "archive_interval": "seconds between looks for work when idle",
    "archive_reconcile_seconds": "seconds between scans for streams with lost hints and for "
    "archives of deleted or expired streams (one worker scans at a time)",
    "archive_lease_seconds": "how long a stream stays claimed by a worker that stopped answering "
    "(renewed after every file; a crashed worker's streams are taken over after this)",
    "metrics_port": "serve Prometheus metrics on this port at --host (0: off)",
    "retention_seconds": "drop archived data older than this while the stream goes on; reads "
    "of it answer 410 (0: keep everything)",
    "auth_tokens_file": "JSON file of static bearer tokens (or their SHA-256), each with grants "
    "(read/write/admin on path prefixes); README, Security",
    "auth_jwt_key_file": "verify JWT bearer tokens with this key: a PEM public key (RS256, ES256, "
    "EdDSA) or a file holding an HS256 secret",
    "auth_jwks_url": "verify JWT bearer tokens against the keys published at this JWKS URL "
    "(cached; refetched on an unknown key id, so rotation needs no restart)",
    "auth_jwt_algorithms": "JWT algorithms accepted, comma-separated (default: HS256 for a "
    "secret, RS256/ES256/EdDSA for a public key or JWKS)",
    "auth_jwt_audience": "the 'aud' JWTs must carry (required with JWT verification: a token "
    "the same issuer signed for another service is refused)",
    "auth_jwt_issuer": "JWTs must carry this 'iss'",
    "auth_jwt_claim": 'the JWT claim holding grants, e.g. {"read": ["chat/"]} or '
    "\"read:chat/ write:chat/42/\" ('scope' reads the standard claim that way)",
    "auth_jwks_cache_seconds": "how long fetched JWKS keys are used before they are fetched again",
    "auth_anonymous": "grants for requests without credentials, e.g. 'read:public/' (empty: none)",
    "auth_signing_key_file": "file holding the HMAC key of signed URLs ("
    "mints them at /auth/sign; for browsers and EventSource, which cannot send headers)",
    "auth_signed_url_max_seconds": "longest lifetime a signed URL may be given",
    "trusted_proxy_hops": "proxies in front of the gateway that append to X-Forwarded-For (e.g. 1 "
    "for an ingress): anonymous clients are then told apart by the address the outermost one saw",
    "public_url": "the server's public base URL (e.g. https://streams.example.com): Location "
    "headers are built from it instead of the request's Host",
    "cors_origins": "origins browsers may call from, comma-separated, or '*' (default: local "
    "origins with auth off, none with auth on)",
    "cors_methods": "methods allowed cross-origin",
    "cors_credentials": "allow cross-origin requests with cookies/HTTP auth (needs explicit origins)",
    "admin_port": "serve /metrics, /healthz and /readyz on this port only, not on the public "
    "one (0: on the public port; /metrics then needs admin access when auth is on)",
    "rate_limits": "token buckets kept in Redis, shared by all gateways, e.g. "
    "'write:=100/s+200 read:chat/=50/s anonymous:read:=10/s' (README, Security)",
    "max_live_connections": "live reads (SSE, long-poll) one process holds at once; more get 503",
    "max_live_per_credential": "live reads one credential (or anonymous client address) may "
    "hold on one process; more get 503",
}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _env_default(name: str, kind: type, default: object) -> object:
    raw = os.environ.get(env_name(name))
    if raw is None:
        if name == "redis_url":
            return os.environ.get("REDIS_URL") or default
        return default
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def serve_settings() -> list[str]:
    return [f.name for f in fields(Settings) if f.name not in WORKER]


def add_arguments(parser: argparse.ArgumentParser, names: list[str] | tuple[str, ...] | None = None) -> None:
    """Add ``--flag`` options (defaulting to the environment) for the settings named."""
    kinds = {"int": int, "float": float, "bool": bool, "str": str, "str | None": str}
    for f in fields(Settings):
        if names is not None and f.name not in names:
            continue
        kind = kinds[str(f.type)]
        flag = "--" + f.name.replace("_", "-")
        default = _env_default(f.name, kind, f.default)
        help_text = f"{HELP[f.name]} [env {env_name(f.name)}; default: %(default)s]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)


def from_env() -> Settings:
    """Settings from the environment alone (how gunicorn-launched workers get them)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_namespace(parser.parse_args([]))


def from_namespace(ns: argparse.Namespace) -> Settings:
    values = {f.name: getattr(ns, f.name) for f in fields(Settings) if hasattr(ns, f.name)}
    return Settings(**values)
