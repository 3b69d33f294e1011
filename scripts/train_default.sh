#!/usr/bin/env bash
# Recipe for the embedded default: an activated-LoRA MTP adapter for SmolLM2-135M-Instruct, trained on
# the base model's own greedy answers to general instructions it wrote itself (Magpie) and to DATA's questions.
# One script for the CPU and for a CUDA GPU.
#
#   DATA=gsm8k_train.jsonl bash scripts/train_default.sh                    # CPU: v5's recipe (300 CPU-minutes)
#   DATA=gsm8k_train.jsonl MINUTES=8 bash scripts/train_default.sh          # CUDA GPU: 8 minutes, bf16, batch 64
#   DATA=train.jsonl MAGPIE=0 bash scripts/train_default.sh                 # DATA's answers only (v1-v4's recipe)
#   DATA=train.jsonl CONTINUE=0 bash scripts/train_default.sh               # fresh adapter instead
#   DATA=train.jsonl PROCS=2 bash scripts/train_default.sh                  # both cores of a CPU: DDP, 2 x 1 thread
#   DRY_RUN=1 DATA=train.jsonl bash scripts/train_default.sh                # print the commands only
#
# Steps (each resumable: rerun the same command after an interruption):
#   0. MAGPIE=N (default 2640; 0 skips steps 0 and 2): N general instructions the base model writes itself from
#      its chat template's bare user prefix (python -m model.magpie instructions: sampled at temperature 1,
#      top-p 0.95, filtered, deduplicated; 5% held out beside them, never trained on), then its greedy answers;
#   1. the base model's greedy answers to the DATA questions (python -m model.self_answers; bf16 where
#      the device runs it natively; ANSWERS=N answers only the first N questions);
#   2. the mix (python -m model.magpie mix): degenerate (looping, empty) answers dropped, general and DATA
#      answers in the ratio GENERAL_SHARE : 1 (default 3 : 1), shuffled;
#   3. python -m model.train on them, continuing from assets/smollm2-135m-mtp (CONTINUE=0: fresh), for
#      MINUTES of wall clock or CPU_MINUTES of training CPU time (per process); mixed precision auto (bf16
#      on CUDA and on CPUs with AVX512-BF16/AMX, else float32); resumes from OUT's checkpoint when there
#      is one; PROCS=N runs N DDP processes through accelerate launch (batch BATCH per process);
#      LR (1e-3), LR_SCHEDULE (cosine: down to 10% at MAX_STEPS, default 2400; or constant), WARMUP (20), SEED (0),
#      SEQ_LEN (192), k drawn from [2, 4];
#   4. PUBLISH=1 copies OUT/final into assets/smollm2-135m-mtp.
#
# OUT holds train_log.jsonl, ONE resumable checkpoint (trainable weights + bf16 AdamW moments, ~40 MB)
# and final/ (the ~19 MB adapter): small enough to bring back from a rented GPU; the answers go
# to ANSWERS_FILE (default runs/self_answers/<name of DATA>.jsonl) and runs/magpie/, outside OUT.
# DATA is a JSONL file with question (or prompt) rows, or a datasets id such as openai/gsm8k:main.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
: "${DATA:?set DATA to a JSONL file of questions or a datasets id, e.g. DATA=openai/gsm8k:main}"
BASE=${BASE:-smollm2-135m}
OUT=${OUT:-runs/default}
if [ -f "$DATA" ] || [[ "$DATA" == *.jsonl ]]; then STEM=$(basename "$DATA" .jsonl); else STEM=${DATA//[:\/]/_}; fi
ANSWERS_FILE=${ANSWERS_FILE:-runs/self_answers/${STEM}.jsonl}
MAX_NEW=${MAX_NEW:-192}
SEQ_LEN=${SEQ_LEN:-192}
MAGPIE=${MAGPIE:-2640}
MAGPIE_DIR=${MAGPIE_DIR:-runs/magpie}
GENERAL_SHARE=${GENERAL_SHARE:-3}
LORA_RANK=${LORA_RANK:-32}   # the shipped adapter's rank (a larger value grows it when continuing; it cannot shrink)
GPU=${GPU:-auto}   # auto: CUDA if torch sees it (GPU=1 / GPU=0 force the settings, e.g. with DRY_RUN=1)
[ "$GPU" = auto ] && { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && GPU=1 || GPU=0; }
if [ "$GPU" = 1 ]; then
  GPU=1; BATCH=${BATCH:-64}; ANSWER_BATCH=${ANSWER_BATCH:-256}; THREADS=${THREADS:-}
else
  GPU=0; BATCH=${BATCH:-8}; ANSWER_BATCH=${ANSWER_BATCH:-32}; THREADS=${THREADS:-1}
  # CPU: train for a CPU-time budget unless MINUTES is given
  [ -z "${MINUTES:-}" ] && CPU_MINUTES=${CPU_MINUTES:-300}
fi
SAVE_EVERY=${SAVE_EVERY:-$([ $GPU = 1 ] && echo 200 || echo 20)}
threads=(); [ -n "$THREADS" ] && threads=(--threads "$THREADS")
limit=(); [ -n "${ANSWERS:-}" ] && limit=(--limit "$ANSWERS")
budget=(); [ -n "${MINUTES:-}" ] && budget+=(--max-minutes "$MINUTES")
[ -n "${CPU_MINUTES:-}" ] && budget+=(--max-cpu-minutes "$CPU_MINUTES")
extra=()
[ "${CONTINUE:-1}" = 1 ] && [ "$BASE" = smollm2-135m ] && extra+=(--init-adapter assets/smollm2-135m-mtp)
[ -n "${INIT_ADAPTER:-}" ] && extra+=(--init-adapter "$INIT_ADAPTER")
LR_SCHEDULE=${LR_SCHEDULE:-cosine}
if [ "$LR_SCHEDULE" = cosine ]; then MAX_STEPS=${MAX_STEPS:-2400}; else MAX_STEPS=${MAX_STEPS:-1000000}; fi
[ -n "${EXPORT_EVERY:-}" ] && extra+=(--export-every "$EXPORT_EVERY")
PROCS=${PROCS:-1}
launcher=("$PY" -m model.train)
if [ "$PROCS" -gt 1 ]; then
  launcher=("$(dirname "$PY")/accelerate" launch --multi_gpu --num_processes "$PROCS" --num_machines 1
            --mixed_precision no --dynamo_backend no -m model.train)   # the trainer sets its own precision
fi

gen=("$PY" -m model.self_answers --base "$BASE" --data "$DATA" --out "$ANSWERS_FILE" --batch-size "$ANSWER_BATCH"
     --max-new-tokens "$MAX_NEW" "${limit[@]}" "${threads[@]}")
TRAIN_DATA=$ANSWERS_FILE
general=(); mix=()
if [ "$MAGPIE" -gt 0 ]; then
  TRAIN_DATA=$MAGPIE_DIR/train_mix.jsonl
  general=("$PY" -m model.magpie instructions --base "$BASE" --out "$MAGPIE_DIR/instructions.jsonl" --count "$MAGPIE"
           --batch-size "${MAGPIE_BATCH:-64}" --max-new-tokens 80 "${threads[@]}")
  general_answers=("$PY" -m model.self_answers --base "$BASE" --data "$MAGPIE_DIR/instructions.jsonl"
                   --out "$MAGPIE_DIR/answers.jsonl" --batch-size "$ANSWER_BATCH" --max-new-tokens 160 "${threads[@]}")
  mix=("$PY" -m model.magpie mix --out "$TRAIN_DATA" "$MAGPIE_DIR/answers.jsonl=$GENERAL_SHARE" "$ANSWERS_FILE=1")
fi
train=("${launcher[@]}" --base "$BASE" --data "$TRAIN_DATA" --output "$OUT" --adapter alora --lora-rank "$LORA_RANK"
       --k-max 4 --spacing 4 --lr "${LR:-1e-3}" --lr-schedule "$LR_SCHEDULE" --warmup "${WARMUP:-20}"
       --batch-size "$BATCH" --seq-len "$SEQ_LEN" --max-steps "$MAX_STEPS"
       --save-every "$SAVE_EVERY" --keep-checkpoints 1 --compact-checkpoints --log-every 1 --seed "${SEED:-0}"
       --save-dtype bfloat16 --mixed-precision auto "${budget[@]}" "${threads[@]}" "${extra[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  [ "$MAGPIE" -gt 0 ] && { echo "${general[*]}"; echo "${general_answers[*]}"; }
  echo "${gen[*]}"
  [ "$MAGPIE" -gt 0 ] && echo "${mix[*]}"
  echo "${train[*]} [--resume auto]"; exit 0
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0} TOKENIZERS_PARALLELISM=false
[ $GPU = 0 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${THREADS:-1}}
mkdir -p "$OUT" "$(dirname "$ANSWERS_FILE")"
if [ "$MAGPIE" -gt 0 ]; then "${general[@]}"; "${general_answers[@]}"; fi
"${gen[@]}"
if [ "$MAGPIE" -gt 0 ]; then "${mix[@]}"; fi
ls "$OUT"/checkpoint-* >/dev/null 2>&1 && train+=(--resume auto)
"${train[@]}"
du -sh "$OUT"
if [ "${PUBLISH:-0}" = 1 ]; then
  mkdir -p assets/smollm2-135m-mtp
  cp "$OUT"/final/* assets/smollm2-135m-mtp/
fi
