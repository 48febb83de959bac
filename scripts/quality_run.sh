#!/usr/bin/env bash
# The quality run on one machine: regenerate chats with the target, train a drafter on them with
# a held-out validation split (walked tau every EVAL_EVERY steps, the best checkpoint exported),
# evaluate it at T=0 on MT-Bench, HumanEval and GSM8K, and measure walked against served tau on
# the held-out conversations. Run from the repository root:
#
#   scripts/quality_run.sh                                   # one GPU: the full run
#   TRAIN_GPUS=2 scripts/quality_run.sh                      # training on 2 GPUs
#   TARGET=bundled:tiny-random-llama NUM_RECORDS=6 SOURCES=word-problems:3 MAX_NEW_TOKENS=8 TRAIN_STEPS=4 \
#     TRAIN_ARGS= REGEN_ARGS="--temperature 5" VALIDATION=2 EVAL_EVERY=2 EVAL_LIMIT=2 EVAL_MAX_NEW_TOKENS=16 \
#     EVAL_BATCH_SIZE=2 DEVICE=cpu WORKERS=1 OUT=/tmp/qr scripts/quality_run.sh   # CPU smoke test
#
# Knobs (environment variables; defaults in brackets):
#   TARGET [bundled:smollm2-135m-instruct]   target model folder or bundled name
#   DATA [the bundled ShareGPT JSON]         chat file to regenerate
#   NUM_RECORDS [all]                        conversations to regenerate (the output is resumed
#                                            up to this many; rerunning the script skips done work)
#   REGEN_TIME_S [0: none]                   stop the regeneration after this many seconds and go
#                                            on with what it wrote (a rerun resumes it)
#   MAX_NEW_TOKENS [320]                     longest regenerated response (a small model's greedy
#                                            loops otherwise run to the 2048 default)
#   MAX_PROMPT_LENGTH [1024]                 conversations are cut where a prompt grows past this
#   REGEN_BATCH_SIZE [1024]                  turns decoded at once by the decoding engine (a finished
#                                            row is refilled with the next waiting turn)
#   REGEN_WORKERS [1]                        regeneration processes (one engine keeps a GPU busy)
#   REGEN_ARGS []                            more `data regenerate` options (the smoke test samples:
#                                            the random tiny target answers blank lines below T~5)
#   SOURCES [the recipe's]                   offline prompt sources to regenerate and train on too,
#                                            "name:count ..." (`dflash-train data source`; recipe.py's
#                                            QUALITY_SOURCES: "python-functions:10000
#                                            word-problems:4000 python-packages:8000");
#                                            SOURCES= for none
#   SOURCE_SAMPLES [0]                       more answers per source prompt: each source regenerated
#                                            this many more times, sampled (seeds 1..N) at
#   SAMPLE_TEMPERATURE [1.0]  SAMPLE_TOP_P [0.95]   these settings, and trained on too (the
#                                            validation split keeps a prompt's answers together)
#   EXTRA_DATA []                            more training data as it is (not regenerated): chat
#                                            files or prepared folders, comma-separated
#   TRAIN_STEPS [3300]  TRAIN_TIME_S [900]   training ends at whichever comes first; the LR
#                                            schedule follows TRAIN_STEPS (3,300 steps took
#                                            587 s on one H200 on all 17K conversations)
#   TRAIN_ARGS [the measured recipe]         section.key=value overrides for `train` (recipe.py's
#                                            QUALITY_TRAIN_ARGS: 5 layers,
#                                            16K-token batches, 512 anchors, lr 1e-3, compiled
#                                            target and drafter, D-PACE weights, loop tails
#                                            skipped); TRAIN_ARGS= for none
#   VALIDATION [128]                         conversations held out (data.validation); the run
#                                            writes them to OUT/train/validation.jsonl
#   EVAL_EVERY [400]                         walked validation tau every this many steps; the
#                                            checkpoint with the best one is exported (keep_best)
#   TRAIN_GPUS [1]                           above 1: training under torchrun, one colocated
#                                            replica per GPU (each takes its own batches)
#   EVAL_LIMIT [500]                         first N records of each prompt set (MT-Bench has 80,
#                                            HumanEval 164, GSM8K 1319)
#   VAL_LIMIT [64]                           held-out records served for the walked-vs-served check
#   EVAL_MAX_NEW_TOKENS [256]  SPEEDUP_TURNS [10]
#   EVAL_BATCH_SIZE [32]                     prompts decoded together by each evaluation worker
#   WORKERS [4]                              evaluation processes (spread over the visible GPUs)
#   DEVICE [auto]  OUT [runs/quality]  PYTHON [.venv/bin/python if present, else python3]
# The package is run as `python -m dflash_train` with this checkout on PYTHONPATH, so an
# installed `dflash-train` is not needed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
TARGET="${TARGET:-bundled:smollm2-135m-instruct}"
NUM_RECORDS="${NUM_RECORDS:-1000000000}"  # all
REGEN_TIME_S="${REGEN_TIME_S:-0}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-320}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-1024}"
REGEN_BATCH_SIZE="${REGEN_BATCH_SIZE:-1024}"
REGEN_WORKERS="${REGEN_WORKERS:-1}"
REGEN_ARGS="${REGEN_ARGS:-}"
EXTRA_DATA="${EXTRA_DATA:-}"
SOURCE_SAMPLES="${SOURCE_SAMPLES:-0}"
SAMPLE_TEMPERATURE="${SAMPLE_TEMPERATURE:-1.0}"
SAMPLE_TOP_P="${SAMPLE_TOP_P:-0.95}"
SOURCES="${SOURCES-$("$PYTHON" -c 'from dflash_train.app.recipe import QUALITY_SOURCES; print(*(f"{n}:{c}" for n, c in QUALITY_SOURCES))')}"  # empty: none
TRAIN_STEPS="${TRAIN_STEPS:-3300}"
TRAIN_TIME_S="${TRAIN_TIME_S:-900}"
TRAIN_ARGS="${TRAIN_ARGS-$("$PYTHON" -c 'from dflash_train.app.recipe import QUALITY_TRAIN_ARGS; print(*QUALITY_TRAIN_ARGS)')}"  # empty: none
TRAIN_GPUS="${TRAIN_GPUS:-1}"
VALIDATION="${VALIDATION:-128}"
EVAL_EVERY="${EVAL_EVERY:-400}"
VAL_LIMIT="${VAL_LIMIT:-64}"
EVAL_LIMIT="${EVAL_LIMIT:-500}"
EVAL_MAX_NEW_TOKENS="${EVAL_MAX_NEW_TOKENS:-256}"
SPEEDUP_TURNS="${SPEEDUP_TURNS:-10}"
EVAL_BATCH_SIZE="${EVAL_BATCH_SIZE:-32}"
WORKERS="${WORKERS:-4}"
DEVICE="${DEVICE:-auto}"
OUT="${OUT:-runs/quality}"
DATA="${DATA:-$("$PYTHON" -c 'from dflash_train.core.assets import sharegpt_json; print(sharegpt_json())')}"
CLI=("$PYTHON" -m dflash_train)
mkdir -p "$OUT"
REGEN="$OUT/regenerated.jsonl"

now() { date +%s.%N; }
declare -A SECONDS_OF
stage() {  # stage NAME COMMAND...: run it, print and keep its wall time
  local name="$1"; shift
  echo "== $name: $*"
  local started; started="$(now)"
  local rc=0
  "$@" || rc=$?
  if (( rc != 0 )) && ! [[ $name == regenerate && $REGEN_TIME_S -gt 0 && ( $rc == 124 || $rc == 130 ) ]]; then
    echo "== $name failed (exit $rc)"; exit "$rc"
  fi
  SECONDS_OF[$name]="$(awk -v a="$started" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')"
  echo "== $name took ${SECONDS_OF[$name]} s"
}

# (a) regeneration, resumed up to NUM_RECORDS lines (REGEN_TIME_S: stopped there, kept)
have=0
[[ -f "$REGEN" ]] && have="$(wc -l < "$REGEN")"
if (( have < NUM_RECORDS )); then
  BOX=()
  (( REGEN_TIME_S > 0 )) && BOX=(timeout -s INT "$REGEN_TIME_S")
  # shellcheck disable=SC2086  # REGEN_ARGS is a list of options
  stage regenerate "${BOX[@]}" "${CLI[@]}" data regenerate --data "$DATA" --target "$TARGET" --out "$REGEN" \
    --limit "$((NUM_RECORDS - have))" --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-length "$MAX_PROMPT_LENGTH" \
    --batch-size "$REGEN_BATCH_SIZE" --workers "$REGEN_WORKERS" --device "$DEVICE" $REGEN_ARGS
else
  echo "== regenerate: $REGEN already holds $have records"; SECONDS_OF[regenerate]=0
fi
echo "== regenerated: $(wc -l < "$REGEN") records in $REGEN"

# (a') offline prompt sources (SOURCES="name:count ..."): written by `data source`, regenerated
# the same way (resumed), trained on beside the chats
TRAIN_DATA="$REGEN" SOURCES_S=0
answer() {  # answer STAGE PROMPTS OUT [more regenerate options]: OUT resumed up to every prompt, trained on
  local name="$1" prompts="$2" answered="$3"; shift 3
  local have=0
  [[ -f "$answered" ]] && have="$(wc -l < "$answered")"
  if (( have < $(wc -l < "$prompts") )); then
    # shellcheck disable=SC2086  # REGEN_ARGS is a list of options; the caller's options come after it
    stage "$name" "${CLI[@]}" data regenerate --data "$prompts" --target "$TARGET" --out "$answered" \
      --max-new-tokens "$MAX_NEW_TOKENS" --max-prompt-length "$MAX_PROMPT_LENGTH" --batch-size "$REGEN_BATCH_SIZE" \
      --workers "$REGEN_WORKERS" --device "$DEVICE" $REGEN_ARGS "$@"
  fi
  echo "== regenerated: $(wc -l < "$answered") records in $answered"
  TRAIN_DATA="$TRAIN_DATA,$answered"
  SOURCES_S="$(awk -v a="$SOURCES_S" -v b="${SECONDS_OF[$name]:-0}" 'BEGIN { printf "%.1f", a + b }')"
}
for item in $SOURCES; do
  name="${item%%:*}" count="${item#*:}"
  [[ "$name" != "$item" && "$count" =~ ^[0-9]+$ ]] || { echo "SOURCES: $item is not name:count"; exit 2; }
  prompts="$OUT/source-$name.jsonl"
  # rewritten every time (seconds): the same name, count and seed give the same lines, and a larger
  # count the same first lines, so a partial regeneration of it resumes
  "${CLI[@]}" data source --source "$name" --limit "$count" --out "$prompts"
  answer "regenerate_$name" "$prompts" "$OUT/regenerated-$name.jsonl"
  for ((k = 1; k <= SOURCE_SAMPLES; k++)); do  # sampled answers to the same prompts
    answer "regenerate_${name}_s$k" "$prompts" "$OUT/regenerated-$name-t$SAMPLE_TEMPERATURE-p$SAMPLE_TOP_P-s$k.jsonl" \
      --temperature "$SAMPLE_TEMPERATURE" --top-p "$SAMPLE_TOP_P" --seed "$k"
  done
done

[[ -n "$EXTRA_DATA" ]] && TRAIN_DATA="$TRAIN_DATA,$EXTRA_DATA"

# (b) training: the embedded default drafter (block 16) on the regenerated chats (and sources)
TRAIN_CLI=("${CLI[@]}")
if (( TRAIN_GPUS > 1 )); then
  TRAIN_CLI=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$TRAIN_GPUS" -m dflash_train)
fi
LOG_EVERY=10
while (( EVAL_EVERY % LOG_EVERY )); do LOG_EVERY=$((LOG_EVERY - 1)); done  # eval.every: a multiple of log.every
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of overrides
stage train "${TRAIN_CLI[@]}" train --output-dir "$OUT/train" "data.paths=[$TRAIN_DATA]" "target.path=$TARGET" \
  "train.max_steps=$TRAIN_STEPS" "train.max_time_s=$TRAIN_TIME_S" "train.device=$DEVICE" \
  "data.validation=$VALIDATION" "eval.every=$EVAL_EVERY" eval.prompts=null "log.every=$LOG_EVERY" \
  "checkpoint.every=$EVAL_EVERY" checkpoint.keep=1 checkpoint.keep_best=true $TRAIN_ARGS

# (c) evaluation at T=0 of the exported (best walked) drafter
stage eval "${CLI[@]}" eval --target "$TARGET" --drafter "$OUT/train/drafter" \
  --prompts mt-bench,humaneval,gsm8k --limit "$EVAL_LIMIT" --max-new-tokens "$EVAL_MAX_NEW_TOKENS" \
  --temperature 0 --speedup-turns "$SPEEDUP_TURNS" --workers "$WORKERS" --batch-size "$EVAL_BATCH_SIZE" --device "$DEVICE" \
  --output "$OUT/eval.json"

# (d) walked against served tau on the same held-out conversations
HELD="$OUT/train/validation.jsonl"
stage walk_validation "${CLI[@]}" eval --target "$TARGET" --drafter "$OUT/train/drafter" --walk "$HELD" \
  --limit "$VAL_LIMIT" --device "$DEVICE" --output "$OUT/validation-walked.json"
stage serve_validation "${CLI[@]}" eval --target "$TARGET" --drafter "$OUT/train/drafter" --prompts "$HELD" \
  --limit "$VAL_LIMIT" --max-new-tokens "$MAX_NEW_TOKENS" --temperature 0 --speedup-turns 0 --workers "$WORKERS" \
  --batch-size "$EVAL_BATCH_SIZE" --device "$DEVICE" --output "$OUT/validation-served.json"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
walked, served = (json.loads((out / f"validation-{k}.json").read_text())["tau"] for k in ("walked", "served"))
doc = {"walked_tau": walked, "served_tau": served, "walked_over_served": walked / served}
(out / "validation-tau.json").write_text(json.dumps(doc, indent=1) + "\n")
print(f"== validation: walked tau {walked:.3f}, served tau {served:.3f} (walked / served {walked / served:.3f})")
PY

cat > "$OUT/timings.json" <<JSON
{"regenerate_s": ${SECONDS_OF[regenerate]}, "regenerate_sources_s": $SOURCES_S, "sources": "$SOURCES", "train_s": ${SECONDS_OF[train]}, "eval_s": ${SECONDS_OF[eval]},
 "walk_validation_s": ${SECONDS_OF[walk_validation]}, "serve_validation_s": ${SECONDS_OF[serve_validation]},
 "extra_data": "$EXTRA_DATA", "source_samples": $SOURCE_SAMPLES,
 "sample_temperature": $SAMPLE_TEMPERATURE, "sample_top_p": $SAMPLE_TOP_P, "regen_time_s": $REGEN_TIME_S, "validation": $VALIDATION, "eval_every": $EVAL_EVERY, "val_limit": $VAL_LIMIT,
 "target": "$TARGET", "num_records": $NUM_RECORDS, "max_new_tokens": $MAX_NEW_TOKENS, "max_prompt_length": $MAX_PROMPT_LENGTH,
 "train_steps": $TRAIN_STEPS, "train_gpus": $TRAIN_GPUS, "train_args": "$TRAIN_ARGS",
 "train_time_s": $TRAIN_TIME_S, "eval_limit": $EVAL_LIMIT, "eval_max_new_tokens": $EVAL_MAX_NEW_TOKENS, "eval_batch_size": $EVAL_BATCH_SIZE,
 "workers": $WORKERS, "regen_workers": $REGEN_WORKERS, "device": "$DEVICE"}
JSON
echo "== timings: regenerate ${SECONDS_OF[regenerate]} s, train ${SECONDS_OF[train]} s, eval ${SECONDS_OF[eval]} s"
echo "== wrote $OUT/eval.json, $OUT/eval.md, $OUT/eval.png, $OUT/validation-tau.json, $OUT/timings.json;" \
  "the run's plots: $OUT/train/plots/run.png"
