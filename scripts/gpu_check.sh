#!/usr/bin/env bash
# The GPU check: one H200, no network, under 10 minutes, in four steps.
#
#   1. pytest -m gpu              lossless greedy decoding on CUDA in bf16, SDPA against
#                                 flash-attn logits, drafter training steps under bf16
#                                 autocast (tests/test_gpu.py and any other gpu-marked test)
#   2. scripts/bench_verify.py    verify latency against query tokens at G = 4, 8, 16 (where
#                                 G*(1+D) leaves the 128-row tile), and the decoder's
#                                 speedup over plain decoding for each drafter
#   3. scripts/bench_train.py     a drafter training step against a target forward, real size
#   4. draftsmith plan --measure  the verify latency table at G = 3, 4, 8 and 16 (8B-wide
#                                 attention, 2 layers, bf16), d = 0 to past the tile rule's D:
#                                 whether the second tile starts where the rule says
#
# Everything lands in $OUT when set (the device tool's folder), else runs/gpu_check:
# gpu_check.md (every table), gpu_check.log (all output), verify.json, verify.png,
# decoder_speedup.png, decoder_acceptance.png, plan_G{3,4,8,16}/latency.{json,png} (the dry run: G = 4). Each step has its own time limit and a
# failed step does not stop the next; the exit status is 1 if any step failed. The steps'
# limits share one budget (GPU_CHECK_BUDGET, 540 s), so the whole run ends inside 10 minutes.
#
#   bash scripts/gpu_check.sh                 on the GPU machine
#   bash scripts/gpu_check.sh --cpu-dry-run   every code path at tiny sizes on a CPU
#                                             (or GPU_CHECK_DRY_RUN=1)
# GPU_CHECK_TRAIN_ARGS adds arguments to step 3 (e.g. "--drafter-attention sdpa,auto").
set -uo pipefail
cd "$(dirname "$0")/.."

dry=${GPU_CHECK_DRY_RUN:-0}
[[ "${1:-}" == "--cpu-dry-run" ]] && dry=1
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1

say() { echo "$*" | tee -a "$log"; }
failed=()
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-540}))
# step NAME SECONDS CMD...: run with a time limit (its own, or what is left of the budget),
# output to the terminal and the log.
step() {
    local name=$1 limit=$2
    shift 2
    ((limit > deadline - SECONDS)) && limit=$((deadline - SECONDS))
    if ((limit < 10)); then
        say "== $name: skipped, the time budget is spent"
        failed+=("$name (no time left)")
        return
    fi
    say "== $name ($(date +%T), limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    say "== $name: exit $rc after $((SECONDS - t0))s"
    [[ $rc -eq 0 ]] || failed+=("$name (exit $rc$([[ $rc -eq 124 ]] && echo ', time limit'))")
}

# The device image has torch and transformers but not this package: install it in place,
# without dependencies (nothing can be fetched there).
if ! python3 -c "import draftsmith.eval.decoder" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --disable-pip-version-check -e . \
        >>"$log" 2>&1 \
        || { say "cannot install draftsmith (pip install -e . failed; see $log)"; exit 1; }
fi

if [[ $dry == 1 ]]; then
    mode="CPU dry run, tiny sizes: the timings mean nothing"
    verify_args=(--cpu-dry-run)
    tests=(tests/test_gpu.py)  # every test skips on a CPU; collecting the GPU file is the check
    train_args=(--device cpu --hidden 64 --layers 4 --heads 4 --kv-heads 1 --vocab 256 --draft-vocab 128
                --seq 32 --batch 1 --anchors 4 --warmup 0 --repeats 1)
    plan_args=(--contexts 64 --reps 1 --max-draft 4 --device cpu)
    groups=(4)  # the same code path at every G: one process start, not four
    head_dim=8 vocab=256 dtype=float32
else
    mode="GPU"
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { say "no CUDA device visible to torch (use --cpu-dry-run on a CPU)"; exit 1; }
    verify_args=()
    tests=(tests)
    train_args=(--device cuda --repeats 5)
    plan_args=(--contexts 1024,4096 --reps 5 --device cuda)
    groups=(3 4 8 16)
    head_dim=128 vocab=32000 dtype=bfloat16
fi
# shellcheck disable=SC2206  # word splitting of the extra arguments is the point
train_args+=(${GPU_CHECK_TRAIN_ARGS:-})

say "gpu_check: $mode, $(date -u +%FT%TZ)"
python3 - <<'EOF' 2>&1 | tee -a "$log" "$work/env.txt"
import importlib.util, platform, torch, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
fa = importlib.util.find_spec("flash_attn")
fa = __import__("flash_attn").__version__ if fa else "not installed (SDPA everywhere)"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, flash-attn {fa}; GPU: {gpu}")
EOF
[[ $dry == 1 ]] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
    2>&1 | tee -a "$log" "$work/env.txt"

step "pytest -m gpu" 140 python3 -m pytest -m gpu -q -rs --continue-on-collection-errors "${tests[@]}"
tests_summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran" "$log" | tail -1)
step "bench_verify" 190 python3 scripts/bench_verify.py --out "$work" "${verify_args[@]}"
step "bench_train" 110 python3 scripts/bench_train.py --out "$work/train.md" "${train_args[@]}"

# Step 4: one Llama-shaped config per grouping (2 layers: the tile is a per-layer matter), timed
# with random weights; G = 3 is SmolLM2's grouping (9 query heads over 3 KV heads), scaled up.
for g in "${groups[@]}"; do
    kv=$((g == 16 ? 4 : 8))
    [[ $dry == 1 ]] && kv=1
    mkdir -p "$work/G$g"
    python3 -c 'import json, sys
path, g, kv, head_dim, vocab, dtype = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
heads = g * kv
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": heads * head_dim,
           "intermediate_size": 2 * heads * head_dim, "num_hidden_layers": 2, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "dtype": dtype, "torch_dtype": dtype}, open(path, "w"))' \
        "$work/G$g/config.json" "$g" "$kv" "$head_dim" "$vocab" "$dtype"
    step "plan --measure G=$g" 40 python3 -m draftsmith.cli plan "$work/G$g/config.json" --measure \
        --out "$out/plan_G$g" "${plan_args[@]}"
done

for f in verify.json verify.png decoder_speedup.png decoder_acceptance.png; do
    [[ -f "$work/$f" ]] && cp "$work/$f" "$out/$f"
done
{
    echo "# GPU check: $mode"
    echo
    echo '```'
    cat "$work/env.txt"
    echo '```'
    echo
    echo "## pytest -m gpu"
    echo
    echo "${tests_summary:-no summary line (see gpu_check.log)}"
    echo
    [[ -f "$work/verify.md" ]] && cat "$work/verify.md" && echo
    echo "## Drafter training step against the target forward (bench_train.py)"
    echo
    if [[ -f "$work/train.md" ]]; then cat "$work/train.md"; else echo "not measured (see gpu_check.log)"; fi
    echo
    echo "![verify latency](verify.png) ![decoder speedup](decoder_speedup.png)"
    echo
    echo "## Verify latency at G = 3, 4, 8, 16 (draftsmith plan --measure; plan_G*/latency.json and .png)"
    echo
    awk '/^== plan --measure G=[0-9]+ \(/ {g = $4} /^context [0-9]+: largest rise/ {print "- " g ", " $0}' "$log"
    echo
    if [[ ${#failed[@]} -eq 0 ]]; then echo "All steps finished."; else echo "Failed: ${failed[*]}."; fi
} >"$out/gpu_check.md"

say "wrote $out/gpu_check.md"
if [[ ${#failed[@]} -gt 0 ]]; then
    say "failed: ${failed[*]}"
    exit 1
fi
