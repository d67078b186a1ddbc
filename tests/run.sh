#!/usr/bin/env bash
# The test command: sets up what it needs, then lint (ruff, the import contracts,
# mypy), the manual (mkdocs build --strict), the official conformance suite, and
# pytest. Usage: bash tests/run.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv 2>/dev/null || true
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test,docs]"

step() { echo "== $* [$(date -u +%H:%M:%S)]"; }  # the time each step starts: the run's budget

step ruff
.venv/bin/ruff check gateway workers tests loadtest
step "import-linter (the layering contracts in pyproject.toml)"
.venv/bin/lint-imports
step "mypy"
.venv/bin/mypy
step "docs (mkdocs build --strict: docs/ into site/, the configuration reference generated from gateway/config.py)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict  # not --quiet: it hides the warnings strict counts

step "conformance suite (@durable-streams/server-conformance-tests)"
.venv/bin/python tests/conformance/run.py
step "conformance suite again: access control + rate limits on, archive worker at hot window 0 (reads from Parquet), bulk reads"
.venv/bin/python tests/conformance/run.py --archive --auth --rate-limits
step "conformance suite on a Redis Cluster (3 primaries, 3 replicas on loopback)"
.venv/bin/python tests/conformance/run.py --cluster
step "conformance suite on a Redis Cluster again: access control (no rate limits: appends on the fast path with credentials), archive worker at hot window 0"
.venv/bin/python tests/conformance/run.py --cluster --archive --auth

step "aiohttp-next (informative: the aiohttp seam's tests against aiohttp's newest release, past our pin)"
tools/aiohttp-next > .aiohttp-next.log 2>&1 && tail -1 .aiohttp-next.log \
  || { tail -20 .aiohttp-next.log; echo "WARNING: aiohttp's newest release breaks gateway/http/aiohttp_seam.py: fix it before raising the pin"; }

step "pytest"
.venv/bin/python -m pytest -rs --durations=20 "$@"   # -rs: say why anything was skipped (e.g. no helm); the slowest tests, for the run's budget
