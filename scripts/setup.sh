#!/usr/bin/env bash
# Set up dsaserve on a fresh Linux machine: system packages (redis-server for the registry,
# docker-compose to validate the compose files), a virtualenv in .venv with torch, and the
# project with its test extras. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first: a CPU build here (an unpinned torch would pull a multi-GB CUDA build); on a GPU
# machine install your CUDA torch into .venv before running this script and it is kept.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
# NIXL per CUDA major: torch's CUDA decides (a CPU build takes cu12, which moves host memory).
cuda=$(.venv/bin/python -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
.venv/bin/pip install -q -e ".[test,cu${cuda}]"
