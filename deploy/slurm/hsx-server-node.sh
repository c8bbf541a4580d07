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

# exec: hsx-server gets SLURM's SIGTERM itself, once (a second signal would cut its drain short).
# Its log goes through the reader below, which publishes the address on `ready` and removes it
# when the log ends, i.e. when the server has exited; the reader ignores SIGTERM so that it
# outlives the server.
exec "${HSX_SERVER_BIN:-hsx-server}" \
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
  --max-connection-age=5m \
  "$@" 2> >(
    trap '' TERM INT
    while IFS= read -r line; do
      printf '%s\n' "$line" >&2
      if [[ $line == *"ready: serving"* ]]; then
        printf '%s:%s\n' "$host" "$port" > "$HSX_SERVER_DIR/.$host.partial"
        mv "$HSX_SERVER_DIR/.$host.partial" "$address_file"
      fi
    done
    rm -f "$address_file"
  )
