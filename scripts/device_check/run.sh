#!/usr/bin/env bash
# The device check's entry point inside a bundle made by `scripts/device-check.sh --prepare`.
# On the GPU machine:  bash .device-bundle/run.sh            (report to $OUT)
#                      bash .device-bundle/run.sh --out DIR  [--budget-s 480]
# Needs bash, coreutils and a python3 (standard library only). Exits 0 when nothing that ran
# failed, also where there is no GPU (the report then says "no GPU: <reason>").
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=$(command -v python3 || true)
if [[ -z "$python" ]]; then
  echo "device-check: python3 not found on PATH; the runner ($here/run.py) needs it" >&2
  exit 1
fi
# A copy that lost the mode bits must still run.
chmod u+x "$here"/bin/* 2>/dev/null || true
# The runner keeps every step, and itself, within --budget-s (at most 540 s); this is only the
# backstop should the runner itself hang, inside the device tool's 600 s.
exec timeout --kill-after=10 580 "$python" "$here/run.py" "$@"
