#!/usr/bin/env bash
# The test command: sets up .venv (idempotent) and runs the whole suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The session's test cluster listens on loopback only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray's local-only
# mode, set before any test imports ray; tests/ray/conftest.py checks it), so Ray's token auth is off for
# it (README, Security). specserve serve, and tests/ray/test_sockets.py's launch of it, use token auth.
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q -rs -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
# The whole suite: tests/unit (no Ray, one torch thread per process) on every core, then the rest one test
# at a time (tests/ray share one local cluster and time their own latencies; tests/gpu share the device).
cores=$(.venv/bin/python -c "from cluster.node import cpu_cores; print(cpu_cores())")
status=0
# The slowest tests of each part are listed at the end: the suite's time budget is 25 minutes.
"${pytest[@]}" -n "$cores" --durations=10 tests/unit || status=$?
"${pytest[@]}" --durations=25 tests --ignore=tests/unit || status=$?
exit $status
