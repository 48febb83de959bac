#!/usr/bin/env bash
# Check that the distributed topologies train on the same numbers as one process, on this
# machine's devices: the first 20 losses of the tiny config for
#   disaggregated 1 target + 1 drafter (and with split fc layers)  vs  one process, grad_accum 1
#   colocated on 2 ranks                                           vs  one process, grad_accum 2
# Run from the repository root; DEVICE=cuda (2 GPUs, NCCL) or DEVICE=cpu (gloo). OUT holds the
# runs; the last lines print the largest loss difference of each pair.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off (shared machines); harmless elsewhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-runs/topology-check}"
STEPS="${STEPS:-20}"
mkdir -p "$OUT"
TRAIN=(-m dflash_train train --config "$ROOT/configs/tiny.yaml" "train.device=$DEVICE" "train.max_steps=$STEPS"
       log.every=1 checkpoint.every=100000)
ONE=("$PYTHON")
TWO=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2)
DISAGG=(topology.mode=disaggregated topology.num_target_ranks=1)
run() {  # run NAME LAUNCHER... -- OVERRIDES...
  local name="$1"; shift
  echo "== $name"
  "$@" > "$OUT/$name.log" 2>&1 || { tail -n 20 "$OUT/$name.log"; exit 1; }
}
rm -rf "$OUT"/{one,one_accum2,disagg,disagg_split,colocated}
CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" run one "${ONE[@]}" "${TRAIN[@]}" --output-dir "$OUT/one"
run disagg "${TWO[@]}" "${TRAIN[@]}" --output-dir "$OUT/disagg" "${DISAGG[@]}"
run disagg_split "${TWO[@]}" "${TRAIN[@]}" --output-dir "$OUT/disagg_split" "${DISAGG[@]}" topology.split_fc=true
CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" run one_accum2 "${ONE[@]}" "${TRAIN[@]}" --output-dir "$OUT/one_accum2" train.grad_accum=2
run colocated "${TWO[@]}" "${TRAIN[@]}" --output-dir "$OUT/colocated"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def losses(run):
    rows = (json.loads(line) for line in open(f"{out}/{run}/metrics.jsonl"))
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
for ref, runs in (("one", ("disagg", "disagg_split")), ("one_accum2", ("colocated",))):
    a = losses(ref)
    for run in runs:
        b = losses(run)
        worst = max(abs(a[s] - b[s]) / max(1.0, abs(a[s])) for s in a)
        print(f"{run} vs {ref}: {len(b)} of {len(a)} steps, largest relative loss difference {worst:.2e}")
PY
