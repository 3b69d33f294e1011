#!/usr/bin/env bash
# Recipe for the embedded default: an activated-LoRA MTP adapter for SmolLM2-135M-Instruct (issue 7).
#
#   bash scripts/train_default.sh                    # CPU, fresh run, 70 minutes
#   MINUTES=600 BATCH=64 bash scripts/train_default.sh   # e.g. a GPU (bf16 autocast is automatic on CUDA)
#   CONTINUE=1 bash scripts/train_default.sh         # continue from the adapter shipped in assets/
#
# Data: GSM8K train questions with their reference answers (calculator annotations <<...>> removed,
# since the model never writes them). Output: runs/default/final, copied to assets/smollm2-135m-mtp
# when PUBLISH=1. Resumable: rerunning with the same OUT resumes from its latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-../shared/data/gsm8k/train.jsonl}
OUT=${OUT:-runs/default}
MINUTES=${MINUTES:-70}
BATCH=${BATCH:-8}
mkdir -p "$OUT"
sed -E 's/<<[^>]*>>//g' "$DATA" > "$OUT/train_clean.jsonl"
extra=()
[ "${CONTINUE:-0}" = 1 ] && extra+=(--init-adapter assets/smollm2-135m-mtp)
ls "$OUT"/checkpoint-* >/dev/null 2>&1 && extra+=(--resume auto)
[ -n "${THREADS:-}" ] && extra+=(--threads "$THREADS")   # THREADS=1 on a CPU shared with other jobs
HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} "$PY" -m model.train --base smollm2-135m --data "$OUT/train_clean.jsonl" \
  --output "$OUT" --adapter alora --lora-rank 16 --k-max 4 --spacing 4 --lr 1e-3 --warmup 20 \
  --batch-size "$BATCH" --seq-len 160 --max-steps 100000 --max-minutes "$MINUTES" --save-every 10 \
  --keep-checkpoints 2 --log-every 1 --seed 0 --save-dtype bfloat16 "${extra[@]}"
if [ "${PUBLISH:-0}" = 1 ]; then
  mkdir -p assets/smollm2-135m-mtp
  cp "$OUT"/final/* assets/smollm2-135m-mtp/
fi
