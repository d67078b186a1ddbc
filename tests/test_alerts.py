"""The chart's alerts (templates/prometheusrule.yaml), rendered as an install renders them and
run by Prometheus' own rule engine (`promtool test rules`, Debian's `prometheus` package) on
synthetic series: each alert fires when it should, and not otherwise."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .chart import ROOT, render

VALUES = ROOT / "tests" / "chart_values" / "observability.yaml"
DOCS = ROOT / "docs" / "alerts.md"
RUNBOOK = "https://streams.example.com/docs/alerts.html"
POD = 'namespace="ds", pod="gw-1"'


def rules() -> dict:
    (rule,) = render([VALUES]).of_kind("PrometheusRule")
    return rule["spec"]


def alert_names() -> list[str]:
    return [r["alert"] for group in rules()["groups"] for r in group["rules"]]


def series(name: str, values: str) -> dict[str, str]:
    return {"series": name, "values": values}


def fires(alert: str, at: str, labels: dict[str, str] | None = None) -> dict:
    return {"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": labels or {}}]}


def quiet(alert: str, at: str) -> dict:
    return {"eval_time": at, "alertname": alert, "exp_alerts": []}


def case(inputs: list[dict], *checks: dict) -> dict:
    return {"interval": "1m", "input_series": inputs, "alert_rule_test": list(checks)}


# One test per alert: the series that should fire it (and the times before it fires), and
# series beside them that must not (a healthy pod, a different error).
CASES = {
    "DurableStreamsRedisUnreachable": case(
        [
            series('ds_redis_errors_total{script="append", error="NotSent"}', "0+60x20"),
            series('ds_redis_errors_total{script="read", error="ResponseError"}', "0+600x20"),
        ],
        quiet("DurableStreamsRedisUnreachable", "1m"),
        fires("DurableStreamsRedisUnreachable", "5m", {"severity": "critical"}),
    ),
    "DurableStreamsFanoutDisconnected": case(
        [
            series(f"ds_pubsub_connected{{{POD}}}", "1 1 0 0 0 0 0 1 1 1"),
            series('ds_pubsub_connected{namespace="ds", pod="gw-2"}', "1x10"),
        ],  # fmt: skip
        quiet("DurableStreamsFanoutDisconnected", "2m"),
        fires(
            "DurableStreamsFanoutDisconnected",
            "4m",
            {"severity": "warning", "namespace": "ds", "pod": "gw-1"},
        ),
        quiet("DurableStreamsFanoutDisconnected", "9m"),
    ),
    "DurableStreamsNotDurable": case(
        [series('ds_redis_durable{pod="gw-1"}', "1x20"), series('ds_redis_durable{pod="gw-2"}', "0x20")],
        quiet("DurableStreamsNotDurable", "3m"),
        fires("DurableStreamsNotDurable", "10m", {"severity": "critical"}),
    ),
    "DurableStreamsRedisMemoryNearPause": case(
        [
            series('ds_redis_used_memory_bytes{node="r1:6379"}', "100+5x30"),  # 100 -> 250
            series('ds_write_pause_mark_bytes{node="r1:6379"}', "200x30"),
            series('ds_redis_used_memory_bytes{node="r2:6379"}', "50x30"),
            series('ds_write_pause_mark_bytes{node="r2:6379"}', "200x30"),
        ],
        quiet("DurableStreamsRedisMemoryNearPause", "20m"),  # past 90% at 17m: not yet for 10m
        fires("DurableStreamsRedisMemoryNearPause", "28m", {"severity": "warning", "node": "r1:6379"}),
    ),
    "DurableStreamsWritesPaused": case(
        [
            series('ds_write_backpressure{reason="memory", pod="gw-1"}', "0 0 1 1 1 1 1 0 0"),
            series('ds_write_backpressure{reason="archive_lag", pod="gw-1"}', "0x9"),
        ],  # fmt: skip
        quiet("DurableStreamsWritesPaused", "3m"),
        fires("DurableStreamsWritesPaused", "5m", {"severity": "critical", "reason": "memory"}),
        quiet("DurableStreamsWritesPaused", "8m"),
    ),
    "DurableStreamsArchiveLag": case(
        [  # by node (Redis primary), whichever worker reports it: two report the same numbers
            series('ds_archive_lag_seconds{pod="arc-1", node="r1:6379"}', "0+300x30"),  # grows 5 min a minute
            series('ds_archive_lag_seconds{pod="arc-2", node="r1:6379"}', "0+300x30"),
            series('ds_archive_lag_seconds{pod="arc-1", node="r2:6379"}', "0+10x30"),  # keeps up
            series('ds_archive_lag_seconds{pod="arc-2", node="r2:6379"}', "0+10x30"),
        ],
        quiet("DurableStreamsArchiveLag", "10m"),
        fires("DurableStreamsArchiveLag", "20m", {"severity": "warning", "node": "r1:6379"}),
    ),
    "DurableStreamsArchiveStalled": case(
        [
            series('ds_archive_due_streams{pod="arc-1"}', "5x60"),
            series('ds_archive_files_total{pod="arc-1"}', "0+1x10 10x50"),  # writes stop at 10m
        ],
        quiet("DurableStreamsArchiveStalled", "20m"),
        fires("DurableStreamsArchiveStalled", "45m", {"severity": "warning"}),
    ),
    "DurableStreamsCompactionBehind": case(
        [  # the last stream each worker compacted: one falls behind (5 min a minute), one keeps up
            series('ds_compaction_behind_seconds{pod="arc-1"}', "0+300x40"),
            series('ds_compaction_behind_seconds{pod="arc-2"}', "0x40"),
        ],
        quiet("DurableStreamsCompactionBehind", "10m"),  # past 1800 s at 7m: not yet for 15m
        fires("DurableStreamsCompactionBehind", "25m", {"severity": "warning"}),
    ),
    "DurableStreamsUsageMeterBehind": case(
        [  # both workers report the same hour: moved by neither from 20m on
            series('ds_meter_behind_seconds{pod="arc-1"}', "0x20 0+60x80"),
            series('ds_meter_behind_seconds{pod="arc-2"}', "0x20 0+60x80"),
        ],
        quiet("DurableStreamsUsageMeterBehind", "90m"),  # past 3600 s at 82m: not yet for 15m
        fires("DurableStreamsUsageMeterBehind", "100m", {"severity": "warning"}),
    ),
    "DurableStreamsWebhooksFailing": case(
        [
            series('ds_webhook_deliveries_total{outcome="done"}', "0+10x10 100+1x30"),
            series('ds_webhook_deliveries_total{outcome="failed"}', "0+1x10 10+20x30"),
        ],
        quiet("DurableStreamsWebhooksFailing", "10m"),
        fires("DurableStreamsWebhooksFailing", "35m", {"severity": "warning"}),
    ),
    "DurableStreamsWebhooksBacklog": case(
        [series('ds_subscriptions_due{pod="dlv-1"}', "10x5 5000x30")],
        quiet("DurableStreamsWebhooksBacklog", "10m"),
        fires("DurableStreamsWebhooksBacklog", "20m", {"severity": "warning"}),
    ),
    "DurableStreamsErrors": case(
        [
            series('ds_http_requests_total{route="stream", method="POST", status="204"}', "0+1000x30"),
            series(
                'ds_http_requests_total{route="stream", method="POST", status="503"}', "0+10x10 100+200x20"
            ),
        ],
        quiet("DurableStreamsErrors", "10m"),  # 1%
        fires("DurableStreamsErrors", "25m", {"severity": "critical"}),
    ),
    "DurableStreamsLiveConnectionsNearMax": case(
        [
            series(f'ds_live_connections{{{POD}, mode="sse"}}', "1000+100x30"),  # past 90% from 9m
            series(f'ds_live_connections{{{POD}, mode="long-poll"}}', "0x30"),
            series(f"ds_live_connections_max{{{POD}}}", "2000x30"),
            series('ds_live_connections{namespace="ds", pod="gw-2", mode="sse"}', "10x30"),
            series('ds_live_connections_max{namespace="ds", pod="gw-2"}', "2000x30"),
        ],
        quiet("DurableStreamsLiveConnectionsNearMax", "5m"),
        fires(
            "DurableStreamsLiveConnectionsNearMax",
            "20m",
            {"severity": "warning", "namespace": "ds", "pod": "gw-1"},
        ),
    ),
}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("needs promtool (Debian's prometheus package; .ci/run installs it)")
    return found


def test_every_alert_is_tested_and_has_a_runbook_section() -> None:
    names = alert_names()
    assert sorted(names) == sorted(CASES)
    runbook = DOCS.read_text()
    headings = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^## (.+)$", runbook, re.M)}
    for group in rules()["groups"]:
        for rule in group["rules"]:
            anchor = rule["alert"].lower()
            assert anchor in headings, f"docs/alerts.md has no section for {rule['alert']}"
            assert rule["annotations"]["runbook_url"] == f"{RUNBOOK}#{anchor}"
            assert rule["labels"]["severity"] in ("warning", "critical")


def test_rules_fire_when_they_should_and_not_otherwise(promtool: str, tmp_path: Path) -> None:
    spec = rules()
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    check = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr  # the annotations' templates too
    for group in spec["groups"]:  # the unit tests compare labels: annotations are checked above
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": list(CASES.values())}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_thresholds_come_from_the_values() -> None:
    rendered = render([VALUES], {"metrics.prometheusRule.archiveLagSeconds": 60})
    (rule,) = rendered.of_kind("PrometheusRule")
    lag = next(
        r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "DurableStreamsArchiveLag"
    )
    assert lag["expr"] == "max by (node) (ds_archive_lag_seconds) > 60"
    assert not render([], {"externalRedis.url": "redis://r:6379/0"}).of_kind(
        "PrometheusRule"
    )  # off by default
