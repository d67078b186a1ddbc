"""Bad settings, from flags or the environment: one line on stderr naming the flag,
the variable and the value, exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from gateway import config
from gateway.cli.main import build_parser


def _run(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# (command line, environment, the flag named, the value shown)
CASES = [
    (["serve"], {"DURABLE_STREAMS_MAX_BODY_BYTES": "lots"}, "--max-body-bytes", "'lots'"),
    (["serve"], {"DURABLE_STREAMS_BODY_TIMEOUT": "soon"}, "--body-timeout", "'soon'"),
    (["serve"], {"DURABLE_STREAMS_LONG_POLL_TIMEOUT": "nan"}, "--long-poll-timeout", "'nan'"),
    (["serve"], {"DURABLE_STREAMS_REQUIRE_DURABLE": "maybe"}, "--require-durable", "'maybe'"),
    (["serve"], {"DURABLE_STREAMS_LOG_LEVEL": "loud"}, "--log-level", "'loud'"),
    (["serve"], {"DURABLE_STREAMS_LOG_FORMAT": "xml"}, "--log-format", "'xml'"),
    (["serve"], {"DURABLE_STREAMS_PORT": "70000"}, "--port", "'70000'"),
    (["serve"], {"DURABLE_STREAMS_ADMIN_PORT": "-1"}, "--admin-port", "'-1'"),
    (["serve"], {"DURABLE_STREAMS_RATE_LIMITS": "write:=lots"}, "--rate-limits", "'write:=lots'"),
    (["serve"], {"DURABLE_STREAMS_AUTH_ANONYMOUS": "sing:public/"}, "--auth-anonymous", "'sing:public/'"),
    (["serve"], {"DURABLE_STREAMS_PREFIX": "v1"}, "--prefix", "'v1'"),
    (["serve", "--max-body-bytes", "lots"], {}, "--max-body-bytes", "'lots'"),
    (["serve", "--workers", "0"], {}, "--workers", "'0'"),
    (["serve", "--sse-heartbeat-seconds", "-1"], {}, "--sse-heartbeat-seconds", "'-1'"),
    (["serve", "--port", "http"], {}, "--port", "'http'"),
    (["serve", "--rate-limits", "read:chat/=5/fortnight"], {}, "--rate-limits", "'read:chat/=5/fortnight'"),
    (["serve", "--log-format", "yaml"], {}, "--log-format", "'yaml'"),
    (["serve"], {"DURABLE_STREAMS_CONSOLE": "maybe"}, "--console", "'maybe'"),
    (["serve", "--console", "yes"], {}, "--console", "'yes'"),
    (["serve", "--shutdown-delay-seconds", "-1"], {}, "--shutdown-delay-seconds", "'-1'"),
    (["serve"], {"DURABLE_STREAMS_SHUTDOWN_DELAY_SECONDS": "inf"}, "--shutdown-delay-seconds", "'inf'"),
    (["archive"], {"DURABLE_STREAMS_ARCHIVE_STALL_SECONDS": "0"}, "--archive-stall-seconds", "'0'"),
    (["archive", "--metrics-port", "99999"], {}, "--metrics-port", "'99999'"),
    (["archive"], {"DURABLE_STREAMS_ARCHIVE_HOT_BYTES": "1MB"}, "--archive-hot-bytes", "'1MB'"),
    (["migrate", "--redis-timeout", "x"], {}, "--redis-timeout", "'x'"),
    (["serve", "--webhook-allow", "nope/99"], {}, "--webhook-allow", "'nope/99'"),
    (["deliver"], {"DURABLE_STREAMS_WEBHOOK_ALLOW": "10.0.0.1/8"}, "--webhook-allow", "'10.0.0.1/8'"),
    (["deliver", "--webhook-concurrency", "0"], {}, "--webhook-concurrency", "'0'"),
    (["deliver", "--webhook-timeout", "0"], {}, "--webhook-timeout", "'0'"),
    (["serve"], {"DURABLE_STREAMS_WRITE_PAUSE_MEMORY": "lots"}, "--write-pause-memory", "'lots'"),
    (["serve", "--write-pause-memory", "120%"], {}, "--write-pause-memory", "'120%'"),
    (["serve", "--write-pause-memory", "1.5gb"], {}, "--write-pause-memory", "'1.5gb'"),
    (["serve"], {"DURABLE_STREAMS_WRITE_PAUSE_ARCHIVE_LAG": "-1"}, "--write-pause-archive-lag", "'-1'"),
    (["serve", "--write-pause-retry-after", "0"], {}, "--write-pause-retry-after", "'0'"),
]


def test_bad_values_are_one_line_and_exit_code_2() -> None:
    procs = [_run(args, env) for args, env, _, _ in CASES]  # all at once: each is a Python start-up
    for (args, env, flag, shown), proc in zip(CASES, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        case = f"{args} {env}: {err!r}"
        assert proc.returncode == 2, case
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err, case
        variable = config.env_name(flag[2:].replace("-", "_"))
        assert flag in err and variable in err and shown in err, case


def test_a_redis_url_password_is_not_shown() -> None:
    proc = _run(["serve"], {"DURABLE_STREAMS_REDIS_URL": "http://app:hunter2@redis:6379/0"})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.count("\n") == 1, err
    assert "hunter2" not in err and "--redis-url" in err and "DURABLE_STREAMS_REDIS_URL" in err, err


def test_a_flag_wins_over_a_bad_variable_and_good_spellings_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_STREAMS_MAX_BODY_BYTES", "lots")
    monkeypatch.setenv("DURABLE_STREAMS_REQUIRE_DURABLE", "Off")
    monkeypatch.setenv("DURABLE_STREAMS_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("DURABLE_STREAMS_ARCHIVE_CACHE_BYTES", "1_000")
    args = build_parser().parse_args(["serve", "--max-body-bytes", "10"])
    settings = config.from_namespace(args)
    assert settings.max_body_bytes == 10 and settings.require_durable is False
    assert settings.log_level == "warning" and settings.archive_cache_bytes == 1000


def _bad_value(kind: str) -> str:
    return {"int": "1.5", "float": "quickly", "bool": "perhaps"}[kind]


@pytest.mark.parametrize(
    "name", [f.name for f in fields(config.Settings) if str(f.type) in ("int", "float", "bool")]
)
def test_every_typed_setting_is_checked(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process, every int, float and bool setting, from the environment."""
    kind = str(next(f.type for f in fields(config.Settings) if f.name == name))
    monkeypatch.setenv(config.env_name(name), _bad_value(kind))
    with pytest.raises(SystemExit) as exit_info:
        config.from_env()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert config.flag_name(name) in err and config.env_name(name) in err and repr(_bad_value(kind)) in err


def test_blank_variables_are_unset_and_logging_spellings_are_taken(monkeypatch) -> None:
    """Compose files write `X: ${X:-}`; `warn` and `critical` are logging's own words."""
    from gateway import config

    monkeypatch.setenv("DURABLE_STREAMS_REDIS_URL", "")
    monkeypatch.setenv("DURABLE_STREAMS_PREFIX", " ")
    monkeypatch.setenv("DURABLE_STREAMS_ARCHIVE_HINTS", "")
    monkeypatch.setenv("DURABLE_STREAMS_LOG_LEVEL", "WARN")
    settings = config.from_env()
    assert settings.redis_url is None and settings.prefix == config.Settings.prefix
    assert settings.archive_hints == config.Settings.archive_hints and settings.log_level == "warning"
    monkeypatch.setenv("DURABLE_STREAMS_LOG_LEVEL", "critical")
    assert config.from_env().log_level == "error"


def test_a_redis_password_never_reaches_the_error_line() -> None:
    from gateway.config import shown

    for url in ("redis://default:hunter2@h:6379/0", "redis//default:hunter2@h:6379",
                "default:hunter2@h:6379", "rediss://:hunter2@x@h:1/0"):  # fmt: skip
        assert "hunter2" not in shown("redis_url", url), url


def test_console_is_auto_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """--console / DURABLE_STREAMS_CONSOLE: auto by default, any case, the flag winning."""
    assert config.from_env().console == "auto"
    monkeypatch.setenv("DURABLE_STREAMS_CONSOLE", " OFF ")
    assert config.from_env().console == "off"
    assert config.from_namespace(build_parser().parse_args(["serve", "--console", "On"])).console == "on"


def test_write_pause_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """--write-pause-*: 90% of maxmemory, no lag limit and Retry-After 1 by default; sizes in
    redis.conf's units; a lag limit needs the archive hints it is measured on."""
    settings = config.from_env()
    assert (settings.write_pause_memory, settings.write_pause_archive_lag) == ("90%", 0.0)
    assert settings.write_pause_retry_after == 1
    assert config.memory_mark(settings.write_pause_memory) == config.MemoryMark(share=0.9)
    monkeypatch.setenv("DURABLE_STREAMS_WRITE_PAUSE_MEMORY", " 2GB ")
    monkeypatch.setenv("DURABLE_STREAMS_WRITE_PAUSE_ARCHIVE_LAG", "120")
    settings = config.from_env()
    assert settings.write_pause_memory == "2gb" and config.memory_mark("2gb").bytes == 2 << 30
    assert settings.write_pause_archive_lag == 120.0 and config.conflict(settings) is None
    args = build_parser().parse_args(["serve", "--write-pause-memory", "off", "--no-archive-hints"])
    assert config.memory_mark(config.from_namespace(args).write_pause_memory) == config.MemoryMark()
    assert "--archive-hints" in (config.conflict(config.from_namespace(args)) or "")


def test_each_command_takes_the_settings_declared_for_it() -> None:
    """config.setting(commands=...) says which commands take a setting: their parsers agree."""
    parser = build_parser()
    (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command in config.COMMANDS:
        flags = {flag for a in subcommands.choices[command]._actions for flag in a.option_strings}
        taken = {name for name in config.SPECS if config.flag_name(name) in flags}
        assert taken == set(config.taken_by(command)), command
    with pytest.raises(ValueError):
        config.taken_by("no-such-command")
