#!/usr/bin/env bash
# Distributed training computes what one process computes. Trains a tiny drafter for a few
# steps on 2 CPU processes under DDP, DeepSpeed ZeRO-2 and FSDP2 (2 sequences per process)
# and on 1 process (2 sequences x 2 accumulated micro-batches): the same 4 sequences per
# optimizer step. Prints the per-step training losses (metrics.jsonl, log_every=1) and the
# last validation loss, and exits 0 only when every run agrees with the 1-process run
# within RTOL.
#
#   scripts/check_distributed.sh [RECIPE]   default: recipes/tiny/eagle3.yaml, else dflash.yaml, else mtp.yaml
#   env: STEPS=4  BACKENDS="ddp zero2 fsdp2"  RTOL=1e-4  OUT=<a new temporary folder>  PYTHON=python3
#
# Why accumulation and not one batch of 4: it is exactly what 2 processes compute, for every
# method. accelerate's seeded sampler draws one permutation per epoch in every process and
# deals whole batches round robin, so rank r's k-th batch is batch 2k+r of the 1-process
# run, which accumulates batches 2k and 2k+1 into step k+1. Each batch is normalised on its
# own and draws the same step-seeded randomness (DFlash anchors) in both; a batch of 4 would
# normalise over 4 sequences and draw other anchors. Where neither matters (MTP, draft_lm)
# accumulation equals one batch of 4 (tests/test_train_loop.py). Step 1's loss, before any
# update, checks the data and the initial weights; the later ones the gradient sync.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter the caller tests with (tests/test_distributed.py passes its own): the
# machine's python3 may hold another checkout's editable install.
py=${PYTHON:-python3}

default=recipes/tiny/mtp.yaml
for name in dflash eagle3; do  # the post-hoc drafters, once their method and recipe exist
  [ -f "recipes/tiny/$name.yaml" ] && [ -f "train/method_$name.py" ] && default=recipes/tiny/$name.yaml
done
RECIPE=${1:-$default}
STEPS=${STEPS:-4}
BACKENDS=${BACKENDS:-"ddp zero2 fsdp2"}
RTOL=${RTOL:-1e-4}
OUT=${OUT:-$(mktemp -d -t draftsmith-dist.XXXXXX)}
mkdir -p "$OUT"
# Two processes on a small machine: one thread each, and no network.
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled PYTHONWARNINGS=ignore

# The override set of tests/tiny_runs.py (a run of seconds), with the 4 target layers EAGLE-3
# needs. Checkpoints are written at the last step: save_state under each backend runs too.
TINY=(target.num_layers=4 target.hidden_size=64 target.num_heads=4 target.num_kv_heads=1
      data.vocab_size=384 data.max_chars=120000 train.max_steps="$STEPS" train.seq_len=32
      train.lr=0.003 train.log_every=1 train.validation_every="$STEPS" train.save_every="$STEPS"
      tracking.report_to=none)
read -r method target < <("$py" -c "from draftsmith.recipe import load_recipe
r = load_recipe('$RECIPE'); print(r.method.name, r.target.path or '-')")
[ -n "${method:-}" ] || exit 2  # the recipe did not load; python said why
if [ "$target" != - ]; then
  # Post hoc: against a tiny target trained here first, on a few short answers of its own.
  "$py" -m draftsmith.train --recipe recipes/tiny/mtp.yaml "${TINY[@]}" train.max_steps=2 train.batch_size=4 \
    train.output_dir="$OUT/target" >"$OUT/target.log" 2>&1 || { tail -5 "$OUT/target.log"; exit 1; }
  TINY+=(target.path="$OUT/target" train.seq_len=256 data.num_conversations=48 data.regen_max_new_tokens=24)
  [ "$method" = eagle3 ] && TINY+=(method.draft_vocab_size=128 method.ttt_length=2)
fi

# run NAME GRAD_ACCUM VALIDATION_BATCHES [accelerate launch options...]: 2 sequences per batch.
# A free port each time: other jobs on this machine may hold accelerate's default one.
run() {
  local name=$1 accum=$2 validation_batches=$3 port; shift 3
  port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  "$py" -m accelerate.commands.launch --main_process_port "$port" "$@" -m draftsmith.train --recipe "$RECIPE" "${TINY[@]}" train.batch_size=2 \
    train.grad_accum="$accum" train.validation_batches="$validation_batches" train.output_dir="$OUT/$name" >"$OUT/$name.log" 2>&1
}

echo "recipe $RECIPE, $STEPS steps of 4 sequences; runs and logs in $OUT"
run single 2 4 --config_file recipes/accelerate/cpu.yaml || { tail -20 "$OUT/single.log"; exit 1; }
columns=()
for backend in $BACKENDS; do
  two=(--num_processes 2 --mixed_precision no)  # the shipped configs, sized down to this machine
  case $backend in
    # accelerate's data parallel on CPU is a multi-process launch with ACCELERATE_USE_CPU (gloo).
    ddp) ACCELERATE_USE_CPU=true run ddp 1 2 --config_file recipes/accelerate/ddp.yaml "${two[@]}" ;;
    # DeepSpeed's CPU accelerator over gloo (the loop names the backend: train/launch_checks.py).
    zero2) run zero2 1 2 --config_file recipes/accelerate/zero2.yaml "${two[@]}" ;;
    fsdp2) run fsdp2 1 2 --config_file recipes/accelerate/fsdp2.yaml "${two[@]}" ;;
    *) echo "unknown backend $backend (known: ddp zero2 fsdp2)"; exit 2 ;;
  esac && { columns+=("$backend=$OUT/$backend"); continue; }
  # A sharded backend refused as bad input (train/launch_checks.py) is one this machine
  # cannot run; anything else, and any DDP failure, is a failure, and its log is shown.
  reason=$(grep -h -m1 "draftsmith: error:" "$OUT/$backend.log" | sed 's/.*draftsmith: error: //' || true)
  if [ -n "$reason" ] && [ "$backend" != ddp ]; then columns+=("$backend=!not run on CPU: $reason")
  else tail -20 "$OUT/$backend.log"; columns+=("$backend=!FAILED, see $OUT/$backend.log"); fi
done
"$py" scripts/compare_losses.py --rtol "$RTOL" "$OUT/single" "${columns[@]}"
