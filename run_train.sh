#!/usr/bin/env bash
# Launch sana2 training with the sana2 launcher (torchrun's options and agent; sana2/launch.py), like
# torchtitan's run_train.sh. SIGTERM or Ctrl-C to this process (its PID is the launcher's) stops the
# run at its next safe point with a checkpoint, within job.stop_grace_period, and exit code 0.
#   NGPU          processes per node (default: GPUs on this node, or 2 on a CPU-only machine)
#   CONFIG_FILE   TOML config (default: the embedded debug config)
#   LOG_RANK      ranks whose output is shown (default 0)
#   NNODES, RDZV_ENDPOINT, RDZV_ID   multi-node through torchrun's c10d rendezvous
# Extra arguments are passed through as --section.key=value overrides.
#   --plan (first argument): print the memory plan for this launch instead of training, e.g.
#   NGPU=8 NNODES=2 ./run_train.sh --plan --gpu-memory 80  (see python -m sana2.plan --help)
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh

if [[ -z "${NGPU:-}" ]]; then
    NGPU=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
LOG_RANK=${LOG_RANK:-0}

if [[ "${1:-}" == "--plan" ]]; then
    shift
    exec python -m sana2.plan "$CONFIG_FILE" --nproc-per-node "$NGPU" --nnodes "${NNODES:-1}" "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    rendezvous=(--nnodes "${NNODES:-1}" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT"
                --rdzv_id "${RDZV_ID:-sana2}")
else
    rendezvous=(--standalone --nnodes 1)
fi

# the launcher checks the config before any worker starts
exec python -m sana2.launch "${rendezvous[@]}" --nproc_per_node "$NGPU" --local-ranks-filter "$LOG_RANK" \
    --role rank --tee 3 -m sana2.train "$CONFIG_FILE" "$@"
