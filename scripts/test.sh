#!/usr/bin/env bash
# The test command: sets up .venv (idempotent) and runs the whole suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# A local single-user test cluster: Ray's token auth is switched off deliberately (see README, Security).
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@"
