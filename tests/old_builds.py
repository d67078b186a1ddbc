"""Earlier builds of this repository, from its own git history, runnable beside the working tree.

``materialize(commit, cache_dir)`` extracts the commit's tree (``git archive``) into
``<cache_dir>/<commit>/src`` and gives it a venv of its own that shares this venv's installed
dependencies but not the working tree: ``deps.pth`` puts this venv's site-packages on its path
(a path line only adds the directory: that directory's own .pth files, among them the editable
install of the working tree, are not run) and ``zz_build.pth`` the extracted source after it. The
package maps ``lua/`` to the import name ``durable_streams_lua``; a symlink does that in the
extracted tree, or the old build would load the working tree's scripts through the editable
install. Its own distribution metadata (a ``.dist-info`` with the commit's entry points, found
before the working tree's) keeps its subcommands its own too: the working tree may register
commands the old build does not have.

Run it with ``build.command(...)`` and ``cwd=build.cwd``: never from inside the repository, where
``python -m`` would import the working tree's package from the current directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# 43826ef: the last landed build (key layout v3, no fleet registry).
LAST_RELEASE = "43826ef523b6c800403c31b1e85344a5fee9eb7f"
# 5e147b7: the last build on key layout v2 (the parent of 4f5629d, which introduced layout v3).
LAYOUT_V2 = "5e147b73d9408e5e93daaf84b2f4362ca36e2916"

DIST_NAME = "durable_streams_redis"  # the project's distribution (pyproject.toml's name, normalized)


class MissingCommit(RuntimeError):
    """The commit is not in this clone's history (a shallow clone)."""


@dataclass(frozen=True)
class OldBuild:
    commit: str
    root: Path  # <cache_dir>/<commit>: src/ and venv/

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def cwd(self) -> str:
        """Where its processes run: outside the repository."""
        return str(self.root)

    @property
    def env(self) -> dict[str, str]:
        """Overrides for its processes' environment: no PYTHONPATH (empty is ignored) that
        could put the working tree first."""
        return {"PYTHONPATH": ""}

    def command(self, *args: str) -> list[str]:
        """``python -m gateway`` of this build (``durable-streams``), then ``args``."""
        return [str(self.python), "-m", "gateway", *args]


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True)


def resolve(commit: str) -> str:
    """The full hash of ``commit``; MissingCommit if this clone does not have it."""
    found = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if found.returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.decode().strip() == "true"
        raise MissingCommit(
            f"commit {commit} is not in {REPO_ROOT}'s history"
            + (" (a shallow clone)" if shallow else "")
            + ": the upgrade tests build earlier commits from it; fetch the history first "
            "(`git fetch --unshallow`; .ci/run does it)"
        )
    return found.stdout.decode().strip()


def _base_python() -> str:
    """The interpreter this venv was made from (the old build's venv is made from it too)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def _entry_points(pyproject: Path) -> str:
    """entry_points.txt of the build's pyproject.toml (its scripts and entry-point groups)."""
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    groups: dict[str, dict[str, str]] = {}
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    groups.update(project.get("entry-points", {}))
    return "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()
    )


def _build(commit: str, root: Path) -> None:
    src, venv = root / "src", root / "venv"
    src.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO_ROOT), "archive", commit], stdout=subprocess.PIPE)
    assert archive.stdout is not None
    extracted = subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    if archive.wait() != 0 or extracted.returncode != 0:
        said = extracted.stderr.decode(errors="replace")
        raise RuntimeError(f"git archive {commit} | tar -x failed: {said}")
    (src / "durable_streams_lua").symlink_to("lua")
    made = subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(venv)], capture_output=True)
    if made.returncode != 0:
        raise RuntimeError(f"python -m venv {venv} failed: {made.stderr.decode(errors='replace')}")
    python = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, cwd=root,
        ).stdout.strip()
    )  # fmt: skip
    (purelib / "deps.pth").write_text(_site_packages() + "\n")
    (purelib / "zz_build.pth").write_text(f"{src}\n")
    project = tomllib.loads((src / "pyproject.toml").read_text()).get("project", {})
    name, version = project.get("name", DIST_NAME), project.get("version", "0")
    info = purelib / f"{DIST_NAME}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(_entry_points(src / "pyproject.toml"))
    # It must import its own source, not the working tree's.
    where = subprocess.run(
        [str(python), "-c", "import gateway, workers; print(gateway.__file__); print(workers.__file__)"],
        capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    found = where.stdout.split()
    if where.returncode != 0 or len(found) != 2 or not all(Path(f).is_relative_to(src) for f in found):
        raise RuntimeError(f"the build of {commit} imports {found or where.stderr}, not {src}")


def materialize(commit: str, cache_dir: Path) -> OldBuild:
    """``commit`` as a runnable build under ``cache_dir`` (made once, then reused)."""
    full = resolve(commit)
    root = cache_dir / full
    if not (root / ".ready").exists():  # not made yet, or its making was interrupted
        shutil.rmtree(root, ignore_errors=True)
        _build(full, root)
        (root / ".ready").touch()
    return OldBuild(full, root)


def session_build(tmp_path_factory: pytest.TempPathFactory, commit: str) -> OldBuild:
    """``materialize`` cached for the pytest session (under its base temporary directory)."""
    cache = tmp_path_factory.getbasetemp() / "old-builds"
    cache.mkdir(exist_ok=True)
    return materialize(commit, cache)
