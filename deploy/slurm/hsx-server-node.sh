#!/bin/bash
# One node of hsx-server.sbatch (run there by srun): stage HSX_MODEL_SRC onto HSX_LOCAL_DIR with
# stage-model.sh, start hsx-server on all of the node's GPUs, and publish this node's address in
# HSX_SERVER_DIR/<host> once the server logs `ready` (removed again when it exits).
# Extra arguments go to hsx-server.
set -euo pipefail

host=$(hostname -s)
port=${HSX_PORT:-50051}
model=$HSX_LOCAL_DIR/$(basename "$HSX_MODEL_SRC")
address_file=$HSX_SERVER_DIR/$host

sh "$HSX_STAGE_SCRIPT" "$HSX_MODEL_SRC" "$model"

gpus=$(nvidia-smi --list-gpus | wc -l)
(( gpus > 0 )) || { echo "hsx-server-node: $host: no GPU found by nvidia-smi" >&2; exit 1; }

trap 'rm -f "$address_file"' EXIT
# AFTER-MERGE(hsx-server --max-connection-age): add --max-connection-age=... here once
# hsx-server has the flag.
"${HSX_SERVER_BIN:-hsx-server}" \
  --model="$model" \
  --device=cuda \
  --tp="$gpus" \
  --precision=bf16 \
  --capture=eagle3 \
  --listen="0.0.0.0:$port" \
  --max-batch-tokens=32768 \
  --max-tokens-per-sample=16384 \
  --max-concurrent-requests=288 \
  --drain-timeout=60s \
  "$@" 2> >(while IFS= read -r line; do
    printf '%s\n' "$line" >&2
    if [[ $line == *"ready: serving"* ]]; then
      printf '%s:%s\n' "$host" "$port" > "$HSX_SERVER_DIR/.$host.partial" && mv "$HSX_SERVER_DIR/.$host.partial" "$address_file"
    fi
  done) &
server=$!
# Pass SLURM's SIGTERM on to the server, which drains; then wait for it to exit.
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT
status=0
wait "$server" || status=$?
if (( status > 128 )) && kill -0 "$server" 2>/dev/null; then
  wait "$server" || status=$?
fi
exit "$status"
