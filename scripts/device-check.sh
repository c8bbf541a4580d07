#!/usr/bin/env bash
# The device check: one prepared run of hsx's GPU tests on a bare GPU machine.
#
#   scripts/device-check.sh --prepare [--build-dir DIR] [--bundle DIR]
#       here (no GPU needed): builds the binaries the check needs in $HSX_BUILD_DIR (default
#       build) and makes a self-contained bundle in .device-bundle/ (stripped binaries, their
#       shared libraries except glibc, the driver and cuBLAS/cuDNN/NCCL, and the runner);
#       at most 60 MiB, its size printed.
#   scripts/device-check.sh --run [--out DIR] [--budget-s S] [--steps A,B] [--bundle DIR]
#       runs .device-bundle/run.sh: device and versions, each suite's pass/fail/skip counts,
#       report.md + report.json + device-check.log in DIR (default $OUT). Within 8 minutes.
#       Without a GPU it says "no GPU: <reason>" and exits 0 unless a test failed.
#
# On the GPU machine, the device tool runs `bash .device-bundle/run.sh` with carry
# [".device-bundle"] (README: "On a GPU machine"). The steps are listed in one place:
# scripts/device_check/runner.py, STEPS.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }
mode="${1:-}"
[[ $# -gt 0 ]] && shift
case "$mode" in
  --prepare) exec python3 scripts/device_check/prepare.py "$@" ;;
  --run)
    bundle=.device-bundle
    args=()
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --bundle) [[ $# -ge 2 ]] || { echo "device-check.sh: --bundle needs a folder" >&2; exit 2; }
                  bundle="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
      esac
    done
    if [[ ! -f "$bundle/run.sh" ]]; then
      echo "device-check.sh: no bundle in $bundle (no run.sh): run scripts/device-check.sh --prepare first" >&2
      exit 2
    fi
    exec bash "$bundle/run.sh" "${args[@]}" ;;
  -h|--help) usage ;;
  *) usage >&2; echo "device-check.sh: say --prepare or --run (got '${mode}')" >&2; exit 2 ;;
esac
