"""tools/helm-render behaves as Helm documents: values layering, --set, errors, output.

The chart tests (test_helm.py) trust helm-render wherever ``helm`` is missing; these pin the
Helm behaviours they depend on, on small charts written here. Skipped when helm-render
cannot be built (no go, or no Debian Go packages: see .ci/run).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .chart import Unavailable, helm_render

# Each value with its Go type: how a value was typed is what matters.
TYPES = '{{- range $k, $v := .Values }}{{ $k }}: {{ printf "%T %v" $v $v | quote }}\n{{ end }}'
CHART_YAML = "apiVersion: v2\nname: c\nversion: 0.1.0\n"


@pytest.fixture(scope="module")
def exe() -> Path:
    try:
        return helm_render()
    except Unavailable as e:
        pytest.skip(str(e))


def make_chart(root: Path, templates: dict[str, str], values: str = "", chart_yaml: str = CHART_YAML) -> Path:
    chart = root / "c"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(chart_yaml)
    (chart / "values.yaml").write_text(values)
    for name, text in templates.items():
        (chart / "templates" / name).parent.mkdir(parents=True, exist_ok=True)
        (chart / "templates" / name).write_text(text)
    return chart


def configmap(*lines: str) -> str:
    """A ConfigMap whose data are ``lines`` (its first data line is line 6 of the file)."""
    head = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm\ndata:\n"
    return head + "".join(f"  {x}\n" for x in lines)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def run(exe: Path, chart: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(exe), "--release", "r", *args, str(chart)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def ok(exe: Path, chart: Path, *args: str) -> str:
    done = run(exe, chart, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def error(exe: Path, chart: Path, *args: str) -> str:
    done = run(exe, chart, *args)
    assert done.returncode == 1, done.stdout
    assert done.stderr.startswith("Error: ")
    return done.stderr


def values(exe: Path, chart: Path, *args: str) -> dict[str, Any]:
    return json.loads(ok(exe, chart, *args, "--dump-values"))


def data(exe: Path, chart: Path, *args: str) -> dict[str, Any]:
    """The data of the one rendered document."""
    (doc,) = [d for d in yaml.safe_load_all(ok(exe, chart, *args)) if d]
    return doc["data"]


# -- values ---------------------------------------------------------------------------------------


def test_set_types_values_as_helm_does(exe: Path, tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"types.yaml": TYPES})
    typed = "i=42,neg=-3,zero=0,t=true,f=FALSE,fl=1.5,oct=007,s=text,big=99999999999999999999"
    got = yaml.safe_load(ok(exe, chart, "--set", typed, "--set-string", "ss=42,sb=true,sn=null"))
    assert got == {
        "i": "int64 42", "neg": "int64 -3", "zero": "int64 0", "t": "bool true", "f": "bool false",
        "fl": "string 1.5", "oct": "string 007", "s": "string text", "big": "string 99999999999999999999",
        "ss": "string 42", "sb": "string true", "sn": "string null",
    }  # fmt: skip
    # lists, typed item by item (spaces kept); --set-string keeps strings
    assert values(exe, chart, "--set", "l={a, 2,true}")["l"] == ["a", " 2", True]
    assert values(exe, chart, "--set-string", "l={1,2}")["l"] == ["1", "2"]
    assert values(exe, chart, "--set", "l={}")["l"] == [""]  # as in Helm


def test_set_paths_and_escapes(exe: Path, tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"types.yaml": TYPES})
    got = values(exe, chart, "--set", "a.b.c=1,s[0].port=80,s[0].host=h,m[1]=x,n[0][1]=y",
                 "--set", r"node.kubernetes\.io/os=linux,csv=a\,b,eq=k=v")  # fmt: skip
    assert got == {
        "a": {"b": {"c": 1}}, "s": [{"port": 80, "host": "h"}], "m": [None, "x"], "n": [[None, "y"]],
        "node": {"kubernetes.io/os": "linux"}, "csv": "a,b", "eq": "k=v",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("arg", "message"),
    [("a", 'key "a" has no value'), ("a.b", 'key "a.b" has no value'), ("a=1,b", 'key "b" has no value'),
     ("a={x,y", "must end with '}'"), ("a[x]=1", "not a number"), ("a[-1]=1", "not a number"),
     ("a[70000]=1", "above the limit"), ("=1", "empty key"), ("a..b=1", "empty key"),
     ("a=1,a.b=2", "a is 1, not a map"), ("a[0]b=1", "after a list index")],
)  # fmt: skip
def test_malformed_set_is_an_error(exe: Path, tmp_path: Path, arg: str, message: str) -> None:
    chart = make_chart(tmp_path, {"types.yaml": TYPES})
    err = error(exe, chart, "--set", arg)
    assert "failed parsing --set data: " in err and message in err


def test_layers_merge_maps_replace_lists_and_null_deletes(exe: Path, tmp_path: Path) -> None:
    defaults = "keep: 1\ngone: 2\nnested: {a: 1, b: 2}\nlist: [1, 2]\ntable: {x: 1}\nnull_default: null\n"
    chart = make_chart(tmp_path, {"types.yaml": TYPES}, defaults)
    first = write(tmp_path / "1.yaml", "nested: {b: null, c: 3}\nlist: [9]\nmine: 1\nkeep: 5\n")
    second = write(tmp_path / "2.yaml", "keep: 6\nmine: null\n")
    got = values(exe, chart, "-f", first, "-f", second, "--set", "gone=null,table.y=2",
                 "--set-string", "keep=7")  # fmt: skip
    # a null removes a default; with no default beneath it, it stays (as in Helm)
    assert got == {"keep": "7", "nested": {"a": 1, "c": 3}, "list": [9], "table": {"x": 1, "y": 2},
                   "null_default": None, "mine": None}  # fmt: skip
    # --set-string applies after --set, whatever the order on the command line
    assert values(exe, chart, "--set-string", "keep=s", "--set", "keep=3")["keep"] == "s"
    # an index replaces a default list whole; it patches a list given with -f
    assert values(exe, chart, "--set", "list[1]=5")["list"] == [None, 5]
    patched = write(tmp_path / "3.yaml", "list: [{a: 1}, {a: 2}]\n")
    assert values(exe, chart, "-f", patched, "--set", "list[1].b=3")["list"] == [{"a": 1}, {"a": 2, "b": 3}]


def test_numbers_from_files_are_floats_and_from_set_integers(exe: Path, tmp_path: Path) -> None:
    template = configmap("q: {{ .Values.num | quote }}", "y: {{ toYaml .Values.num }}")
    chart = make_chart(tmp_path, {"cm.yaml": template}, "num: 268435456\n")
    assert data(exe, chart) == {"q": "2.68435456e+08", "y": 268435456}
    assert data(exe, chart, "--set", "num=268435456")["q"] == "268435456"
    # YAML 1.1, as Helm reads it: an unquoted `n`, `yes` or `off` is a boolean, even as a key
    assert values(exe, chart, "-f", write(tmp_path / "v.yaml", "n: 1\nv: yes\n")) == {
        "false": 1, "v": True, "num": 268435456}  # fmt: skip


def test_bad_values_files(exe: Path, tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"types.yaml": TYPES})
    for bad in (write(tmp_path / "bad.yaml", "a: [\n"), write(tmp_path / "list.yaml", "- a\n")):
        assert f"failed to parse {bad}" in error(exe, chart, "-f", bad)
    assert "no such file" in error(exe, chart, "-f", str(tmp_path / "none.yaml"))


# -- templates and errors -------------------------------------------------------------------------


def test_builtin_objects(exe: Path, tmp_path: Path) -> None:
    def joined(*exprs: str) -> str:
        return f'{{{{ list {" ".join(exprs)} | join " " | quote }}}}'

    release = ("Name", "Namespace", "Service", "IsInstall", "Revision")
    kube = ("", ".Major", ".Minor", ".GitVersion")
    template = configmap(
        "release: " + joined(*(f".Release.{x}" for x in release)),
        "chart: " + joined(*(f".Chart.{x}" for x in ("Name", "Version", "AppVersion", "KubeVersion"))),
        "kube: " + joined(*(f".Capabilities.KubeVersion{x}" for x in kube)),
        "apis: " + joined(*(f'(.Capabilities.APIVersions.Has "{x}")' for x in ("apps/v1", "x.io/v1", "y/1"))),
        "template: " + joined(".Template.Name", ".Template.BasePath"),
        'file: {{ .Files.Get "extra/a.txt" | quote }}',
        'missing: "{{ .Values.nothing }}"',
        'lookup: {{ lookup "v1" "Secret" "ns" "s" | toJson | quote }}',
    )
    chart_yaml = CHART_YAML + 'appVersion: "2.0"\nkubeVersion: ">=1.25.0-0"\n'
    chart = make_chart(tmp_path, {"cm.yaml": template}, chart_yaml=chart_yaml)
    (chart / "extra").mkdir()
    (chart / "extra" / "a.txt").write_text("hello")
    got = data(exe, chart, "--namespace", "ns", "--kube-version", "1.31.2", "-a", "x.io/v1")
    assert got == {
        "release": "r ns Helm true 1", "chart": "c 0.1.0 2.0 >=1.25.0-0", "kube": "v1.31.2 1 31 v1.31.2",
        "apis": "true true false", "template": "c/templates/cm.yaml c/templates", "file": "hello",
        "missing": "", "lookup": "{}",
    }  # fmt: skip
    assert "incompatible with Kubernetes v1.24.0" in error(exe, chart, "--kube-version", "1.24.0")


def test_fail_and_required_are_reported_where_the_file_calls_them(exe: Path, tmp_path: Path) -> None:
    helpers = '{{- define "check" -}}{{- if .Values.bad }}{{ fail "bad is set" }}{{ end -}}{{- end -}}'
    required = 'b: {{ required "b is required" .Values.b | quote }}'
    template = configmap("a: x", '{{- include "check" . }}', required)
    chart = make_chart(tmp_path, {"_helpers.tpl": helpers, "cm.yaml": template}, "b: x\n")
    assert error(exe, chart, "--set", "bad=true").startswith(
        "Error: execution error at (c/templates/cm.yaml:7:6): bad is set\n")  # fmt: skip
    assert "execution error at (c/templates/cm.yaml:8:8): b is required" in error(exe, chart, "--set", "b=")
    assert "b is required" in error(exe, chart, "--set", "b=null")
    ok(exe, chart, "--set", "b=false")  # false and 0 are values
    ok(exe, chart, "--set", "b=0")


@pytest.mark.parametrize(
    ("line", "message"),
    [("a: {{ .Values.a.b.c }}", "nil pointer evaluating interface {}.b"),
     ("a: {{ toYml .Values }}", 'parse error at (c/templates/cm.yaml:6): function "toYml" not defined'),
     ('a: {{ env "HOME" }}', 'function "env" not defined'),
     ("a: [", "YAML parse error on c/templates/cm.yaml"),
     ('{{ define "loop" }}{{ include "loop" . }}{{ end }}{{ include "loop" . }}',
      "nested more than 1000 deep")],
)  # fmt: skip
def test_other_template_errors(exe: Path, tmp_path: Path, line: str, message: str) -> None:
    assert message in error(exe, make_chart(tmp_path, {"cm.yaml": configmap(line)}))


def test_include_tpl_and_functions(exe: Path, tmp_path: Path) -> None:
    template = configmap(
        'inc: {{ include "name" . | upper | quote }}',
        "tpl: {{ tpl .Values.t . | quote }}",
        "yaml: {{ toYaml .Values.m | quote }}",
        "json: {{ toJson .Values.m | quote }}",
        'from: {{ (fromYaml "a: [1]").a | first | quote }}',
        'bad: {{ hasKey (fromYaml "a: [") "Error" | quote }}',
        'sha: {{ "x" | sha256sum | trunc 8 | quote }}',
    )
    helpers = '{{ define "name" }}{{ .Release.Name }}-x{{ end }}'
    chart_values = 't: "{{ include \\"name\\" . }}/{{ .Values.m.k }}"\nm: {k: v, i: 1}\n'
    chart = make_chart(tmp_path, {"_helpers.tpl": helpers, "cm.yaml": template}, chart_values)
    assert data(exe, chart) == {"inc": "R-X", "tpl": "r-x/v", "yaml": "i: 1\nk: v", "json": '{"i":1,"k":"v"}',
                                "from": "1", "bad": "true", "sha": "2d711642"}  # fmt: skip


def test_a_name_defined_twice_keeps_the_shallowest_first_file(exe: Path, tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {
        "_a.tpl": '{{ define "x" }}a{{ end }}', "_b.tpl": '{{ define "x" }}b{{ end }}',
        "sub/_c.tpl": '{{ define "x" }}c{{ end }}', "cm.yaml": configmap('x: {{ include "x" . }}'),
    })  # fmt: skip
    assert data(exe, chart) == {"x": "a"}


# -- chart checks ---------------------------------------------------------------------------------


def test_dependencies_must_be_in_charts_whatever_their_condition(exe: Path, tmp_path: Path) -> None:
    dependency = "  - {name: redis, version: 1.x, repository: https://x, condition: redis.enabled}\n"
    chart = make_chart(tmp_path, {"cm.yaml": configmap("a: b")}, "redis:\n  enabled: false\n",
                       CHART_YAML + "dependencies:\n" + dependency)  # fmt: skip
    assert "found in Chart.yaml, but missing in charts/ directory: redis" in error(exe, chart)
    (chart / "charts" / "redis").mkdir(parents=True)
    assert "subcharts not supported by helm-render" in error(exe, chart)


def test_chart_yaml_and_release_name_checks(exe: Path, tmp_path: Path) -> None:
    chart = make_chart(tmp_path, {"cm.yaml": configmap("a: b")})
    assert "invalid release name" in error(exe, chart, "--release", "Bad_Name")
    (chart / "Chart.yaml").write_text(CHART_YAML + "type: library\n")
    assert "library charts are not installable" in error(exe, chart)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: c\n")
    assert "chart.metadata.version is required" in error(exe, chart)


# -- output ---------------------------------------------------------------------------------------


def test_output_documents_order_and_notes(exe: Path, tmp_path: Path) -> None:
    def doc(kind: str, name: str, extra: str = "") -> str:
        return f"apiVersion: v1\nkind: {kind}\nmetadata:\n  name: {name}\n{extra}"

    notes = 'Hello {{ .Release.Name }}{{ if .Values.fail }}{{ fail "notes fail" }}{{ end }}\n'
    chart = make_chart(tmp_path, {
        "_helpers.tpl": "kind: NeverRendered\n",
        "a.yaml": doc("Deployment", "d") + "---\n" + doc("Service", "s1") + "---\n  \n",
        "b.yaml": doc("Service", "s2") + "---\n" + doc("Custom", "cr"),
        "c.yaml": doc("Namespace", "ns"),
        "empty.yaml": "{{- if false }}\nkind: X\n{{- end }}\n",
        "tests/t.yaml": doc("Pod", "t", "  annotations:\n    helm.sh/hook: test\n"),
        "NOTES.txt": notes,
    })  # fmt: skip
    out = ok(exe, chart)
    # by kind in install order (unknown kinds after), then file; hooks last
    assert re.findall(r"^# Source: c/templates/(.*)\n(?:.*\n)*?  name: (.*)$", out, re.M) == [
        ("c.yaml", "ns"), ("a.yaml", "s1"), ("b.yaml", "s2"), ("a.yaml", "d"), ("b.yaml", "cr"),
        ("tests/t.yaml", "t")]  # fmt: skip
    assert out.startswith("---\n# Source: c/templates/c.yaml\napiVersion: v1\nkind: Namespace\n")
    assert out.count("---\n") == 6 and "Hello" not in out and "NeverRendered" not in out
    assert "name: t\n" not in ok(exe, chart, "--skip-tests")
    assert ok(exe, chart, "--notes") == "Hello r\n"
    # NOTES.txt is rendered even when not printed: a fail there fails the render
    assert "execution error at (c/templates/NOTES.txt:1:" in error(exe, chart, "--set", "fail=true")
