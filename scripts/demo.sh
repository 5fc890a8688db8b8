#!/usr/bin/env bash
# The embedded default, end to end, on a CPU and with no download (DESIGN.md section 9):
# pretrain the tiny target with MTP heads on the stdlib corpus, train the other drafters
# against it, and write one report comparing them on held-out prompts.
# A stage whose output already exists is reused; `make clean` (or RUNS=elsewhere) starts over.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/demo}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

stage() {  # stage NAME RECIPE [overrides...]: train unless RUNS/NAME/model exists
  local name=$1 recipe=$2; shift 2
  if [ -e "$RUNS/$name/model" ]; then
    echo "== $name: reusing $RUNS/$name/model"
  else
    echo "== $name: draftsmith train $recipe $*"
    draftsmith train "$recipe" train.output_dir="$RUNS/$name" "$@"
  fi
}

start=$(date +%s)
stage mtp recipes/tiny/mtp.yaml
draftsmith plan "$RUNS/mtp/model"
stage draft_lm recipes/tiny/draft_lm.yaml target.path="$RUNS/mtp"

echo "== evaluating every drafter against plain decoding of the target"
draftsmith eval --target "$RUNS/mtp" --out "$RUNS/report" --num-prompts 8 --max-new-tokens 64 \
  --drafter ngram --drafter "draft_lm:$RUNS/draft_lm" --drafter "mtp:$RUNS/mtp"

echo "== done in $(( $(date +%s) - start )) s; the report is $RUNS/report/report.md (plots beside it)"
