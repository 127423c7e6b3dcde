#!/usr/bin/env bash
# Idempotent environment set-up: a virtualenv in .venv with torch, deepspeed and specserve (editable).
#
# torch: on a machine without an NVIDIA driver this pins the 2.13.0 CPU wheel (a bare `torch` requirement
# would pull a multi-GB CUDA build); a machine with a driver keeps or gets a CUDA build. Override with
# SPECSERVE_TORCH="torch==X" if you need another build. deepspeed's setup.py imports torch, so it is
# installed without build isolation (otherwise pip would fetch a second, CUDA torch into its build env).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECSERVE_VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; }

# Prometheus for tests/ray/test_prometheus.py: Debian's package, when missing and we may install it.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing prometheus (apt)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
    >/dev/null 2>&1 || echo "[setup] prometheus not installed; tests/ray/test_prometheus.py will skip"
fi

# The host lab (tools/hostlab.py, tests/lab): sshd, ssh, ip/tc, ping and rsync (Ray's cluster launcher copies
# files with it) from Debian, whichever are missing.
lab_pkgs=()
[ -x /usr/sbin/sshd ] || lab_pkgs+=(openssh-server)
command -v ssh >/dev/null 2>&1 && command -v ssh-keygen >/dev/null 2>&1 || lab_pkgs+=(openssh-client)
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || lab_pkgs+=(iproute2)
command -v ping >/dev/null 2>&1 || lab_pkgs+=(iputils-ping)
command -v rsync >/dev/null 2>&1 || lab_pkgs+=(rsync)
if [ ${#lab_pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing ${lab_pkgs[*]} (apt)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${lab_pkgs[@]}"; } \
    >/dev/null 2>&1 || echo "[setup] ${lab_pkgs[*]} not installed; tests/lab will skip"
fi

stamp="$VENV/.specserve-setup"
want=$( (cat pyproject.toml scripts/setup_env.sh; echo "${SPECSERVE_TORCH:-}") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import torch, ray, deepspeed, engine.engine" 2>/dev/null; then
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ -n "${SPECSERVE_TORCH:-}" ]; then
    torch_spec=$SPECSERVE_TORCH
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_spec="torch>=2.5"
  else
    torch_spec="torch==2.13.0"
  fi
  echo "[setup] installing $torch_spec"
  pip_q "$torch_spec"
fi
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing deepspeed (no build isolation, no prebuilt ops)"
  pip_q setuptools wheel
  DS_BUILD_OPS=0 pip_q --no-build-isolation deepspeed
fi
echo "[setup] installing specserve and test extras"
pip_q -e ".[test]"
"$PY" -c "import torch, ray, deepspeed, transformers, msgpack, cluster, verifier" >/dev/null
echo "$want" > "$stamp"
