"""Render the Helm chart as ``helm template`` does, and check the manifests (a harness, not tests).

With ``helm`` on PATH, ``helm template`` renders. Without it, ``tools/helm-render`` does: our
own renderer written from Helm's documented behaviour (Go text/template + sprig, Helm's values
layering, functions, ordering and error messages; its README lists where it differs), built
offline once into a cache directory from Debian's Go packages (``.ci/run`` installs them).
Helm validates the values against values.schema.json before rendering; for helm-render this
module does it, with jsonschema.
``CHART_RENDERER=helm`` or ``=helm-render`` forces one or the other.

    rendered = render([ROOT / "tests/chart_values/auth.yaml"], {"externalRedis.url": "redis://r:6379/0"})
    deployment = rendered.get("Deployment", "t-durable-streams-gateway")
    validate(rendered.docs)   # strict Kubernetes schemas, several Kubernetes versions
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import VersionNotSupportedError

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "durable-streams"
RENDERER_SOURCES = ROOT / "tools" / "helm-render"
# Kubernetes releases the manifests must be valid for (kubernetes-validate ships 1.32-1.37):
# the oldest one still common on managed clusters, a middle one, the newest.
SUPPORTED_KUBE: tuple[str, ...] = ("1.33", "1.35", "1.37")
DEFAULT_KUBE = "1.35.0"  # .Capabilities.KubeVersion unless a test asks for another
# Custom resources kubernetes-validate has no schema for: not validated (named, so that an
# unknown kind anywhere else is an error rather than silently skipped).
SCHEMALESS_KINDS: frozenset[tuple[str, str]] = frozenset(
    {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
)

PathLike: TypeAlias = str | os.PathLike[str]
SetValues: TypeAlias = Mapping[str, str | int | bool]


class RenderError(Exception):
    """Helm (or helm-render) refused: ``fail``/``required``, schema, YAML, dependencies.

    ``str(error)`` is what helm printed on stderr ("Error: execution error at (...): ...").
    """


class Unavailable(RuntimeError):
    """Neither helm nor the means to build helm-render (go + Debian's Go packages)."""


@dataclass(frozen=True)
class Rendered:
    text: str  # the whole `helm template` output
    docs: list[dict[str, Any]]  # its YAML documents, parsed; empty ones dropped
    notes: str = ""  # the rendered NOTES.txt, when render(notes=True)
    backend: str = field(default="", compare=False)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for doc in self.of_kind(kind):
            if (doc.get("metadata") or {}).get("name") == name:
                return doc
        raise KeyError(f"no {kind} {name!r} rendered; there are: {', '.join(_ids(self.docs)) or 'none'}")


def render(
    values_files: Sequence[PathLike] = (),
    set_values: SetValues | None = None,
    *,
    set_string: Mapping[str, str] | None = None,
    release: str = "t",
    namespace: str = "default",
    kube_version: str = DEFAULT_KUBE,
    api_versions: Sequence[str] = (),
    notes: bool = False,
    chart: Path = CHART,
) -> Rendered:
    """``helm template RELEASE CHART -f ... --set ... --set-string ... --kube-version -a``.

    Values layer as in Helm: values.yaml, each file in order, then ``set_values``, then
    ``set_string``. Raises RenderError with helm's message when helm would fail.
    """
    flags = _value_flags(values_files, set_values, set_string)
    flags += ["--namespace", namespace, "--kube-version", kube_version]
    for api in api_versions:
        flags += ["--api-versions", api]
    return _render(release, chart, tuple(flags), notes)


@functools.lru_cache(maxsize=256)
def _render(release: str, chart: Path, flags: tuple[str, ...], notes: bool) -> Rendered:
    """One render per distinct command line: the tests ask for the same ones many times, and
    each is a subprocess or three. (A failed render raises: nothing is cached then.)"""
    description, helm = _backend()
    if helm is not None:
        return _render_with_helm(helm, release, chart, list(flags), notes, description)
    exe = _renderer()
    args = [str(exe), "--release", release, *flags, str(chart)]
    _check_schema(chart, json.loads(_run([*args, "--dump-values"])))
    text = _run(args)
    return Rendered(text, _parse(text), _run([*args, "--notes"]) if notes else "", description)


def lint(
    values_files: Sequence[PathLike] = (),
    set_values: SetValues | None = None,
    *,
    set_string: Mapping[str, str] | None = None,
    kube_version: str = DEFAULT_KUBE,
    strict: bool = False,
    chart: Path = CHART,
) -> str | None:
    """``helm lint``: None when it passed, else why it was not run (no helm): pytest.skip(reason).

    Raises RenderError (with helm's report) when the chart fails linting.
    """
    description, helm = _backend()
    if helm is None:
        return f"`helm lint` not run: no `helm` on PATH (the chart is rendered with {description})"
    flags = ["--kube-version", kube_version, *_value_flags(values_files, set_values, set_string)]
    done = subprocess.run([helm, "lint", str(chart), *flags, *(["--strict"] if strict else [])],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        raise RenderError(f"{done.stdout.strip()}\n{done.stderr.strip()}".strip())
    return None


def validate(
    docs: Iterable[Mapping[str, Any]],
    kube_versions: Sequence[str] = SUPPORTED_KUBE,
    *,
    schemaless: frozenset[tuple[str, str]] = SCHEMALESS_KINDS,
) -> None:
    """Every manifest against the strict (no unknown fields) schemas of each Kubernetes version.

    Kinds in ``schemaless`` (custom resources) are skipped; any other kind without a schema
    (a typo, a removed API) is a problem. Raises AssertionError listing every problem.
    """
    problems: dict[str, list[str]] = {}
    for doc in docs:
        api, kind = doc.get("apiVersion"), doc.get("kind")
        what = f"{kind} {(doc.get('metadata') or {}).get('name')!r} ({api})"
        if not isinstance(api, str) or not isinstance(kind, str):
            problems.setdefault(f"{what}: not a Kubernetes object (apiVersion and kind)", [])
            continue
        if (api, kind) in schemaless:
            continue
        for version in kube_versions:
            try:
                kubernetes_validate.validate(dict(doc), version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path) or "(top level)"
                problems.setdefault(f"{what}: {where}: {e.message}", []).append(version)
            except kubernetes_validate.SchemaNotFoundError:
                problems.setdefault(f"{what}: no such API (no schema for it)", []).append(version)
            except VersionNotSupportedError:
                raise RuntimeError(
                    f"kubernetes-validate {kubernetes_validate.version.__version__} has no "
                    f"schemas for Kubernetes {version}: upgrade it"
                ) from None
    if problems:
        lines = [
            f"- {msg}" + (f" [Kubernetes {', '.join(vs)}]" if vs else "") for msg, vs in problems.items()
        ]
        raise AssertionError("manifests invalid for Kubernetes:\n" + "\n".join(lines))


# ---- helpers


def helm_render() -> Path:
    """The tools/helm-render binary, built if needed (raises Unavailable without go)."""
    return _renderer()


@functools.cache
def _backend() -> tuple[str, str | None]:
    """(description, helm path or None for helm-render); printed once."""
    forced = os.environ.get("CHART_RENDERER", "")
    helm = shutil.which("helm") if forced in ("", "helm") else None
    if forced == "helm" and helm is None:
        raise Unavailable("CHART_RENDERER=helm but no `helm` on PATH")
    if helm is not None:
        version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True).stdout.strip()
        description = f"helm ({helm}, {version or 'version unknown'})"
    else:
        description = f"helm-render (tools/helm-render built as {_renderer()}), as `helm` is not on PATH"
    print(f"tests/chart.py: rendering the chart with {description}", file=sys.stderr)
    return description, helm


@functools.cache
def _renderer() -> Path:
    """Build tools/helm-render once (cached on disk by the hash of its sources)."""
    go = shutil.which("go")
    if go is None:
        raise Unavailable(
            "neither `helm` nor `go` on PATH; install helm, or (Debian) the packages .ci/run installs"
        )
    digest = hashlib.sha256(subprocess.run([go, "version"], capture_output=True).stdout)
    for path in sorted(RENDERER_SOURCES.iterdir()):
        if path.suffix in (".go", ".mod", ".sh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cache = Path(
        os.environ.get("HELM_RENDER_CACHE") or Path(tempfile.gettempdir()) / f"helm-render-{os.getuid()}"
    )
    exe = cache / digest.hexdigest()[:16] / "helm-render"
    if exe.exists():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    partial = exe.with_name(f"helm-render.{os.getpid()}.partial")
    env = {**os.environ, "GOCACHE": str(cache / "go-build")}
    built = subprocess.run(
        ["bash", str(RENDERER_SOURCES / "build.sh"), str(partial)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        hint = " (missing Debian Go packages? see .ci/run)" if "cannot find package" in built.stderr else ""
        raise Unavailable(f"building tools/helm-render failed{hint}:\n{built.stderr}")
    os.replace(partial, exe)  # atomic: parallel sessions may build at the same time
    return exe


def _value_flags(
    files: Sequence[PathLike], sets: SetValues | None, strings: Mapping[str, str] | None
) -> list[str]:
    def text(v: str | int | bool) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    flags = [arg for f in files for arg in ("-f", str(f))]
    flags += [arg for k, v in (sets or {}).items() for arg in ("--set", f"{k}={text(v)}")]
    flags += [arg for k, v in (strings or {}).items() for arg in ("--set-string", f"{k}={v}")]
    return flags


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RenderError((done.stderr or done.stdout).strip())
    return done.stdout


def _check_schema(chart: Path, values: dict[str, Any]) -> None:
    """What Helm does before rendering: the coalesced values against values.schema.json."""
    schema_file = chart / "values.schema.json"
    if not schema_file.exists():
        return
    schema = json.loads(schema_file.read_text())
    # Helm 3.21 (santhosh-tekuri/jsonschema) honours $schema, defaulting to 2020-12; formats not asserted.
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    errors = sorted(validator.iter_errors(values), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        name = yaml.safe_load((chart / "Chart.yaml").read_text())["name"]
        lines = [f"- at '{_pointer(e.absolute_path)}': {e.message}" for e in errors]
        raise RenderError(
            "Error: values don't meet the specifications of the schema(s) in the following "
            f"chart(s):\n{name}:\n" + "\n".join(lines)
        )


def _pointer(path: Iterable[object]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


NOTES_TEMPLATE = "zz-chart-py-notes.yaml"
NOTES_FILE = "chart-py-NOTES.txt"


def _render_with_helm(
    helm: str, release: str, chart: Path, flags: list[str], notes: bool, description: str
) -> Rendered:
    if not notes:
        text = _run([helm, "template", release, str(chart), *flags])
        return Rendered(text, _parse(text), "", description)
    # `helm template` renders NOTES.txt but never prints it: render a copy of the chart in
    # which a ConfigMap carries `tpl` of the notes (same values and helpers; errors in the
    # notes are then reported from within this template).
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(chart, Path(tmp) / chart.name))
        notes_txt = copy / "templates" / "NOTES.txt"
        if notes_txt.exists():
            notes_txt.rename(copy / NOTES_FILE)
        else:
            (copy / NOTES_FILE).write_text("")
        (copy / "templates" / NOTES_TEMPLATE).write_text(
            f'{{{{- $notes := tpl (.Files.Get "{NOTES_FILE}") . }}}}\n'
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: chart-py-notes\n"
            "data:\n  notes: {{ $notes | toJson }}\n"
        )
        text = _run([helm, "template", release, str(copy), *flags])
    section = re.compile(
        rf"---\n# Source: [^\n]*/templates/{re.escape(NOTES_TEMPLATE)}\n.*?(?=^---\n# Source: |\Z)",
        re.S | re.M,
    )
    docs = _parse(text)
    carrier = next(
        d for d in docs if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "chart-py-notes"
    )
    text = section.sub("", text)
    return Rendered(text, [d for d in docs if d is not carrier], carrier["data"]["notes"], description)


class _Loader(yaml.SafeLoader):
    """YAML as Kubernetes reads it: dates stay strings; a bare '=' is a string."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def _parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc]


def _ids(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    return [f"{d.get('kind')}/{(d.get('metadata') or {}).get('name')}" for d in docs]
