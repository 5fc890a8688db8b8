#!/usr/bin/env bash
# The embedded default, end to end, on a CPU and with no download (docs/design.md section 9):
# pretrain the tiny target with MTP heads on the stdlib corpus, train an external draft
# model, EAGLE-3, DFlash and DSpark (backbone and heads trained together, as DeepSpec trains it;
# beside it "DFlash + refiner", DSpark's heads on the frozen DFlash backbone) against it, and
# write one report comparing all six schemes (n-gram needs no training) on held-out prompts at
# the tile rule's D: greedy, and at the headline setting, temperature 0.7 with top-p 0.8
# and top-k 20 (the sampling the post-hoc drafters' training answers were drawn with; the
# tiny target's greedy text falls into loops, which only measure how well a drafter copies).
# A stage whose model already exists is reused; `make clean` (or RUNS=elsewhere) starts over.
# DEMO_OVERRIDES="train.max_steps=20" shrinks every training stage (a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/demo}
SEED=${SEED:-0}  # seeds every stage: initialisation, data order, regeneration, sampled decodes
read -r -a EXTRA <<< "${DEMO_OVERRIDES:-}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

stage() {  # stage NAME RECIPE [overrides...]: train unless RUNS/NAME/model exists
  local name=$1 recipe=$2; shift 2
  if [ -e "$RUNS/$name/model" ]; then
    echo "== $name: reusing $RUNS/$name/model"
  else
    echo "== $name: draftsmith train --recipe $recipe $*"
    local t0 resume=(); t0=$(date +%s)
    # An interrupted stage left checkpoints: continue it (a fresh run into its folder is refused).
    [ -n "$(ls -A "$RUNS/$name/checkpoints" 2>/dev/null)" ] && resume=(train.resume=true)
    draftsmith train --recipe "$recipe" train.output_dir="$RUNS/$name" train.seed="$SEED" "$@" "${EXTRA[@]}" "${resume[@]}"
    echo "== $name: $(( $(date +%s) - t0 )) s"
  fi
}

start=$(date +%s)
stage mtp recipes/tiny/mtp.yaml
draftsmith plan "$RUNS/mtp/model"
target=target.path="$RUNS/mtp"
stage draft_lm recipes/tiny/draft_lm.yaml "$target"
stage eagle3 recipes/tiny/eagle3.yaml "$target"
stage dflash recipes/tiny/dflash.yaml "$target"
stage dspark recipes/tiny/dspark.yaml "$target"
# The heads alone, on the frozen DFlash backbone and its block (auto), for about 100 s more (0.17 s/step).
stage dflash_refiner recipes/tiny/dspark.yaml "$target" method.backbone="$RUNS/dflash" method.freeze_backbone=true \
  method.block_size=auto train.max_steps=600

echo "== evaluating every drafter against plain decoding of the target (greedy, then temperature 0.7 / top-p 0.8 / top-k 20)"
rm -rf "$RUNS/report"
draftsmith eval --target "$RUNS/mtp" --out "$RUNS/report" --num-prompts 16 --max-new-tokens 64 \
  --prompt-chars 240 --seed "$SEED" --temperature 0 --temperature 0.7 --top-p 0.8 --top-k 20 \
  --drafter ngram --drafter "draft_lm:$RUNS/draft_lm" --drafter "mtp:$RUNS/mtp" --drafter "mtp_exact:$RUNS/mtp" \
  --drafter "eagle3:$RUNS/eagle3" --drafter "eagle3_tree:$RUNS/eagle3" \
  --drafter "dflash:$RUNS/dflash" --drafter "dspark:$RUNS/dspark" --drafter "dflash_refiner=dspark:$RUNS/dflash_refiner"

echo "== done in $(( $(date +%s) - start )) s; the report is $RUNS/report/report.md (plots beside it)"
