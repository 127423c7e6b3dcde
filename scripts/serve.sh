#!/usr/bin/env bash
# The serve command: sets up .venv (idempotent) and serves the embedded default pair on 127.0.0.1:8000,
# from a local Ray cluster that listens on 127.0.0.1 only, with Ray token auth (README, Security).
# Extra arguments go to `specserve serve` (e.g. --config cluster/examples/local.yaml --port 8001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/specserve serve "$@"
