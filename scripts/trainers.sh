#!/usr/bin/env bash
# CI stage "trainers": the trainers' own loaders on hsx output (tests/trainers/).
#
# Installs the trainers' pinned versions (tests/trainers/requirements*.txt: speculators,
# SpecForge, ModelOpt, with their torch/transformers, which differ from
# tests/python/requirements.txt) into their own virtual environment, reused while the
# requirements are unchanged; installs the hsx client into it; runs the tests.
#
# --install-only prepares the environment and stops (the network-bound part; scripts/test.sh
# runs it in the background while the CPU-bound stages run).
#
# Environment: HSX_TRAINERS_VENV (default ~/.cache/hsx/trainers), HSX_BUILD_DIR (default build).
set -euo pipefail
install_only=0
[[ "${1:-}" == --install-only ]] && install_only=1
cd "$(dirname "$0")/.."
venv="${HSX_TRAINERS_VENV:-$HOME/.cache/hsx/trainers}"
build="${HSX_BUILD_DIR:-build}"
stamp="$venv/.hsx-trainers-requirements"
start=$(date +%s)

if [[ ! -x "$venv/bin/python" ]]; then
  echo "trainers: creating the environment in $venv"
  python3 -m venv "$venv"
fi
wanted=$(cat tests/trainers/requirements.txt tests/trainers/requirements-nodeps.txt)
if [[ "$wanted" != "$(cat "$stamp" 2>/dev/null)" ]]; then
  echo "trainers: installing the pinned trainers (tests/trainers/requirements*.txt)"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -r tests/trainers/requirements.txt
  # specforge without its dependencies: sglang (its online-capture engine, several GB of
  # CUDA wheels) and the tracking/parallelism extras are not used by its offline loaders.
  "$venv/bin/pip" install -q --no-deps -r tests/trainers/requirements-nodeps.txt
  printf '%s' "$wanted" >"$stamp"
fi
# The hsx client, rebuilt each time (its stubs come from proto/); its own dependencies only.
"$venv/bin/pip" install -q ./client/python
echo "trainers: environment ready in $(($(date +%s) - start)) s"
((install_only)) && exit 0
HSX_BIN_DIR="$(pwd)/$build/bin" "$venv/bin/python" -m pytest tests/trainers -q -p no:cacheprovider
echo "trainers: stage took $(($(date +%s) - start)) s"
