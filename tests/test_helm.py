"""The Helm chart and the container image, checked without Kubernetes or Docker.

Always: values.yaml against values.schema.json, the static YAML, every value
the templates use exists and is documented, every DURABLE_STREAMS_* variable
they set is a real setting, the admin port (metrics, health) kept off the
Ingress and used by the probes, auth files mounted where the settings point,
and the Dockerfile's entrypoint runs from the wheel it installs. With ``helm``
on PATH also: helm lint, helm template, and kubeconform (or kubernetes-validate)
on the rendered manifests, and the same port and auth checks on them.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from dataclasses import fields
from pathlib import Path

import jsonschema
import pytest
import yaml

from gateway.config import Settings, env_name

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "durable-streams"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
TEMPLATES = {p.name: p.read_text() for p in (CHART / "templates").iterdir()}
# Values whose contents are free-form maps or lists handed to Kubernetes or to Bitnami's chart.
OPAQUE = ("resources", "extraEnv", "podSecurityContext", "securityContext", "annotations",
          "labels", "podLabels", "podAnnotations", "nodeSelector", "affinity")  # fmt: skip


def value_paths(node: object, prefix: str = "", leaves_only: bool = False) -> list[str]:
    """Dotted paths of values.yaml; ``leaves_only``: the settable ones (not sections)."""
    out = []
    if isinstance(node, dict):
        for key, child in node.items():
            path = f"{prefix}.{key}" if prefix else key
            section = isinstance(child, dict) and key not in OPAQUE
            if not (leaves_only and section):
                out.append(path)
            if section:
                out += value_paths(child, path, leaves_only)
    return out


def test_values_match_the_schema() -> None:
    jsonschema.validate(VALUES, SCHEMA)
    for broken in ({"gateway": {"workers": 0}}, {"gatewy": {}}, {"ingress": {"controller": "haproxy"}},
                   {"externalRedis": {"url": "http://not-redis"}}, {"gateway": {"adminPort": 70000}},
                   {"gateway": {"publicUrl": "https://streams.example.com/v1"}},
                   {"gateway": {"trustedProxyHops": "two"}}, {"gateway": {"trustedProxyHops": -1}},
                   {"auth": {"signingKey": {"value": "too-short"}}}, {"auth": {"anonymous": "public/"}},
                   {"auth": {"tokens": {"json": {"tokens": [{"name": "a", "grants": "read:x/"}]}}}},
                   {"auth": {"jwt": {"jwksUrl": "ftp://keys"}}}, {"auth": {"basic": {}}},
                   {"cors": {"origins": ["*"], "credentials": True}}, {"cors": {"credentials": True}},
                   {"cors": {"origins": ["app.example.com"]}}, {"cors": {"methods": ["PATCH"]}},
                   {"rateLimits": "write=100/s"}, {"rateLimits": "read:=10/day"}):  # fmt: skip
        values = copy.deepcopy(VALUES)
        for key, child in broken.items():
            merge = isinstance(child, dict) and isinstance(values.get(key), dict)
            values[key] = {**values[key], **child} if merge else child
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(values, SCHEMA)
    for fine in ({"gateway": {"trustedProxyHops": 2, "publicUrl": "https://s.example.com", "adminPort": 0}},
                 {"auth": {**VALUES["auth"], "anonymous": "read:public/, read:docs/", "tokens": {"json": {
                     "tokens": [{"name": "a", "sha256": "ab" * 32, "grants": "read:x/"}]}}}},
                 {"cors": {"origins": ["https://app.example.com"], "methods": ["GET"], "credentials": True}},
                 {"rateLimits": "write:=100/s+200 read:chat/=50/s anonymous:read:=0.5/min"}):  # fmt: skip
        values = copy.deepcopy(VALUES)
        for key, child in fine.items():
            values[key] = {**values[key], **child} if isinstance(child, dict) else child
        jsonschema.validate(values, SCHEMA)


def test_static_yaml() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "durable-streams"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"]) and chart["appVersion"]
    (redis,) = chart["dependencies"]
    assert redis["name"] == "redis" and redis["condition"] == "redis.enabled"
    assert "appendfsync always" in VALUES["redis"]["commonConfiguration"]
    assert set(TEMPLATES) >= {"gateway-deployment.yaml", "service.yaml", "ingress.yaml", "hpa.yaml",
                              "pdb.yaml", "archive-deployment.yaml", "spark-cronjob.yaml", "secret.yaml",
                              "servicemonitor.yaml", "NOTES.txt", "_helpers.tpl"}  # fmt: skip


def test_every_value_used_exists_and_every_value_is_documented() -> None:
    known = set(value_paths(VALUES))
    used = {m for text in TEMPLATES.values() for m in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text)}
    assert used, "no values used?"
    assert used <= known, f"templates use values missing from values.yaml: {sorted(used - known)}"
    rows = [line for line in (CHART / "README.md").read_text().splitlines() if line.startswith("| `")]

    def documented(path: str) -> bool:  # `a.b.c` itself, or `a.b.x`, `.c` in one table row
        parent, _, leaf = path.rpartition(".")
        return any(
            f"`{path}`" in row or (parent and f"`{parent}." in row and f"`.{leaf}`" in row) for row in rows
        )

    undocumented = sorted(p for p in value_paths(VALUES, leaves_only=True) if not documented(p))
    assert not undocumented, f"values missing from the chart README: {undocumented}"
    assert set(SCHEMA["properties"]) == set(VALUES), (
        "the schema and values.yaml list different top-level keys"
    )


def test_template_actions_are_balanced() -> None:
    """Without helm, at least every {{ if/with/range/define }} has its {{ end }}."""
    for name, text in TEMPLATES.items():
        actions = re.findall(r"\{\{-?\s*(.*?)\s*-?\}\}", text, flags=re.S)
        assert text.count("{{") == text.count("}}") == len(actions), name
        depth = 0
        for action in actions:
            word = action.split(" ", 1)[0]
            if word in ("if", "with", "range", "define"):
                depth += 1
            elif word == "end":
                depth -= 1
                assert depth >= 0, f"{name}: an end too many"
        assert depth == 0, f"{name}: {depth} block(s) not ended"


def test_environment_variables_are_real_settings() -> None:
    settings = {env_name(f.name) for f in fields(Settings)}
    used = {m for text in TEMPLATES.values() for m in re.findall(r"\b(DURABLE_STREAMS_[A-Z_]+)\b", text)}
    assert used and used <= settings, sorted(used - settings)


def test_pods_are_locked_down_and_drain_sse() -> None:
    security = VALUES["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert VALUES["podSecurityContext"]["runAsNonRoot"]
    gateway = VALUES["gateway"]
    assert gateway["terminationGracePeriodSeconds"] > gateway["preStopSleepSeconds"] + 30
    assert VALUES["ingress"]["timeoutSeconds"] > max(
        gateway["sseCycleSeconds"], gateway["longPollTimeoutSeconds"]
    )
    deployment = TEMPLATES["gateway-deployment.yaml"]
    assert "path: /healthz" in deployment and "path: /readyz" in deployment and "preStop" in deployment
    assert "proxy-buffering" in TEMPLATES["ingress.yaml"]


def _define(name: str) -> str:
    """The body of ``{{ define name }}`` in _helpers.tpl, actions' whitespace and trim marks dropped."""
    start = r'\{\{-? define "' + re.escape(name) + r'" -?\}\}'
    end = r"\{\{-? end -?\}\}\s*(?=\{\{/\*|\{\{-? define|$)"  # the define's own end: then the next one
    body = re.search(start + "(.*?)" + end, TEMPLATES["_helpers.tpl"], flags=re.S)
    assert body, f"no define {name}"
    return re.sub(r"\{\{-?\s*(.*?)\s*-?\}\}", r"{{\1}}", body.group(1)).replace("\n", "")


def test_admin_port_is_for_probes_and_metrics_and_never_routed() -> None:
    """/metrics, /healthz and /readyz answer 404 on the public port once gateway.adminPort is
    set: probes and the ServiceMonitor must use the admin port, the Ingress must never reach it."""
    assert VALUES["gateway"]["adminPort"], "the chart keeps metrics and health off the public port by default"
    assert _define("ds.opsPort") == "{{if .Values.gateway.adminPort}}admin{{else}}http{{end}}"
    deployment = TEMPLATES["gateway-deployment.yaml"]
    for path in ("/healthz", "/readyz"):
        (port,) = re.findall(rf"path: {path}\n\s*port: (.+)", deployment)
        assert port.strip() == '{{ include "ds.opsPort" . }}', f"the {path} probe does not use the admin port"
    assert re.search(r"- name: admin\n\s*containerPort: \{\{ \.Values\.gateway\.adminPort \}\}", deployment)
    monitor = TEMPLATES["servicemonitor.yaml"]
    assert '- port: {{ include "ds.opsPort" . }}\n      path: /metrics' in monitor
    ingress = TEMPLATES["ingress.yaml"]
    assert re.findall(r"port:\n\s*(\w+): (\S+)", ingress) == [("name", "http")], (
        "the Ingress routes only http"
    )
    assert "adminPort" not in ingress and "opsPort" not in ingress
    public, _, admin = TEMPLATES["service.yaml"].partition("{{- if .Values.gateway.adminPort }}\n---\n")
    assert "admin" not in public.split("ports:", 1)[1], (
        "the public (maybe LoadBalancer) Service carries the admin port"
    )
    assert "type: ClusterIP" in admin and "targetPort: admin" in admin


def test_auth_files_are_mounted_where_the_settings_point() -> None:
    """Each DURABLE_STREAMS_AUTH_*_FILE names a file of a Secret volume, mounted as a directory:
    a subPath mount would never see the Secret change (the token file is re-read on change)."""
    configmap, deployment = TEMPLATES["configmap.yaml"], TEMPLATES["gateway-deployment.yaml"]
    files = dict(re.findall(r"(DURABLE_STREAMS_AUTH_\w+_FILE): (\S+)", configmap))
    assert set(files) == {"DURABLE_STREAMS_AUTH_TOKENS_FILE", "DURABLE_STREAMS_AUTH_JWT_KEY_FILE",
                          "DURABLE_STREAMS_AUTH_SIGNING_KEY_FILE"}  # fmt: skip
    for path in files.values():
        directory, _, name = path.rpartition("/")
        assert f"mountPath: {directory}\n" in deployment, path
        assert f"path: {name}\n" in deployment, path
    assert "subPath:" not in deployment
    assert deployment.count("readOnly: true") >= 4  # the archive and the three auth volumes
    assert (
        "existingSecret" in TEMPLATES["auth-secret.yaml"] and "kind: Secret" in TEMPLATES["auth-secret.yaml"]
    )
    notes = TEMPLATES["NOTES.txt"]
    assert "if not $auth" in notes and "ACCESS CONTROL IS OFF" in notes


def _helm() -> str:
    helm = shutil.which("helm")
    if helm is None:
        print("SKIP reason: no `helm` binary on PATH; static checks above still ran")
        pytest.skip("no `helm` binary on PATH (static chart checks still ran)")
    return helm


def _render(helm: str, *args: str) -> tuple[str, dict[tuple[str, str], dict]]:
    rendered = subprocess.run([helm, "template", "t", str(CHART), *args], check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
    return rendered, {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}


def _gateway_probes(docs: dict[tuple[str, str], dict]) -> set[object]:
    (container,) = docs["Deployment", "t-durable-streams-gateway"]["spec"]["template"]["spec"]["containers"]
    return {container[probe]["httpGet"]["port"] for probe in ("livenessProbe", "readinessProbe")}


def test_helm_lint_and_template_validate() -> None:
    helm = _helm()
    args = ["--set", "externalRedis.url=redis://redis:6379/0", "--set", "ingress.enabled=true",
            "--set", "spark.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
            "--set", "auth.tokens.existingSecret=ds-tokens", "--set", "auth.jwt.jwksUrl=https://idp.example/jwks",
            "--set", "auth.signingKey.value=0123456789abcdef0123456789abcdef"]  # fmt: skip
    subprocess.run([helm, "dependency", "build", str(CHART)], check=False, capture_output=True)
    subprocess.run([helm, "lint", str(CHART), *args], check=True)
    rendered, docs = _render(helm, *args)
    kinds = {kind for kind, _ in docs}
    assert {"Deployment", "Service", "Ingress", "HorizontalPodAutoscaler", "PodDisruptionBudget", "CronJob",
            "ServiceMonitor", "Secret"} <= kinds  # fmt: skip
    # the admin port: probes and the ServiceMonitor on it; only the public port behind the Ingress
    assert _gateway_probes(docs) == {"admin"}
    backends = [p["backend"]["service"] for rule in docs["Ingress", "t-durable-streams"]["spec"]["rules"]
                for p in rule["http"]["paths"]]  # fmt: skip
    assert backends and all(b == {"name": "t-durable-streams", "port": {"name": "http"}} for b in backends)
    assert [p["name"] for p in docs["Service", "t-durable-streams"]["spec"]["ports"]] == ["http"]
    assert docs["Service", "t-durable-streams-admin"]["spec"]["ports"][0]["targetPort"] == "admin"
    endpoints = docs["ServiceMonitor", "t-durable-streams"]["spec"]["endpoints"]
    assert {"admin", "metrics"} == {e["port"] for e in endpoints}
    # auth: files from Secrets, as directories; settings point at them
    settings = docs["ConfigMap", "t-durable-streams-settings"]["data"]
    assert (
        settings["DURABLE_STREAMS_TRUSTED_PROXY_HOPS"] == "1"
        and settings["DURABLE_STREAMS_ADMIN_PORT"] == "9090"
    )
    assert settings["DURABLE_STREAMS_PUBLIC_URL"] == "http://streams.example.com"
    pod = docs["Deployment", "t-durable-streams-gateway"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["auth-tokens"]["secret"]["secretName"] == "ds-tokens"
    assert volumes["auth-signing-key"]["secret"]["secretName"] == "t-durable-streams-auth"
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    for name in ("DURABLE_STREAMS_AUTH_TOKENS_FILE", "DURABLE_STREAMS_AUTH_SIGNING_KEY_FILE"):
        mount = mounts[settings[name].rpartition("/")[0]]
        assert mount["readOnly"] and "subPath" not in mount
    # without an admin port, everything on the public port again
    _, plain = _render(
        helm, "--set", "externalRedis.url=redis://redis:6379/0", "--set", "gateway.adminPort=0"
    )
    assert _gateway_probes(plain) == {"http"} and ("Service", "t-durable-streams-admin") not in plain
    validator = shutil.which("kubeconform")
    if validator:
        subprocess.run([validator, "-strict", "-ignore-missing-schemas", "-summary"], input=rendered,
                       text=True, check=True)  # fmt: skip
    else:
        print("kubeconform not on PATH: rendered manifests parsed, not schema-validated")
