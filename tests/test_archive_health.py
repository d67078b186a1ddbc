"""The archive worker's /healthz (on --metrics-port): 200 while its loop makes
progress, 503 with a one-line reason once it has made none for
--archive-stall-seconds (here: Redis stopped answering, so the loop waits on it),
200 again once it moves on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.embedded import EmbeddedRedis
from workers.health import Heartbeat

from .conftest import free_port, redis_server_binary


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _until(
    url: str, status: int, proc: subprocess.Popen[bytes], log: Path, seconds: float
) -> tuple[float, str]:
    """Seconds until ``url`` answered ``status``, and the body it answered."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        assert proc.poll() is None, log.read_text()
        got, body = _get(url)
        if got == status:
            return time.monotonic() - started, body
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}:\n{log.read_text()}")


def test_healthz_fails_while_the_loop_is_stuck(tmp_path: Path) -> None:
    redis_server_binary("needs a redis-server binary to pause")
    server = EmbeddedRedis(tmp_path / "redis", port=free_port())
    server.start()
    metrics_port = free_port()
    log = tmp_path / "archive.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "archive", "--redis-url", server.url,
             "--archive-url", str(tmp_path / "archive"), "--metrics-port", str(metrics_port),
             "--archive-interval", "0.2", "--archive-stall-seconds", "2", "--archive-lease-seconds", "2"],
            env=env, stderr=err,
        )  # fmt: skip
    health = f"http://127.0.0.1:{metrics_port}/healthz"
    assert server.pid is not None
    try:
        _until(health, 200, proc, log, 30)
        time.sleep(3)  # an idle loop beats every --archive-interval: longer than the limit is fine
        assert _get(health) == (200, "ok\n")

        status, text = _get(f"http://127.0.0.1:{metrics_port}/metrics")
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert status == 200 and families["ds_build_info"].samples[0].value == 1
        assert [s.labels for s in families["ds_archive_due_streams"].samples] == [{}]

        os.kill(server.pid, signal.SIGSTOP)  # the loop's next Redis call waits for an answer
        took, reason = _until(health, 503, proc, log, 20)
        assert 1.5 < took < 10, took
        assert reason.startswith("stalled: the archive loop has made no progress for ")
        assert reason.count("\n") == 1
        assert "--archive-stall-seconds 2" in reason
        os.kill(server.pid, signal.SIGCONT)
        _until(health, 200, proc, log, 20)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        server.stop()
    assert code == 0, log.read_text()


def test_heartbeat() -> None:
    now = [100.0]
    beat = Heartbeat(stall_seconds=10, clock=lambda: now[0])
    assert beat.problem() is None
    now[0] = 110.0
    assert beat.problem() is None
    now[0] = 110.5
    assert beat.problem() == (
        "stalled: the archive loop has made no progress for 10 s (--archive-stall-seconds 10)"
    )
    beat.beat(next_within=60)  # an idle wait of 60 s is announced: not a stall
    now[0] = 180.0  # beaten at 110.5: due by 170.5, stalled 10 s after that
    assert beat.problem() is None
    now[0] = 181.0
    assert beat.problem() is not None


def test_a_stall_limit_shorter_than_lease_renewals_is_refused(tmp_path) -> None:
    """A long round beats only when it renews its lease (every third of the lease): a stall
    limit below two renewals would restart healthy workers mid-file."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gateway", "archive", "--redis-url", "redis://127.0.0.1:1/0",
         "--archive-url", str(tmp_path), "--metrics-port", "19464", "--archive-lease-seconds", "600",
         "--archive-stall-seconds", "120"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "--archive-stall-seconds (120) must exceed" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
