"""Device time of one lm_head loss chunk on a CUDA GPU: the two matrix products alone, the
compiled torch chunk (train.loss_kernel=torch with train.compile) and the Triton kernel's chunk
(train.loss_kernel=triton) for each pair of columns per loop step and warps given; bf16, hard
labels, with the input gradient, as the trainer runs a full chunk. Prints one JSON line per
(vocabulary, variant): milliseconds per chunk (median of the repeats, CUDA events).

    python scripts/loss_chunk_timing.py --rows 4096 --shapes 576x49152 4096x151936 \\
        --blocks 2048 4096 8192 --warps 4 8 16

The shapes are SmolLM2's (hidden 576, vocabulary 49,152) and Qwen3-8B's (4,096, 151,936)."""

import argparse
import json
import statistics

import torch

from dflash_train.core.loss import compiled_chunk
from dflash_train.core.loss_kernel import triton_hard_chunk_loss


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--shapes", nargs="+", default=["576x49152", "4096x151936"], help="HIDDENxVOCAB")
    ap.add_argument("--blocks", nargs="+", type=int, default=[2048, 4096, 8192])
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    compiled = compiled_chunk(False)
    for shape in args.shapes:
        H, V = (int(x) for x in shape.split("x"))
        h = torch.randn(args.rows, H, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
        labels = torch.randint(0, V, (args.rows,), device="cuda", generator=g)

        def products():
            return (h @ w.t()) @ w

        rows = [("matmuls only", products), ("torch compiled", lambda: compiled(h, w, labels, True))]
        for block in args.blocks:
            for warps in args.warps:
                rows.append((f"triton block {block} warps {warps}",
                             lambda b=block, nw=warps: triton_hard_chunk_loss(h, w, labels, True, block=b, num_warps=nw)))
        for name, fn in rows:
            ms = timed(fn, args.repeats)
            print(json.dumps({"hidden": H, "vocab": V, "rows": args.rows, "variant": name, "ms": round(ms, 3)}), flush=True)


if __name__ == "__main__":
    main()
