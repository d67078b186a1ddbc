"""Seed, mode and run summary for the fault suite (see ``tests/faults/__init__.py``).

``DS_FAULT_SEED=<n>`` replays a run's fault schedule and workload choices;
without it a fresh seed is drawn and printed. ``DS_FAULT_SOAK=1`` selects the
long soak mode. At the end of the session one summary line is printed and the
same figures are written as JSON to pytest's temporary directory.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

SEED = int(os.environ.get("DS_FAULT_SEED") or random.SystemRandom().randrange(2**32))
SOAK = os.environ.get("DS_FAULT_SOAK", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Summary:
    seed: int = SEED
    mode: str = "soak" if SOAK else "ci"
    operations: int = 0  # logical appends by the workload
    attempts: int = 0  # HTTP requests for them (retries included)
    acknowledged: int = 0
    unknown: int = 0
    failed: int = 0
    lost: int = 0  # acknowledged but absent
    duplicated: int = 0  # present more than once
    reads: int = 0  # live-read requests and SSE connections
    faults: Counter[str] = field(default_factory=Counter)
    bad_inputs: int = 0  # malformed requests sent by the battery
    bad_input_5xx: int = 0
    legit_during_battery: int = 0
    violations: int = 0
    tests: dict[str, str] = field(default_factory=dict)  # test -> "passed"/"failed"
    seconds: float = 0.0
    json_path: str = ""

    def line(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"fault suite [{self.mode}, seed {self.seed}]: {self.operations:,} operations "
            f"({self.attempts:,} requests), {self.acknowledged:,} acknowledged, {self.unknown:,} unknown, "
            f"{self.failed:,} refused; {self.reads:,} live reads; faults injected: {faults}; "
            f"bad inputs tried: {self.bad_inputs:,} ({self.bad_input_5xx} answered 5xx); "
            f"lost: {self.lost}, duplicated: {self.duplicated}; violations: {self.violations}"
        )


SUMMARY = Summary()
_started = time.monotonic()


@pytest.fixture(scope="session")
def fault_seed() -> int:
    return SEED


@pytest.fixture(scope="session")
def soak() -> bool:
    return SOAK


@pytest.fixture(scope="session", autouse=True)
def summary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Summary]:
    SUMMARY.json_path = str(tmp_path_factory.getbasetemp() / "fault-summary.json")
    yield SUMMARY


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests/faults/" not in report.nodeid.replace("\\", "/"):
        return
    if report.when == "call" or report.outcome != "passed":
        SUMMARY.tests[report.nodeid.split("::")[-1]] = report.outcome


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("tests/faults/" in item.nodeid for item in session.items):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"fault suite seed: {SEED} (replay with DS_FAULT_SEED={SEED}); mode: {SUMMARY.mode}"
            )


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not SUMMARY.tests:
        return
    SUMMARY.seconds = round(time.monotonic() - _started, 1)
    path = Path(SUMMARY.json_path) if SUMMARY.json_path else None
    if path is not None:
        data = asdict(SUMMARY)
        data["faults"] = dict(SUMMARY.faults)
        data["line"] = SUMMARY.line()
        path.write_text(json.dumps(data, indent=2) + "\n")
    terminalreporter.write_sep("-", "fault suite summary")
    terminalreporter.write_line(SUMMARY.line())
    if path is not None:
        terminalreporter.write_line(f"fault suite summary JSON: {path}")
