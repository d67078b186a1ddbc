"""The Helm chart, rendered the way Helm renders it and validated against Kubernetes' schemas.

``tests/chart.py`` renders with ``helm template`` when ``helm`` is on PATH, else with
``tools/helm-render`` (Go's text/template, sprig and Helm's own functions, values merged as Helm
merges them). Every values file of the matrix renders, and every manifest validates strictly
against the Kubernetes releases we support. Then one test per way a first install used to fail,
and the rules the chart promises (admin port never routed, secrets mounted as directories,
probes, safe defaults), checked on the rendered manifests rather than on template text.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import jsonschema
import pytest
import yaml

from gateway.config import Settings, env_name, taken_by

from .chart import CHART, ROOT, Rendered, RenderError, lint, render, validate

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
TEMPLATES = {str(p.relative_to(CHART / "templates")): p.read_text() for p in (CHART / "templates").rglob("*")
             if p.is_file()}  # fmt: skip
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
CASES = ROOT / "tests" / "chart_values"
# Values whose contents are free-form maps or lists handed to Kubernetes.
OPAQUE = ("resources", "extraEnv", "podSecurityContext", "securityContext", "annotations",
          "labels", "podLabels", "podAnnotations", "nodeSelector", "affinity")  # fmt: skip
REDIS = {"externalRedis.url": "redis://redis.internal:6379/0"}  # the least a user must say
S3 = {**REDIS, "archive.enabled": "true", "archive.url": "s3://b/p"}  # with the archive on S3


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


# -- the matrix: every values file renders and validates ------------------------------------------

MATRIX = {
    "minimal external Redis": ((), REDIS),
    **{f"examples/{p.name}": ((p,), {}) for p in EXAMPLES},
    **{f"tests/chart_values/{p.name}": ((p,), {}) for p in sorted(CASES.glob("*.yaml"))},
}


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_every_values_file_renders_and_validates(case: str) -> None:
    files, sets = MATRIX[case]
    rendered = render(files, sets, notes=True)
    assert rendered.of_kind("Deployment"), "no gateway rendered"
    validate(rendered.docs)
    assert "Streams are served at" in rendered.notes
    reason = lint(files, sets)
    if reason:
        print(reason)


def test_the_matrix_covers_what_users_install() -> None:
    names = {p.name for p in EXAMPLES} | {p.name for p in CASES.glob("*.yaml")}
    assert {"production.yaml", "laptop.yaml", "archive-s3.yaml", "auth.yaml", "admin-port-off.yaml",
            "redis-cluster.yaml", "subscriptions.yaml"} <= names  # fmt: skip
    laptop = render([CHART / "examples" / "laptop.yaml"])
    assert laptop.get("StatefulSet", "t-durable-streams-redis")
    production = render([CHART / "examples" / "production.yaml"])
    kinds = {d["kind"] for d in production.docs}
    assert {"Ingress", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor", "CronJob",
            "PodDisruptionBudget"} <= kinds  # fmt: skip
    for rendered in (laptop, production):  # every install delivers subscriptions
        assert rendered.get("Deployment", "t-durable-streams-deliver")


# -- one test per defect a first install met ------------------------------------------------------


def test_installs_without_fetching_a_dependency() -> None:
    """Chart.yaml declared Bitnami's redis with no charts/: Helm refused every install, even
    with redis.enabled=false ("found in Chart.yaml, but missing in charts/ directory")."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert not chart.get("dependencies") or (CHART / "Chart.lock").exists()
    render((), REDIS)  # raises RenderError as Helm would


def test_the_bundled_redis_is_the_one_the_gateways_use_and_is_durable() -> None:
    """The URL named `<release>-redis-master` (Bitnami names it `<release>-master`); the bundled
    Redis kept Bitnami's `nano` preset with no maxmemory and no noeviction."""
    rendered = render((), {"redis.enabled": "true"}, release="my-redis")
    url = rendered.get("Secret", "my-redis-durable-streams-redis-url")["stringData"]["redis-url"]
    host = re.fullmatch(r"redis://([^:/]+):6379/0", url)
    assert host, url
    service = rendered.get("Service", host.group(1))
    redis = rendered.get("StatefulSet", host.group(1))
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    last = _redis_conf(rendered, host.group(1))
    assert last["appendonly"] == "yes" and last["appendfsync"] == "always"
    assert last["maxmemory-policy"] == "noeviction" and last["maxmemory"] == VALUES["redis"]["maxmemory"]
    # extraConfig cannot undo it
    undone = render((), {"redis.enabled": "true", "redis.extraConfig": "maxmemory-policy allkeys-lru"})
    conf = undone.get("ConfigMap", "t-durable-streams-redis")["data"]["redis.conf"]
    assert conf.rstrip().endswith("maxmemory-policy noeviction")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["memory"]
    with pytest.raises(RenderError, match="redis.maxmemory is required"):
        render((), {"redis.enabled": "true", "redis.maxmemory": ""})
    with pytest.raises(RenderError, match="leave externalRedis"):
        render((), {"redis.enabled": "true", **REDIS})


def test_globals_of_umbrella_charts_are_accepted() -> None:
    """The schema forbade `global`, which umbrella charts and image-registry settings pass."""
    render((), {**REDIS, "global.imageRegistry": "registry.example.com", "global.storageClass": "fast"})


def test_a_default_install_claims_no_shared_volume() -> None:
    """A default install created a 100Gi ReadWriteMany PVC that gateways mounted: Pending where no
    RWX storage exists (most clusters), so no gateway started."""
    rendered = render((), REDIS)
    assert not rendered.of_kind("PersistentVolumeClaim")
    for deployment in rendered.of_kind("Deployment"):
        volumes = deployment["spec"]["template"]["spec"].get("volumes", [])
        assert all("persistentVolumeClaim" not in v for v in volumes), deployment["metadata"]["name"]
    gateway = _pod(rendered, "gateway")
    assert {v["name"] for v in gateway["volumes"]} == {"tmp"}, "gateways mount only what they need"
    # the archive needs a place named explicitly
    with pytest.raises(RenderError, match="archive.url=s3://bucket/prefix"):
        render((), {**REDIS, "archive.enabled": "true"})
    with pytest.raises(RenderError, match="not both"):
        render((), {**REDIS, "archive.enabled": "true", "archive.url": "s3://b/p",
                    "archive.sharedVolume.enabled": "true"})  # fmt: skip
    # on S3: no volume at all; on a shared volume: RWX, gateways read-only
    s3 = render((), S3)
    assert not s3.of_kind("PersistentVolumeClaim")
    assert _settings(s3)["DURABLE_STREAMS_ARCHIVE_URL"] == "s3://b/p"
    shared = render((), {**REDIS, "archive.enabled": "true", "archive.sharedVolume.enabled": "true"})
    (claim,) = shared.of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = {m["name"]: m for m in _pod(shared, "gateway")["containers"][0]["volumeMounts"]}
    assert mounts["archive"]["readOnly"]


def test_numbers_in_values_files_reach_the_environment_as_written(tmp_path: Path) -> None:
    """Helm reads numbers in values files as float64: `268435456` in gateway.extraEnv rendered
    `2.68435456e+08` and the gateway refused the setting."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        **{"externalRedis": {"url": REDIS["externalRedis.url"]}},
        "gateway": {"extraEnv": {"DURABLE_STREAMS_MAX_INFLIGHT_BODY_BYTES": 268435456,
                                 "DURABLE_STREAMS_SSE_HEARTBEAT_SECONDS": 0.5,
                                 "DURABLE_STREAMS_CORS_CREDENTIALS": False},
                    "maxBodyBytes": 16777216, "longPollTimeoutSeconds": 1000000},
        "archive": {"enabled": True, "url": "s3://b/p", "fileBytes": 268435456,
                    "extraEnv": {"DURABLE_STREAMS_ARCHIVE_HOT_BYTES": 10000000}},
    }))  # fmt: skip
    rendered = render([values])
    env = {e["name"]: e.get("value") for e in _pod(rendered, "gateway")["containers"][0]["env"]}
    assert env["DURABLE_STREAMS_MAX_INFLIGHT_BODY_BYTES"] == "268435456"
    assert env["DURABLE_STREAMS_SSE_HEARTBEAT_SECONDS"] == "0.5"
    assert env["DURABLE_STREAMS_CORS_CREDENTIALS"] == "false"
    archive_env = {e["name"]: e.get("value") for e in _pod(rendered, "archive")["containers"][0]["env"]}
    assert archive_env["DURABLE_STREAMS_ARCHIVE_HOT_BYTES"] == "10000000"
    settings = _settings(rendered)
    assert settings["DURABLE_STREAMS_MAX_BODY_BYTES"] == "16777216"
    assert settings["DURABLE_STREAMS_LONG_POLL_TIMEOUT"] == "1000000"
    assert settings["DURABLE_STREAMS_ARCHIVE_FILE_BYTES"] == "268435456"
    for name, value in settings.items():
        assert not re.fullmatch(r"[0-9.]+e[+-][0-9]+", value), f"{name}={value}"


def test_the_ingress_routes_streams_only() -> None:
    """The Ingress routed `/`, publishing /metrics and /healthz (with the admin port off, or to
    anything the gateway serves beside the streams)."""
    rendered = render((), {**REDIS, "ingress.enabled": "true", "gateway.adminPort": "0"})
    assert _ingress_paths(rendered) == [("/v1/stream", "Prefix")]
    signed = render((), {**REDIS, "ingress.enabled": "true",
                         "auth.signingKey.value": "0123456789abcdef0123456789abcdef"})  # fmt: skip
    assert _ingress_paths(signed) == [("/v1/stream", "Prefix"), ("/auth/sign", "Exact")]
    for path, _ in _ingress_paths(signed):
        assert not any(path.startswith(p) or p.startswith(path.rstrip("/") + "/") or path == "/"
                       for p in ("/metrics", "/healthz", "/readyz"))  # fmt: skip
    backends = {p["backend"]["service"]["port"]["name"] for rule in signed.get(
        "Ingress", "t-durable-streams")["spec"]["rules"] for p in rule["http"]["paths"]}  # fmt: skip
    assert backends == {"http"}


def test_probes_have_timeouts_and_the_archive_worker_is_checked_by_its_loop() -> None:
    """Probes had no timeouts and no startup probe; the archive worker's liveness was a TCP check
    on a metrics thread, so a hung worker stayed live."""
    rendered = render((), S3)
    (gateway,) = _pod(rendered, "gateway")["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gateway[probe]["timeoutSeconds"] >= 1, probe
    assert gateway["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    (worker,) = _pod(rendered, "archive")["containers"]
    assert "tcpSocket" not in worker["livenessProbe"]
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert worker["livenessProbe"]["timeoutSeconds"] >= 1
    settings = _settings(rendered)
    assert settings["DURABLE_STREAMS_ARCHIVE_STALL_SECONDS"] == "120"


def test_the_spark_job_reads_a_window_and_reaches_s3_compatible_stores() -> None:
    """The CronJob re-scanned the whole archive every run; s3:// became s3a:// without the
    endpoint of an S3-compatible store."""
    rendered = render((), {**REDIS, "archive.enabled": "true", "archive.url": "s3://b/p",
                           "archive.s3.endpoint": "http://minio:9000", "archive.s3.existingSecret": "s3",
                           "spark.enabled": "true"})  # fmt: skip
    (container,) = _cron_pod(rendered)["containers"]
    args = container["args"]
    assert args[:2] == ["--archive", "s3a://b/p"]
    assert args[args.index("--window") + 1] == "1h"
    assert container["image"].endswith(":0.1.0-spark")
    sources = [s.get("configMapRef", s.get("secretRef"))["name"] for s in container["envFrom"]]
    assert sources == ["t-durable-streams-settings", "s3"]
    assert _settings(rendered)["AWS_ENDPOINT_URL"] == "http://minio:9000"
    whole = render((), {**REDIS, "archive.enabled": "true", "archive.url": "s3://b/p",
                        "spark.enabled": "true", "spark.window": ""})  # fmt: skip
    assert "--window" not in _cron_pod(whole)["containers"][0]["args"]
    with pytest.raises(RenderError, match="spark.enabled reads the archive"):
        render((), {**REDIS, "spark.enabled": "true"})


# -- what the chart promises ----------------------------------------------------------------------


def test_pods_spread_and_are_locked_down() -> None:
    rendered = render((), S3)
    for component in ("gateway", "archive", "deliver"):
        pod = _pod(rendered, component)
        assert pod["automountServiceAccountToken"] is False
        term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        labels = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert labels["app.kubernetes.io/component"] == component
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
        assert pod["securityContext"]["runAsNonRoot"]
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"]
    own = render((), {**REDIS, "gateway.affinity.nodeAffinity.x": "y", "spreadPods": "false"})
    assert _pod(own, "gateway")["affinity"] == {"nodeAffinity": {"x": "y"}}
    assert "topologySpreadConstraints" not in _pod(own, "gateway")
    gateway = VALUES["gateway"]
    drain = gateway["preStopSleepSeconds"] + gateway["shutdownDelaySeconds"] + gateway["shutdownSeconds"]
    assert gateway["terminationGracePeriodSeconds"] > drain
    live = max(gateway["sseCycleSeconds"], gateway["longPollTimeoutSeconds"])
    assert VALUES["ingress"]["timeoutSeconds"] > live


def test_a_stopping_gateway_leaves_the_ingress_before_it_stops_listening() -> None:
    """Rolling updates leaked 502s: a gateway closed keep-alive connections the ingress was still
    reusing. On SIGTERM it now serves on, not ready, for shutdownDelaySeconds: the chart passes
    it, the readiness probe fails within it, and SIGKILL waits for the delay and the drain."""
    rendered = render((), REDIS)
    pod = _pod(rendered, "gateway")
    (gateway,) = pod["containers"]
    settings = _settings(rendered)
    delay = float(settings["DURABLE_STREAMS_SHUTDOWN_DELAY_SECONDS"])
    assert delay == Settings().shutdown_delay_seconds  # the chart and `serve` agree
    probe = gateway["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= delay
    assert probe["timeoutSeconds"] <= probe["periodSeconds"]
    assert "lifecycle" not in gateway  # no preStop sleep on top of the delay
    assert pod["terminationGracePeriodSeconds"] > delay + float(settings["DURABLE_STREAMS_SHUTDOWN_SECONDS"])
    slept = render((), {**REDIS, "gateway.preStopSleepSeconds": "3"})
    (container,) = _pod(slept, "gateway")["containers"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "3"]
    with pytest.raises(RenderError, match="terminationGracePeriodSeconds must exceed"):
        render((), {**REDIS, "gateway.shutdownDelaySeconds": "20"})  # 20 + 30 s of drain > 45
    with pytest.raises(RenderError, match="must cover readinessProbe"):
        render((), {**REDIS, "gateway.readinessProbe.periodSeconds": "10"})  # 10 x 2 > 5
    render((), {**REDIS, "gateway.readinessProbe.periodSeconds": "10", "gateway.preStopSleepSeconds": "15",
                "gateway.terminationGracePeriodSeconds": "60"})  # fmt: skip


def test_admin_port_is_for_probes_and_metrics_and_never_routed() -> None:
    """/metrics, /healthz and /readyz answer 404 on the public port once gateway.adminPort is set:
    probes and the ServiceMonitor use the admin port; the Ingress and the public Service never."""
    rendered = render((), {**REDIS, "ingress.enabled": "true", "metrics.serviceMonitor.enabled": "true",
                           "archive.enabled": "true", "archive.url": "s3://b/p"})  # fmt: skip
    assert _gateway_probe_ports(rendered) == {"admin"}
    assert [p["name"] for p in rendered.get("Service", "t-durable-streams")["spec"]["ports"]] == ["http"]
    admin = rendered.get("Service", "t-durable-streams-admin")["spec"]
    assert admin["type"] == "ClusterIP" and admin["ports"][0]["targetPort"] == "admin"
    endpoints = rendered.get("ServiceMonitor", "t-durable-streams")["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} == {"admin", "metrics"}
    settings = _settings(rendered)
    assert settings["DURABLE_STREAMS_ADMIN_PORT"] == "9090"
    assert settings["DURABLE_STREAMS_TRUSTED_PROXY_HOPS"] == "1"
    assert settings["DURABLE_STREAMS_PUBLIC_URL"] == "http://streams.example.com"
    plain = render((), {**REDIS, "gateway.adminPort": "0"})
    assert _gateway_probe_ports(plain) == {"http"}
    with pytest.raises(KeyError):
        plain.get("Service", "t-durable-streams-admin")


def test_auth_files_are_mounted_where_the_settings_point() -> None:
    """Each DURABLE_STREAMS_AUTH_*_FILE names a file of a Secret volume mounted as a directory: a
    subPath mount would never see the Secret change (the token file is re-read on change)."""
    rendered = render([CASES / "auth.yaml"])
    settings = _settings(rendered)
    files = {k: v for k, v in settings.items() if re.fullmatch(r"DURABLE_STREAMS_AUTH_\w+_FILE", k)}
    assert set(files) == {"DURABLE_STREAMS_AUTH_TOKENS_FILE", "DURABLE_STREAMS_AUTH_JWT_KEY_FILE",
                          "DURABLE_STREAMS_AUTH_SIGNING_KEY_FILE"}  # fmt: skip
    pod = _pod(rendered, "gateway")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    for path in files.values():
        directory, _, name = path.rpartition("/")
        mount = mounts[directory]
        assert mount["readOnly"] and "subPath" not in mount
        assert name in {item["path"] for item in volumes[mount["name"]]["secret"]["items"]}
    assert "ACCESS CONTROL IS OFF" not in render([CASES / "auth.yaml"], notes=True).notes
    assert "ACCESS CONTROL IS OFF" in render((), REDIS, notes=True).notes


def test_network_policies() -> None:
    rendered = render((), {**REDIS, "networkPolicy.enabled": "true", "redis.enabled": "false",
                           "archive.enabled": "true", "archive.url": "s3://b/p"})  # fmt: skip
    gateway = rendered.get("NetworkPolicy", "t-durable-streams-gateway")["spec"]["ingress"]
    public, admin = gateway
    assert public["ports"] == [{"port": "http"}] and "from" not in public
    assert admin["ports"] == [{"port": "admin"}] and admin["from"] == [{"podSelector": {}}]
    assert rendered.get("NetworkPolicy", "t-durable-streams-gateway")["spec"]["policyTypes"] == ["Ingress"]
    bundled = render((), {"redis.enabled": "true", "networkPolicy.enabled": "true"})
    (rule,) = bundled.get("NetworkPolicy", "t-durable-streams-redis")["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "t"
    assert not render((), REDIS).of_kind("NetworkPolicy")


def test_delivery_workers_reach_dns_redis_and_public_https_only() -> None:
    """The one component whose egress is restricted: it calls URLs subscribers chose."""
    rendered = render((), {**REDIS, "networkPolicy.enabled": "true"})
    spec = rendered.get("NetworkPolicy", "t-durable-streams-deliver")["spec"]
    assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "deliver"
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    (metrics,) = spec["ingress"]
    assert metrics == {"ports": [{"port": "metrics"}], "from": [{"podSelector": {}}]}
    dns, redis, webhooks = spec["egress"]
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    assert redis == {"ports": [{"port": 6379, "protocol": "TCP"}]}
    assert webhooks["ports"] == [{"port": 443, "protocol": "TCP"}]
    v4, v6 = (peer["ipBlock"] for peer in webhooks["to"])
    assert v4["cidr"] == "0.0.0.0/0" and v6["cidr"] == "::/0"
    for private in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "127.0.0.0/8"):
        assert private in v4["except"], private
    assert {"fc00::/7", "fe80::/10"} <= set(v6["except"]) and not any(":" in c for c in v4["except"])
    # the Redis port follows the URL; the chart's own Redis is reached by pod
    tls = render([CASES / "admin-port-off.yaml"]).get("NetworkPolicy", "t-durable-streams-deliver")
    assert tls["spec"]["egress"][1] == {"ports": [{"port": 6380, "protocol": "TCP"}]}
    bundled = render((), {"redis.enabled": "true", "networkPolicy.enabled": "true"})
    redis = bundled.get("NetworkPolicy", "t-durable-streams-deliver")["spec"]["egress"][1]
    assert redis["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    # what the values say: Redis' subnet and ports, more webhook ports, an in-cluster receiver
    custom = render([CASES / "subscriptions.yaml"]).get("NetworkPolicy", "t-durable-streams-deliver")["spec"]
    _, redis, webhooks, receiver = custom["egress"]
    assert redis["to"] == [{"ipBlock": {"cidr": "10.0.5.0/24"}}]
    assert [p["port"] for p in redis["ports"]] == [6379, 6380]
    assert [p["port"] for p in webhooks["ports"]] == [443, 8443]
    assert receiver["ports"] == [{"port": 8080}]
    # no workers, no policy for them; the gateways' egress stays open
    off = render((), {**REDIS, "networkPolicy.enabled": "true", "deliver.enabled": "false"})
    with pytest.raises(KeyError):
        off.get("NetworkPolicy", "t-durable-streams-deliver")
    notes = render((), {**REDIS, "networkPolicy.enabled": "true"},
                   set_string={"deliver.webhookAllow": "*.svc.cluster.local"}, notes=True).notes  # fmt: skip
    assert "networkPolicy.deliverEgress.extra" in notes


def test_delivery_workers_run_by_default() -> None:
    """Subscriptions are part of the protocol: a release without delivery workers would accept
    them and never deliver. Workers run `durable-streams deliver` with the settings ConfigMap,
    the Redis URL, their own metrics port (the liveness probe's /healthz), and no volume."""
    rendered = render((), {**S3, "archive.s3.existingSecret": "s3"})
    deployment = rendered.get("Deployment", "t-durable-streams-deliver")
    assert deployment["spec"]["replicas"] == VALUES["deliver"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["deliver"] and "command" not in container
    assert container["image"] == _pod(rendered, "gateway")["containers"][0]["image"]
    env = {e["name"]: e for e in container["env"]}
    redis_url = env["DURABLE_STREAMS_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert redis_url["name"] == "t-durable-streams-redis-url"
    assert env["DURABLE_STREAMS_METRICS_PORT"]["value"] == "9465"
    assert "DURABLE_STREAMS_WEBHOOK_SIGNING_KEY_FILE" not in env  # the key is then kept in Redis
    # the settings, and not the archive's S3 credentials: the workers never touch the archive
    assert container["envFrom"] == [{"configMapRef": {"name": "t-durable-streams-settings"}}]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9465}]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"} and probe["timeoutSeconds"] >= 1
    assert {v["name"] for v in pod["volumes"]} == {"tmp"}
    assert container["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    service = rendered.get("Service", "t-durable-streams-deliver-metrics")["spec"]
    assert service["ports"] == [{"name": "metrics", "port": 9465, "targetPort": "metrics"}]
    assert service["selector"]["app.kubernetes.io/component"] == "deliver"
    # their settings; each worker's metrics port is its own (not one for both in the ConfigMap)
    settings = _settings(rendered)
    assert settings["DURABLE_STREAMS_WEBHOOK_TIMEOUT"] == "10"
    assert settings["DURABLE_STREAMS_WEBHOOK_CONCURRENCY"] == "256"
    assert settings["DURABLE_STREAMS_DELIVER_POLL_SECONDS"] == "0.1"
    assert settings["DURABLE_STREAMS_DELIVER_SWEEP_SECONDS"] == "5"
    assert settings["DURABLE_STREAMS_SUBSCRIPTION_MAX_STREAMS"] == "1000"
    assert "DURABLE_STREAMS_WEBHOOK_ALLOW" not in settings and "DURABLE_STREAMS_METRICS_PORT" not in settings
    archive_env = {e["name"]: e.get("value") for e in _pod(rendered, "archive")["containers"][0]["env"]}
    assert archive_env["DURABLE_STREAMS_METRICS_PORT"] == "9464"
    # every setting a worker is given is one `durable-streams deliver` reads
    deliver_reads = {env_name(n) for n in taken_by("deliver")}
    assert {n for n in env if n.startswith("DURABLE_STREAMS_")} <= deliver_reads
    assert {"DURABLE_STREAMS_WEBHOOK_TIMEOUT", "DURABLE_STREAMS_WEBHOOK_CONCURRENCY",
            "DURABLE_STREAMS_DELIVER_POLL_SECONDS", "DURABLE_STREAMS_DELIVER_SWEEP_SECONDS",
            "DURABLE_STREAMS_REDIS_TIMEOUT"} <= deliver_reads & set(settings)  # fmt: skip
    # scraped with the archive workers by one endpoint (both ports are named "metrics")
    monitored = render((), {**REDIS, "metrics.serviceMonitor.enabled": "true"})
    ports = [e["port"] for e in monitored.get("ServiceMonitor", "t-durable-streams")["spec"]["endpoints"]]
    assert sorted(ports) == ["admin", "metrics"]
    both = render((), {**S3, "metrics.serviceMonitor.enabled": "true"})
    assert [e["port"] for e in both.get("ServiceMonitor", "t-durable-streams")["spec"]["endpoints"]].count(
        "metrics") == 1  # fmt: skip
    notes = render((), REDIS, notes=True).notes
    assert "Subscriptions: 1 delivery worker (durable-streams deliver)" in notes
    assert "/v1/stream/__ds/jwks.json" in notes and ":9465/metrics on the delivery workers" in notes
    # what the values say reaches them
    custom = render([CASES / "subscriptions.yaml"])
    assert custom.get("Deployment", "t-durable-streams-deliver")["spec"]["replicas"] == 3
    settings = _settings(custom)
    assert settings["DURABLE_STREAMS_WEBHOOK_TIMEOUT"] == "5"
    assert settings["DURABLE_STREAMS_WEBHOOK_CONCURRENCY"] == "64"
    assert settings["DURABLE_STREAMS_DELIVER_SWEEP_SECONDS"] == "2.5"
    assert settings["DURABLE_STREAMS_SUBSCRIPTION_MAX_STREAMS"] == "200"
    extra = {e["name"]: e.get("value") for e in _pod(custom, "deliver")["containers"][0]["env"]}
    assert extra["DURABLE_STREAMS_LOG_LEVEL"] == "debug"
    # refused as Helm would refuse them (the schema)
    for key, bad in (("webhookConcurrency", "-1"), ("replicas", "0"), ("metricsPort", "0")):
        with pytest.raises(RenderError, match="schema"):
            render((), {**REDIS, f"deliver.{key}": bad})


def test_without_delivery_workers_nothing_of_theirs_is_rendered() -> None:
    sets = {**REDIS, "deliver.enabled": "false", "networkPolicy.enabled": "true",
            "metrics.serviceMonitor.enabled": "true"}  # fmt: skip
    key = {"deliver.signingKey.value": "-----BEGIN PRIVATE KEY-----"}
    rendered = render((), sets, set_string=key, notes=True)
    names = {d["metadata"]["name"] for d in rendered.docs}
    assert not {n for n in names if "deliver" in n or "webhook" in n}, sorted(names)
    assert [d["metadata"]["name"] for d in rendered.of_kind("Deployment")] == ["t-durable-streams-gateway"]
    endpoints = rendered.get("ServiceMonitor", "t-durable-streams")["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == ["admin"]
    assert "NO DELIVERY WORKERS" in rendered.notes
    # gateways still serve the subscription APIs, with their settings
    assert _settings(rendered)["DURABLE_STREAMS_SUBSCRIPTION_MAX_STREAMS"] == "1000"


def test_the_webhook_signing_key_is_mounted_in_delivery_workers_only() -> None:
    """DURABLE_STREAMS_WEBHOOK_SIGNING_KEY_FILE names a file of a Secret volume (a directory, not
    subPath) of the delivery workers; no other pod mounts that Secret or names the file."""
    pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n"
    cases = {
        "ds-webhook-key": render([CASES / "subscriptions.yaml"]),
        "t-durable-streams-webhook-signing-key": render((), {**S3, "auth.signingKey.value": "k" * 32},
                                                        set_string={"deliver.signingKey.value": pem}),
    }  # fmt: skip
    for secret, rendered in cases.items():
        pod = _pod(rendered, "deliver")
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        path = env["DURABLE_STREAMS_WEBHOOK_SIGNING_KEY_FILE"]
        directory, _, name = path.rpartition("/")
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
        assert mount["readOnly"] and "subPath" not in mount
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == secret
        (item,) = volume["secret"]["items"]
        assert item["path"] == name
        assert item["key"] == ("ed25519.pem" if secret == "ds-webhook-key" else "signing-key.pem")
        for other in _pod_specs(rendered):
            if other is pod:
                continue
            secrets = {v["secret"]["secretName"] for v in other.get("volumes", []) if "secret" in v}
            assert secret not in secrets, other["containers"][0]["name"]
            for c in other["containers"]:
                assert "DURABLE_STREAMS_WEBHOOK_SIGNING_KEY_FILE" not in {e["name"] for e in c.get("env", [])}
        assert "DURABLE_STREAMS_WEBHOOK_SIGNING_KEY_FILE" not in _settings(rendered)
    # inline: a Secret of its own (never the gateways' auth Secret), and the pods roll when it changes
    inline = cases["t-durable-streams-webhook-signing-key"]
    key_secret = inline.get("Secret", "t-durable-streams-webhook-signing-key")
    assert key_secret["stringData"] == {"signing-key.pem": pem}
    assert "signing-key.pem" not in inline.get("Secret", "t-durable-streams-auth")["stringData"]
    template = inline.get("Deployment", "t-durable-streams-deliver")["spec"]["template"]
    assert "checksum/webhook-signing-key" in template["metadata"]["annotations"]
    assert "checksum/webhook-signing-key" not in _template(inline, "gateway")["metadata"]["annotations"]
    # a Secret of yours wins over the inline key; without either, nothing is mounted
    both = render([CASES / "subscriptions.yaml"], set_string={"deliver.signingKey.value": pem})
    assert not [d for d in both.of_kind("Secret") if "webhook" in d["metadata"]["name"]]
    assert _pod(both, "deliver")["volumes"][1]["secret"]["secretName"] == "ds-webhook-key"
    assert "the key in Secret ds-webhook-key" in render([CASES / "subscriptions.yaml"], notes=True).notes


def test_webhook_allow_reaches_gateways_and_delivery_workers() -> None:
    """Gateways check it when a subscription is created, workers at every delivery: the same value,
    from the settings ConfigMap, overridden in neither pod (gateways get it without workers too)."""
    allow = "10.20.0.0/16, *.svc.cluster.local"
    for components, sets in ((("gateway", "deliver"), {}), (("gateway",), {"deliver.enabled": "false"})):
        rendered = render([CASES / "subscriptions.yaml"], sets)
        assert _settings(rendered)["DURABLE_STREAMS_WEBHOOK_ALLOW"] == allow
        for component in components:
            (container,) = _pod(rendered, component)["containers"]
            assert {"configMapRef": {"name": "t-durable-streams-settings"}} in container["envFrom"], component
            assert "DURABLE_STREAMS_WEBHOOK_ALLOW" not in {e["name"] for e in container["env"]}, component
    # blank: unset (the strict rules) for both
    blank = render((), REDIS, set_string={"deliver.webhookAllow": " "})
    assert "DURABLE_STREAMS_WEBHOOK_ALLOW" not in _settings(blank)


def test_helm_test_checks_a_stream_through_the_service() -> None:
    rendered = render((), REDIS)
    pod = rendered.get("Pod", "t-durable-streams-check")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    args = pod["spec"]["containers"][0]["args"]
    assert args[:3] == ["check", "--url", "http://t-durable-streams:80/v1/stream"]
    assert "--allow-refusal" not in args
    refused = render([CASES / "auth.yaml"]).get("Pod", "t-durable-streams-check")["spec"]["containers"][0]
    assert "--allow-refusal" in refused["args"]
    with_token = render((), {**REDIS, "auth.anonymous": "read:public/", "tests.tokenSecret": "ds-check"})
    check = with_token.get("Pod", "t-durable-streams-check")["spec"]
    assert "--token-file" in check["containers"][0]["args"]
    assert check["volumes"][0]["secret"]["secretName"] == "ds-check"
    assert not render((), {**REDIS, "tests.enabled": "false"}).of_kind("Pod")


def test_upgrades_migrate_the_key_layout_first() -> None:
    """`helm upgrade` runs `durable-streams migrate` with the new image before any pod changes
    (offline steps, or a rolling change's expand; never the switch, `migrate --finish`)."""
    job = render((), REDIS).get("Job", "t-durable-streams-migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert container["env"][0]["name"] == "DURABLE_STREAMS_REDIS_URL"
    assert not render((), {**REDIS, "migrations.enabled": "false"}).of_kind("Job")


def test_backups_run_on_a_schedule(tmp_path: Path) -> None:
    """backup.enabled: a CronJob runs `durable-streams backup` with the gateways' Redis and
    archive settings, each run into a new folder of backup.to named by its start time
    (docs/operations.md, "Backup and restore"); object storage is staged in a bounded /tmp."""
    assert not render((), S3).of_kind("CronJob")
    on = {"backup.enabled": "true", "backup.to": "s3://bucket/backups", "archive.s3.existingSecret": "s3"}
    rendered = render((), {**S3, **on})
    validate(rendered.docs)
    cron = rendered.get("CronJob", "t-durable-streams-backup")
    assert cron["metadata"]["labels"]["app.kubernetes.io/component"] == "backup"
    assert cron["spec"]["schedule"] == "0 2 * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    assert job["backoffLimit"] <= 1 and job["activeDeadlineSeconds"] == VALUES["backup"]["timeoutSeconds"]
    pod = _cron_pod(rendered, "backup")
    assert job["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "backup"
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    assert pod["securityContext"] == VALUES["podSecurityContext"]
    (container,) = pod["containers"]
    assert container["securityContext"] == VALUES["securityContext"]
    assert container["command"] == ["/bin/sh", "-c"]
    script, _name, *extra = container["args"]
    assert script == 'exec durable-streams backup --to "${BACKUP_TO%/}/$(date -u +%Y%m%dT%H%M%SZ)" "$@"'
    assert not extra
    env = {e["name"]: e for e in container["env"]}
    assert env["BACKUP_TO"] == {"name": "BACKUP_TO", "value": "s3://bucket/backups"}
    (gateway,) = _pod(rendered, "gateway")["containers"]
    redis_url = env["DURABLE_STREAMS_REDIS_URL"]
    assert redis_url == next(e for e in gateway["env"] if e["name"] == "DURABLE_STREAMS_REDIS_URL")
    assert redis_url["valueFrom"]["secretKeyRef"]["name"] == "t-durable-streams-redis-url"
    assert container["envFrom"] == gateway["envFrom"]
    sources = [s.get("configMapRef", s.get("secretRef"))["name"] for s in container["envFrom"]]
    assert sources == ["t-durable-streams-settings", "s3"]
    assert _settings(rendered)["DURABLE_STREAMS_ARCHIVE_URL"] == "s3://b/p"
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {"tmp": "/tmp"}
    (tmp,) = pod["volumes"]
    assert tmp == {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}}
    limited = render((), {**S3, **on, "backup.stagingSizeLimit": "200Gi", "backup.schedule": "30 3 * * 0"})
    assert _cron_pod(limited, "backup")["volumes"][0]["emptyDir"] == {"sizeLimit": "200Gi"}
    assert limited.get("CronJob", "t-durable-streams-backup")["spec"]["schedule"] == "30 3 * * 0"

    # the script, as the pod's shell runs it: a new folder named by the start time, the location
    # never read as shell text, backup.extraArgs after it
    args = render((), {**S3, **on, "backup.extraArgs[0]": "--log-level", "backup.extraArgs[1]": "debug"})
    (container,) = _cron_pod(args, "backup")["containers"]
    assert container["args"][2:] == ["--log-level", "debug"]
    fake = tmp_path / "durable-streams"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    for to, folder in (
        ("s3://bucket/backups/", "s3://bucket/backups/"),
        ("/b/$(touch x) `touch y`", "/b/$(touch x) `touch y`/"),
    ):
        shell = {"PATH": f"{tmp_path}:/usr/bin:/bin", "BACKUP_TO": to}
        command = [*container["command"], *container["args"]]
        run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=shell, check=True)
        argv = run.stdout.splitlines()
        assert argv[:2] == ["backup", "--to"] and argv[3:] == ["--log-level", "debug"]
        assert argv[2].startswith(folder) and re.fullmatch(r"\d{8}T\d{6}Z", argv[2][len(folder) :]), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["durable-streams"]

    # a directory: on a claim of yours, else refused
    enabled, claim = {**REDIS, "backup.enabled": "true"}, {"backup.volume.existingClaim": "ds-backups"}
    with pytest.raises(RenderError, match="backup.enabled needs backup.to"):
        render((), enabled)
    with pytest.raises(RenderError, match="is a local directory: it needs backup.volume.existingClaim"):
        render((), {**enabled, "backup.to": "/backups/streams"})
    with pytest.raises(RenderError, match="must be backup.volume.mountPath"):
        render((), {**enabled, **claim, "backup.to": "/data/streams"})
    on_claim = {"backup.enabled": "true", "backup.to": "/backups/streams", **claim}
    local = render([CHART / "examples" / "laptop.yaml"], on_claim)
    validate(local.docs)
    pod = _cron_pod(local, "backup")
    (container,) = pod["containers"]
    assert {e["name"]: e.get("value") for e in container["env"]}["BACKUP_TO"] == "/backups/streams"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["backups"]["mountPath"] == "/backups" and not mounts["backups"].get("readOnly")
    assert mounts["archive"] == {"name": "archive", "mountPath": "/archive", "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["backups"]["persistentVolumeClaim"] == {"claimName": "ds-backups"}
    assert volumes["archive"]["persistentVolumeClaim"]["readOnly"] is True
    # the laptop's archive volume is ReadWriteOnce: the backup goes to the node that has it
    assert pod["affinity"] == _pod(local, "archive")["affinity"]


def test_a_redis_cluster_with_replica_acks_reaches_every_command() -> None:
    """externalRedis.cluster and minReplicasAck become the settings of gateways, workers
    and the migrate hook; the chart's own single Redis refuses them."""
    rendered = render([CASES / "redis-cluster.yaml"])
    data = rendered.get("ConfigMap", "t-durable-streams-settings")["data"]
    assert data["DURABLE_STREAMS_REDIS_CLUSTER"] == "true"
    assert data["DURABLE_STREAMS_MIN_REPLICAS_ACK"] == "1"
    assert data["DURABLE_STREAMS_MIN_REPLICAS_ACK_TIMEOUT"] == "0.5"
    job = rendered.get("Job", "t-durable-streams-migrate")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DURABLE_STREAMS_REDIS_CLUSTER"] == "true"
    for wrong in (
        {"redis.enabled": "true", "externalRedis.cluster": "true"},
        {"redis.enabled": "true", "minReplicasAck": "1"},
    ):
        with pytest.raises(RenderError, match="external Redis"):
            render((), wrong)


def test_image_digests_pin_images() -> None:
    digest = "sha256:" + "ab" * 32
    rendered = render((), {**REDIS, "image.digest": digest})
    assert _pod(rendered, "gateway")["containers"][0]["image"].endswith("@" + digest)
    with pytest.raises(RenderError):
        render((), {**REDIS, "image.digest": "latest"})


def test_what_a_review_for_real_clusters_found() -> None:
    """What schema validation cannot see: each of these broke an install, an upgrade or helm test."""
    # helm test's pod passes the NetworkPolicy that admits only the ingress controller
    production = render([CHART / "examples" / "production.yaml"])
    public = production.get("NetworkPolicy", "t-durable-streams-gateway")["spec"]["ingress"][0]
    check = production.get("Pod", "t-durable-streams-check")["metadata"]["labels"]
    assert any(peer.get("podSelector", {}).get("matchLabels", {}).items() <= check.items()
               and peer.get("podSelector") for peer in public["from"])  # fmt: skip
    # the Spark image follows image.repository/tag; private registries reach every pod
    (spark,) = _cron_pod(production)["containers"]
    assert spark["image"] == "registry.example.com/durable-streams:0.1.0-spark"
    secrets = render((), {"redis.enabled": "true", "archive.enabled": "true", "archive.url": "s3://b/p",
                          "spark.enabled": "true", "imagePullSecrets[0].name": "regcred"})  # fmt: skip
    for pod in _pod_specs(secrets):
        assert pod.get("imagePullSecrets") == [{"name": "regcred"}], pod["containers"][0]["name"]
        assert pod.get("automountServiceAccountToken") is False, pod["containers"][0]["name"]
    # the migration hook needs nothing a previous release may lack
    hooks = render((), REDIS)
    job = hooks.get("Job", "t-durable-streams-migrate")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in job
    url = job["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    secret = hooks.get("Secret", url["name"])
    assert secret["metadata"]["annotations"]["helm.sh/hook"] == "pre-upgrade"
    assert secret["stringData"][url["key"]] == REDIS["externalRedis.url"]
    # a root prefix still makes a valid Ingress path
    root = render((), {**REDIS, "ingress.enabled": "true", "gateway.prefix": "/"})
    assert _ingress_paths(root) == [("/", "Prefix")]
    # a ReadWriteOnce archive volume: every pod that mounts it on one node, not spread apart
    laptop = render([CHART / "examples" / "laptop.yaml"])
    for component in ("gateway", "archive"):
        pod = _pod(laptop, component)
        assert "podAntiAffinity" not in pod["affinity"] and "topologySpreadConstraints" not in pod
        (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
    # ... but the delivery workers, which mount no volume, are free to go anywhere
    deliver = _pod(laptop, "deliver")
    assert "podAffinity" not in deliver["affinity"] and {v["name"] for v in deliver["volumes"]} == {"tmp"}
    # the bundled Redis: what the gateways rely on comes after redis.extraConfig
    extra = "maxmemory 0\nport 7000\nprotected-mode yes\nappendonly no"
    conf = render((), {"redis.enabled": "true"}, set_string={"redis.extraConfig": extra})
    last = _redis_conf(conf)
    assert last["maxmemory"] == "1536mb" and last["port"] == "6379" and last["protected-mode"] == "no"
    assert last["appendonly"] == "yes"
    # a budget that forbids every drain is refused; a shared volume without the archive is unused
    with pytest.raises(RenderError, match="minAvailable must be below"):
        render((), {**REDIS, "gateway.autoscaling.enabled": "false", "gateway.replicas": "1"})
    with pytest.raises(RenderError, match="stallSeconds must exceed two lease renewals"):
        render((), {**S3, "archive.leaseSeconds": "600"})
    unused = render((), {**REDIS, "archive.sharedVolume.enabled": "true"})
    assert "DURABLE_STREAMS_ARCHIVE_URL" not in _settings(unused)


# -- values, schema, settings ---------------------------------------------------------------------


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
                   {"rateLimits": "write=100/s"}, {"rateLimits": "read:=10/day"},
                   {"redis": {"enabled": True, "maxmemory": "lots"}}, {"logging": {"format": "xml"}},
                   {"spark": {"window": "yesterday"}}, {"tests": {"path": "/abs"}},
                   {"backup": {"to": "backups"}}, {"backup": {"stagingSizeLimit": "lots"}},
                   {"backup": {"volume": {"mountPath": "backups"}}}, {"backup": {"enabled": "yes"}},
                   {"archive": {"sharedVolume": {"accessModes": ["ReadWriteSometimes"]}}},
                   {"deliver": {"webhookConcurrency": -1}}, {"deliver": {"webhookConcurrency": 0}},
                   {"deliver": {"webhookConcurrency": 2.5}}, {"deliver": {"replicas": 0}},
                   {"deliver": {"webhookTimeoutSeconds": 0}}, {"deliver": {"webhookTimeoutSeconds": "10s"}},
                   {"deliver": {"pollSeconds": -1}}, {"deliver": {"metricsPort": 70000}},
                   {"deliver": {"enabled": "yes"}}, {"deliver": {"webhookAllow": ["10.0.0.0/8"]}},
                   {"deliver": {"webhookAllow": "https://hooks.example.com"}},
                   {"deliver": {"webhookAllow": "10.0.0.0/8; rm -rf"}},
                   {"deliver": {"signingKey": {"value": "not a PEM key"}}},
                   {"deliver": {"signingKey": {"value": "-----BEGIN OPENSSH PRIVATE KEY-----"}}},
                   {"deliver": {"signingKey": {"existingSecret": "Not_A_Name"}}},
                   {"deliver": {"signingKey": {"secret": "ds-webhook-key"}}}, {"deliver": {"workers": 2}},
                   {"gateway": {"subscriptionMaxStreams": 0}},
                   {"networkPolicy": {"deliverEgress": {"webhookPorts": []}}},
                   {"networkPolicy": {"deliverEgress": {"webhookPorts": [0]}}},
                   {"networkPolicy": {"deliverEgress": {"webhookExcept": ["10.0.0.0"]}}},
                   {"networkPolicy": {"deliverEgress": {"redisPorts": ["redis"]}}}):  # fmt: skip
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
                 {"rateLimits": "write:=100/s+200 read:chat/=50/s anonymous:read:=0.5/min"},
                 {"global": {"imageRegistry": "r.example.com"}},
                 {"deliver": {**VALUES["deliver"], "enabled": False, "replicas": 4, "webhookConcurrency": 1,
                              "webhookAllow": "127.0.0.0/8, localhost,*.svc.cluster.local, ::1, fd00::/8",
                              "signingKey": {"existingSecret": "ds-webhook-key",
                                             "existingSecretKey": "ed25519.pem",
                                             "value": "-----BEGIN PRIVATE KEY-----\nMC4C\n"}}},
                 {"networkPolicy": {**VALUES["networkPolicy"], "deliverEgress": {
                     "webhookPorts": [443, 8443], "webhookExcept": ["10.0.0.0/8", "fd00::/8"],
                     "redisTo": [{"ipBlock": {"cidr": "10.0.5.0/24"}}], "redisPorts": [6380],
                     "extra": [{"ports": [{"port": 8080}]}]}}}):  # fmt: skip
        values = copy.deepcopy(VALUES)
        for key, child in fine.items():
            values[key] = {**values[key], **child} if isinstance(values.get(key), dict) else child
        jsonschema.validate(values, SCHEMA)


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
    assert set(SCHEMA["properties"]) - {"global"} == set(VALUES), (
        "the schema and values.yaml list different top-level keys"
    )


def test_environment_variables_are_real_settings() -> None:
    settings = {env_name(f.name) for f in fields(Settings)}
    used = {m for text in TEMPLATES.values() for m in re.findall(r"\b(DURABLE_STREAMS_[A-Z_]+)\b", text)}
    assert used and used <= settings, sorted(used - settings)


# -- helpers --------------------------------------------------------------------------------------


def _pod(rendered: Rendered, component: str) -> dict:
    return _template(rendered, component)["spec"]


def _template(rendered: Rendered, component: str) -> dict:
    return rendered.get("Deployment", f"t-durable-streams-{component}")["spec"]["template"]


def _redis_conf(rendered: Rendered, name: str = "t-durable-streams-redis") -> dict[str, str]:
    """The bundled Redis' settings as Redis reads redis.conf: the last line of a key wins."""
    text = rendered.get("ConfigMap", name)["data"]["redis.conf"]
    lines = [line.split(None, 1) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {key: value for key, value in lines}


def _pod_specs(rendered: Rendered) -> list[dict]:
    """Every pod template: Deployments, StatefulSets, Jobs, CronJobs, bare Pods."""
    pods = []
    for doc in rendered.docs:
        spec = doc.get("spec", {})
        if doc["kind"] == "Pod":
            pods.append(spec)
        elif doc["kind"] == "CronJob":
            pods.append(spec["jobTemplate"]["spec"]["template"]["spec"])
        elif "template" in spec:
            pods.append(spec["template"]["spec"])
    return pods


def _settings(rendered: Rendered) -> dict[str, str]:
    return rendered.get("ConfigMap", "t-durable-streams-settings")["data"]


def _cron_pod(rendered: Rendered, component: str = "analytics") -> dict:
    return rendered.get("CronJob", f"t-durable-streams-{component}")["spec"]["jobTemplate"]["spec"][
        "template"
    ]["spec"]


def _gateway_probe_ports(rendered: Rendered) -> set[object]:
    (container,) = _pod(rendered, "gateway")["containers"]
    return {container[p]["httpGet"]["port"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}


def _ingress_paths(rendered: Rendered) -> list[tuple[str, str]]:
    (rule,) = rendered.get("Ingress", "t-durable-streams")["spec"]["rules"]
    return [(p["path"], p["pathType"]) for p in rule["http"]["paths"]]


def test_tenants_reach_gateways_and_workers_and_refuse_a_cluster() -> None:
    on = render(
        (), {**REDIS, "tenants.enabled": "true", "tenants.paths": "public/=demo", "tenants.metricsTop": "5"}
    )
    settings = _settings(on)
    assert (settings["DURABLE_STREAMS_TENANTS"], settings["DURABLE_STREAMS_TENANT_PATHS"]) == (
        "true",
        "public/=demo",
    )
    assert (settings["DURABLE_STREAMS_TENANT_CLAIM"], settings["DURABLE_STREAMS_TENANT_METRICS_TOP"]) == (
        "tenant",
        "5",
    )
    assert "DURABLE_STREAMS_TENANT_PATHS" not in _settings(render((), REDIS))
    with pytest.raises(RenderError, match="tenants.enabled needs one Redis primary"):
        render((), {**REDIS, "tenants.enabled": "true", "externalRedis.cluster": "true"})
    with pytest.raises(RenderError):
        render((), {**REDIS, "tenants.paths": "public/=no:colons"})  # the schema's rule
