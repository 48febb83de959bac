#!/usr/bin/env bash
# The quality run on one machine: regenerate chats with the target, train a drafter on them,
# evaluate it on MT-Bench, HumanEval and GSM8K at T=0. Run from the repository root:
#
#   scripts/quality_run.sh                                   # one GPU: the full run
#   TRAIN_GPUS=2 scripts/quality_run.sh                      # training on 2 GPUs (README attempt 3)
#   TARGET=bundled:tiny-random-llama NUM_RECORDS=4 MAX_NEW_TOKENS=8 TRAIN_STEPS=4 TRAIN_ARGS= REGEN_ARGS="--temperature 5" \
#     EVAL_LIMIT=2 EVAL_MAX_NEW_TOKENS=16 EVAL_BATCH_SIZE=2 DEVICE=cpu WORKERS=2 OUT=/tmp/qr scripts/quality_run.sh
#                                                            # CPU smoke test
#
# Knobs (environment variables; defaults in brackets):
#   TARGET [bundled:smollm2-135m-instruct]   target model folder or bundled name
#   DATA [the bundled ShareGPT JSON]         chat file to regenerate
#   NUM_RECORDS [4096]                       conversations to regenerate (the output is resumed
#                                            up to this many; rerunning the script skips done work)
#   MAX_NEW_TOKENS [320]                     longest regenerated response (a small model's greedy
#                                            loops otherwise run to the 2048 default)
#   MAX_PROMPT_LENGTH [1024]                 conversations are cut where a prompt grows past this
#   REGEN_BATCH_SIZE [512]                   turns decoded at once by the decoding engine (a finished
#                                            row is refilled with the next waiting turn)
#   REGEN_WORKERS [1]                        regeneration processes (one engine keeps a GPU busy)
#   REGEN_ARGS []                            more `data regenerate` options (the smoke test samples:
#                                            the random tiny target answers blank lines below T~5)
#   TRAIN_STEPS [1500]  TRAIN_TIME_S [570]   training ends at whichever comes first; the LR
#                                            schedule follows TRAIN_STEPS
#   TRAIN_ARGS [README attempt 3's]          section.key=value overrides for `train` (5 layers,
#                                            16K-token batches, 512 anchors, lr 1e-3, compiled
#                                            target and drafter); TRAIN_ARGS= for none
#   TRAIN_GPUS [1]                           above 1: training under torchrun, one colocated
#                                            replica per GPU (each takes its own batches)
#   EVAL_LIMIT [200]                         first N records of each prompt set
#   EVAL_MAX_NEW_TOKENS [256]  SPEEDUP_TURNS [10]
#   EVAL_BATCH_SIZE [32]                     prompts decoded together by each evaluation worker
#   WORKERS [4]                              evaluation processes (spread over the visible GPUs)
#   DEVICE [auto]  OUT [runs/quality]  PYTHON [.venv/bin/python if present, else python3]
# The package is run as `python -m dflash_train.cli` with this checkout on PYTHONPATH, so an
# installed `dflash-train` is not needed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TARGET="${TARGET:-bundled:smollm2-135m-instruct}"
NUM_RECORDS="${NUM_RECORDS:-4096}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-320}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-1024}"
REGEN_BATCH_SIZE="${REGEN_BATCH_SIZE:-512}"
REGEN_WORKERS="${REGEN_WORKERS:-1}"
REGEN_ARGS="${REGEN_ARGS:-}"
TRAIN_STEPS="${TRAIN_STEPS:-1500}"
TRAIN_TIME_S="${TRAIN_TIME_S:-570}"
TRAIN_ARGS="${TRAIN_ARGS-drafter.num_layers=5 data.max_length=2048 data.token_budget=16384 data.max_batch_size=64 \
objective.num_anchors=512 optim.lr=1e-3 target.compile=true train.compile=true}"  # empty: none
TRAIN_GPUS="${TRAIN_GPUS:-1}"
EVAL_LIMIT="${EVAL_LIMIT:-200}"
EVAL_MAX_NEW_TOKENS="${EVAL_MAX_NEW_TOKENS:-256}"
SPEEDUP_TURNS="${SPEEDUP_TURNS:-10}"
EVAL_BATCH_SIZE="${EVAL_BATCH_SIZE:-32}"
WORKERS="${WORKERS:-4}"
DEVICE="${DEVICE:-auto}"
OUT="${OUT:-runs/quality}"
DATA="${DATA:-$("$PYTHON" -c 'from dflash_train.assets import sharegpt_json; print(sharegpt_json())')}"
CLI=("$PYTHON" -m dflash_train.cli)
mkdir -p "$OUT"
REGEN="$OUT/regenerated.jsonl"

now() { date +%s.%N; }
declare -A SECONDS_OF
stage() {  # stage NAME COMMAND...: run it, print and keep its wall time
  local name="$1"; shift
  echo "== $name: $*"
  local started; started="$(now)"
  "$@"
  SECONDS_OF[$name]="$(awk -v a="$started" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
  echo "== $name took ${SECONDS_OF[$name]} s"
}

# (a) regeneration, resumed up to NUM_RECORDS lines
have=0
[[ -f "$REGEN" ]] && have="$(wc -l < "$REGEN")"
if (( have < NUM_RECORDS )); then
  stage regenerate "${CLI[@]}" data regenerate --data "$DATA" --target "$TARGET" --out "$REGEN" \
    --limit "$((NUM_RECORDS - have))" --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-length "$MAX_PROMPT_LENGTH" \
    --batch-size "$REGEN_BATCH_SIZE" \
    --workers "$REGEN_WORKERS" --device "$DEVICE" $REGEN_ARGS  # shellcheck disable=SC2086
else
  echo "== regenerate: $REGEN already holds $have records"; SECONDS_OF[regenerate]=0
fi

# (b) training: the embedded default drafter (block 16) on the regenerated chats
TRAIN_CLI=("${CLI[@]}")
if (( TRAIN_GPUS > 1 )); then
  TRAIN_CLI=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$TRAIN_GPUS" -m dflash_train.cli)
fi
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of overrides
stage train "${TRAIN_CLI[@]}" train --output-dir "$OUT/train" "data.paths=[$REGEN]" "target.path=$TARGET" \
  "train.max_steps=$TRAIN_STEPS" "train.max_time_s=$TRAIN_TIME_S" "train.device=$DEVICE" \
  "checkpoint.every=$TRAIN_STEPS" $TRAIN_ARGS

# (c) evaluation at T=0
stage eval "${CLI[@]}" eval --target "$TARGET" --drafter "$OUT/train/drafter" \
  --prompts mt-bench,humaneval,gsm8k --limit "$EVAL_LIMIT" --max-new-tokens "$EVAL_MAX_NEW_TOKENS" \
  --temperature 0 --speedup-turns "$SPEEDUP_TURNS" --workers "$WORKERS" --batch-size "$EVAL_BATCH_SIZE" --device "$DEVICE" \
  --output "$OUT/eval.json"

cat > "$OUT/timings.json" <<JSON
{"regenerate_s": ${SECONDS_OF[regenerate]}, "train_s": ${SECONDS_OF[train]}, "eval_s": ${SECONDS_OF[eval]},
 "target": "$TARGET", "num_records": $NUM_RECORDS, "max_new_tokens": $MAX_NEW_TOKENS, "max_prompt_length": $MAX_PROMPT_LENGTH,
 "train_steps": $TRAIN_STEPS, "train_gpus": $TRAIN_GPUS, "train_args": "$TRAIN_ARGS",
 "train_time_s": $TRAIN_TIME_S, "eval_limit": $EVAL_LIMIT, "eval_max_new_tokens": $EVAL_MAX_NEW_TOKENS, "eval_batch_size": $EVAL_BATCH_SIZE,
 "workers": $WORKERS, "regen_workers": $REGEN_WORKERS, "device": "$DEVICE"}
JSON
echo "== timings: regenerate ${SECONDS_OF[regenerate]} s, train ${SECONDS_OF[train]} s, eval ${SECONDS_OF[eval]} s"
echo "== wrote $OUT/eval.json, $OUT/eval.md, $OUT/eval.png, $OUT/timings.json"
