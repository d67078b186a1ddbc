"""The container image: the Dockerfile's stages and the command the image runs, checked from the
wheel it installs (no Docker engine needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

from .conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


def dockerfile_command(target: str = "runtime") -> list[str]:
    """ENTRYPOINT + CMD of a stage of the Dockerfile."""
    stage, found = None, {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            stage = line.split(" AS ")[-1].strip() if " AS " in line else None
        elif stage == target and line.split(" ", 1)[0] in ("ENTRYPOINT", "CMD"):
            found[line.split(" ", 1)[0]] = json.loads(line.split(" ", 1)[1])
    return found["ENTRYPOINT"] + found.get("CMD", [])


def dockerfile_env() -> dict[str, str]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    runtime = text.split(" AS runtime", 1)[1].split("FROM ", 1)[0]
    env_line = next(line for line in runtime.splitlines() if line.startswith("ENV "))
    return dict(pair.split("=", 1) for pair in env_line[4:].split())


def test_the_image_entrypoint_runs_from_the_wheel(tmp_path, redis_url) -> None:
    """Build the wheel the Dockerfile installs, install it alone, and start the image's command."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path / "wheels"), str(ROOT)], check=True)  # fmt: skip
    (wheel,) = (tmp_path / "wheels").glob("durable_streams_redis-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "durable_streams_lua/append.lua" in names and "durable_streams_lua/_prelude.lua" in names
    assert "workers/archiver.py" in names and "gateway/http/app.py" in names
    inits = {str(init.relative_to(ROOT)) for init in ROOT.glob("gateway/**/__init__.py")}
    assert inits <= set(names), f"packages missing from the wheel: {inits - set(names)}"
    assert any(".dist-info/entry_points.txt" in name for name in names)
    # A venv of its own holding the wheel; the dependencies come from this test run's
    # environment through a .pth line (which does not bring the repository's editable install).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    import aiohttp

    Path(site, "deps.pth").write_text(str(Path(aiohttp.__file__).parent.parent) + "\n")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)
    target = venv
    command = dockerfile_command()
    assert command == ["durable-streams", "serve"]
    assert dockerfile_command("spark")[:3] == ["python", "-m", "workers.analytics"]
    port = free_port()
    env = {**os.environ, **dockerfile_env(), "DURABLE_STREAMS_PORT": str(port),
           "DURABLE_STREAMS_REDIS_URL": redis_url, "DURABLE_STREAMS_WORKERS": "2",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}  # fmt: skip
    env["DURABLE_STREAMS_HOST"] = "127.0.0.1"  # the image listens on 0.0.0.0; loopback is enough here
    proc = subprocess.Popen([str(target / "bin" / command[0]), *command[1:]], env=env, cwd=tmp_path)
    try:
        for _ in range(150):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    assert r.status == 200
                break
            except OSError:
                assert proc.poll() is None, "the entrypoint exited"
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            assert b"ds_http_requests_total" in r.read()
        which = subprocess.run([python, "-c", "import gateway; print(gateway.__file__)"], env=env,
                               cwd=tmp_path, capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert which.startswith(site), "ran the repository, not the wheel"
        archive = subprocess.run([str(target / "bin" / command[0]), "archive", "--help"], env=env,
                                 capture_output=True, text=True)  # fmt: skip
        assert archive.returncode == 0 and "--archive-url" in archive.stdout
    finally:
        proc.terminate()
        assert proc.wait(40) == 0
