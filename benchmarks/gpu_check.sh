#!/usr/bin/env bash
# The GPU check: the paths a cluster run takes, on one GPU in under 8 minutes, each figure next to the
# memory plan's prediction (python -m sana2.plan). bf16 parameters, fp32 reduction, NCCL, activation
# checkpointing of every block; each run goes through ./run_train.sh as a user's would.
#   1. the debug config: training, one validation pass, a checkpoint save, and a resume (load) from it
#   2. SanaMS_1600M at 1024px (synthetic DC-AE-shaped features)
#   3. SanaMSVideo_2000M at 480p, 81 frames, batch 1 (synthetic Wan-shaped features)
#   4. the CPU-offload path: 1600M at 1024px with parallelism.cpu_offload = true
#   5. SanaMSVideo_2000M from clips: synthetic 81-frame 480x832 mp4s decoded (PyAV) and encoded by the Wan 2.1
#      VAE (random weights) in the step (data.mode = online); captions by tiny-t5 (the text encoder is not
#      what this checks), so the model's caption projection takes its 64 channels
# Each run prints step time, tokens/s, MFU and peak memory (CUDA max allocated / reserved) vs the plan.
#
#   benchmarks/gpu_check.sh                  on a CUDA machine
#   DEVICE=cpu benchmarks/gpu_check.sh       smoke mode: the same steps on CPU (gloo) with the big models
#                                            shrunk to 2 blocks of width 64 (video: 112) and small latents
# OUT (default outputs/gpu_check) holds the runs; it is cleared first.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/bootstrap.sh

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-outputs/gpu_check}
export NGPU=1 LOG_RANK=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ "$DEVICE" == "cpu" ]]; then
    export CUDA_VISIBLE_DEVICES=""  # the trainer picks CUDA whenever it sees a GPU
    SMOKE=(--smoke)
    SHRINK=(--model.depth=2 --model.hidden_size=64 --model.num_heads=2)
    VIDEO_SHRINK=(--model.depth=2 --model.hidden_size=112 --model.num_heads=1)  # one head of the 2B's 112
    STEPS=4 BIG_STEPS=4 IMAGE_BATCH=2
    # the debug run's batch and its validation pass shrunk: the path is what the smoke checks, not the figures
    DEBUG_SHRINK=(--training.local_batch_size=2 --validation.sampling_steps=2 --validation.images_per_prompt=1
                  --validation.num_loss_samples=2 "--validation.prompts=['digit zero']")
    CLIPS=(--encoding.num_frames=9 --encoding.buckets=32x48)
else
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use DEVICE=cpu')"
    SMOKE=() SHRINK=() VIDEO_SHRINK=() DEBUG_SHRINK=()
    STEPS=20 BIG_STEPS=6 IMAGE_BATCH=16
    CLIPS=(--encoding.num_frames=81 --encoding.buckets=480x832)
fi
rm -rf "$OUT"
mkdir -p "$OUT"
start=$SECONDS
report() { python benchmarks/gpu_check_report.py "$@"; }
COMMON=(--training.mixed_precision_param=bfloat16 --training.mixed_precision_reduce=float32
        --activation_checkpoint.mode=full --metrics.log_freq=2 --metrics.enable_tensorboard=true
        --lr_scheduler.warmup_steps=0 --checkpoint.async_mode=disabled)

run() {  # run NAME CONFIG OVERRIDES...: train through run_train.sh, then print its result line
    local name=$1 config=$2
    shift 2
    CONFIG_FILE=$config ./run_train.sh "${COMMON[@]}" "$@" >"$OUT/$name.log" 2>&1 || {
        tail -n 40 "$OUT/$name.log"
        echo "gpu_check: $name failed (log: $OUT/$name.log)"
        exit 1
    }
    report result "$name" "$OUT/$name" "$config" --device "$DEVICE" -- "${COMMON[@]}" "$@"
}

echo "== gpu_check on $DEVICE: $(python -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", "torch", torch.__version__)')"

# 1. debug config: train, validate once at the last step, save; then resume from that checkpoint
DEBUG=(--job.dump_folder="$OUT/debug" --training.steps=$STEPS --validation.at_start=false
       --validation.freq=$STEPS --checkpoint.interval=1000 "${DEBUG_SHRINK[@]}")
run debug train_configs/debug_model.toml "${DEBUG[@]}"
grep -o "checkpoint step $STEPS: training blocked [0-9.]*s" "$OUT/debug.log" | sed 's/^/  checkpoint save: /'
CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh "${COMMON[@]}" "${DEBUG[@]}" \
    --training.steps=$((STEPS + 2)) >"$OUT/debug_resume.log" 2>&1
grep -q "resumed from .*step-$STEPS at step $STEPS" "$OUT/debug_resume.log" || {
    tail -n 40 "$OUT/debug_resume.log"
    echo "gpu_check: the resume did not load step $STEPS"
    exit 1
}
echo "  checkpoint load: resumed at step $STEPS and trained to step $((STEPS + 2))"

# 2. SanaMS_1600M at 1024px
# the features are synthetic and validation is off, so no text encoder is loaded: tiny-t5 stands in for the
# preset's ./checkpoints/gemma-2-2b-it, which a run refuses before it starts when the folder is missing
report data "$OUT/data_image" image "${SMOKE[@]}"
IMAGE=(--data.path="$OUT/data_image" --data.val_path= --encoding.text_encoder=tiny-t5 --training.global_batch_size=0
       --training.local_batch_size=$IMAGE_BATCH --training.steps=$BIG_STEPS --validation.enable=false
       --checkpoint.enable=false "${SHRINK[@]}")
run sana_1600m_1024px train_configs/sana_1600m_img1024.toml "${IMAGE[@]}" --job.dump_folder="$OUT/sana_1600m_1024px"

# 3. SanaMSVideo_2000M at 480p, 81 frames, batch 1
report data "$OUT/data_video" video "${SMOKE[@]}"
VIDEO=(--data.path="$OUT/data_video" --data.val_path= --encoding.text_encoder=tiny-t5 --training.local_batch_size=1
       --training.steps=$BIG_STEPS --validation.enable=false --checkpoint.enable=false "${VIDEO_SHRINK[@]}")
run sana_video_2000m_480p train_configs/sana_video_2000m_480p.toml "${VIDEO[@]}" \
    --job.dump_folder="$OUT/sana_video_2000m_480p"

# 4. the CPU-offload path
run sana_1600m_1024px_cpu_offload train_configs/sana_1600m_img1024.toml "${IMAGE[@]}" \
    --parallelism.cpu_offload=true --job.dump_folder="$OUT/sana_1600m_1024px_cpu_offload"

# 5. SanaMSVideo_2000M from clips through the Wan VAE, online
report clips "$OUT/data_clips" "${SMOKE[@]}"
FROM_CLIPS=(--data.mode=online --data.inputs="['$OUT/data_clips/clips']" --encoding.vae="$OUT/data_clips/vae"
            --encoding.text_encoder=tiny-t5 --encoding.workers=0 "${CLIPS[@]}"
            --model.caption_channels=64 --model.model_max_length=16 --data.val_path= --training.local_batch_size=1
            --training.steps=$BIG_STEPS --validation.enable=false --checkpoint.enable=false "${VIDEO_SHRINK[@]}")
run sana_video_2000m_480p_clips train_configs/sana_video_2000m_480p.toml "${FROM_CLIPS[@]}" \
    --job.dump_folder="$OUT/sana_video_2000m_480p_clips"

echo "== gpu_check passed in $((SECONDS - start))s"
