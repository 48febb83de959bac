"""Device time of the drafter's block attention alone on a CUDA GPU: one flex-attention call
(forward, and forward + backward) on a packed row laid out as the `smollm2` bench lays it, with
the mask rule's BlockMask (`masks.layout_block_mask`), for each kernel setting asked for. Prints
one JSON line per setting: milliseconds per call (CUDA events, mean of the repeats after
warm-up), the useful TFLOP/s of each, and the largest difference from the first setting's
output and gradients.

    python scripts/flex_timing.py --settings default flash --layout strided

Settings: `default` (the trainer's kernel options for this head dim, compilation.
flex_kernel_options; the kernel the trainer hands the drafter adds IS_DIVISIBLE where both
lengths are multiples of 128, as the default row's are), `torch` (torch's own choice), `flash` (BACKEND=FLASH: flex's CuTe-DSL
kernels; needs the flash-attn-4 package and its nvidia-cutlass-dsl libraries), `prescale`
(`default` plus bwd_PRESCALE_QK). The row: documents of uniform random length in
[--min-length, --max-length] packed until --tokens, the last half of each supervised, up to
--anchors anchors per document (`masks.sample_anchors`), blocks of --block-size, each document
started at a multiple of --align tokens when given (the trainer's placement,
`masks.document_starts`); heads and head
dim SmolLM2-135M's by default (9 query heads, 3 key/value heads, 64). `--layout strided` hands
the kernel [1, S, heads, dim] memory seen as [1, heads, S, dim], as the drafter's layers do.

`--tiles` only counts the row's BlockMask tiles by kind (context keys or the blocks' own keys,
full or partial: `tile_counts`) and prints them; it runs on any device, CPU included.

    python scripts/flex_timing.py --tiles --seed 3"""

import argparse
import json

import torch

from dflash_train.core import drafter, masks
from dflash_train.train.compilation import compile_flex_attention, flex_kernel_options


def packed_row(args, device):
    """The row's layout and its documents' lengths. With `args.align` (> 0) the documents are
    placed as the trainer places them where they fit (`masks.document_starts`), each at a
    multiple of it with an unsupervised gap before the next, and the row grows to a multiple of
    128 tokens past --tokens as needed: the same documents and, since anchors are drawn by keys
    per position within each document, the same anchors, their starts on tile boundaries."""
    g = torch.Generator().manual_seed(args.seed)
    lengths, total = [], 0
    while True:
        n = int(torch.randint(args.min_length, args.max_length + 1, (1,), generator=g))
        if total + n > args.tokens:
            break
        lengths.append(n)
        total += n
    align = max(1, getattr(args, "align", 0))
    doc_lengths = torch.tensor(lengths)
    starts = masks.document_starts(doc_lengths, align).tolist()
    tokens = max(args.tokens, -(-starts[-1] // 128) * 128)
    loss_mask = torch.zeros(tokens, dtype=torch.bool)
    for start, n in zip(starts, lengths):
        loss_mask[start + n // 2: start + n] = True
    doc_lengths, loss_mask = doc_lengths.to(device), loss_mask.to(device)
    anchors = masks.sample_anchors(loss_mask, doc_lengths, args.anchors,
                                   generator=torch.Generator(device=device).manual_seed(args.seed),
                                   pad_to_multiple=64, align=align)
    return masks.build_layout(anchors, loss_mask, doc_lengths, args.block_size, align), lengths


def tile_counts(block_mask, num_ctx: int) -> dict:
    """Kept tiles of a BlockMask by kind: keys all in the context ([0, num_ctx)), all among the
    blocks' own keys (from num_ctx on), or straddling both; each full or partial."""
    tile = block_mask.BLOCK_SIZE[1]
    counts = {}
    for kind, num, idx in (("partial", block_mask.kv_num_blocks, block_mask.kv_indices),
                           ("full", block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            continue
        num, idx = num.flatten(0, -2)[0].cpu(), idx.flatten(0, -3)[0].cpu()
        kept = idx[torch.arange(idx.shape[-1])[None, :] < num[:, None]].long()
        context = (kept + 1) * tile <= num_ctx
        own = kept * tile >= num_ctx
        counts[f"context_{kind}"] = int(context.sum())
        counts[f"block_own_{kind}"] = int(own.sum())
        counts[f"straddling_{kind}"] = int((~context & ~own).sum())
    return counts


def options(setting: str, head_dim: int) -> dict:
    if setting == "default":
        return flex_kernel_options(None, head_dim)
    if setting == "torch":
        return {}
    if setting == "flash":
        return {"BACKEND": "FLASH"}
    if setting == "prescale":
        return {**flex_kernel_options(None, head_dim), "bwd_PRESCALE_QK": True}
    raise SystemExit(f"unknown setting {setting!r}: choose default, torch, flash or prescale")


def mean_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", default=["default"])
    p.add_argument("--layout", choices=("contiguous", "strided"), default="strided")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min-length", type=int, default=128)
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--align", type=int, default=0, metavar="N",
                   help="start every document at a multiple of N tokens (unsupervised gaps between them)")
    p.add_argument("--tiles", action="store_true", help="count the BlockMask's tiles by kind and stop")
    args = p.parse_args()
    if args.tiles:
        layout, lengths = packed_row(args, torch.device("cpu"))
        block_mask = masks.layout_block_mask(layout)
        print(json.dumps({"documents": len(lengths), "tokens": sum(lengths), "blocks": layout.num_blocks,
                          "query_tiles": block_mask.kv_num_blocks.shape[-1],
                          **tile_counts(block_mask, layout.num_ctx)}))
        return
    if not torch.cuda.is_available():
        raise SystemExit("flex_timing.py times CUDA kernels: no CUDA device is visible")
    device = torch.device("cuda")
    layout, lengths = packed_row(args, device)
    block_mask = masks.layout_block_mask(layout)
    Q = layout.num_blocks * args.block_size
    KV = layout.num_ctx + Q
    pairs = float(layout.visible_pairs())
    fwd_flops = 4.0 * args.head_dim * args.heads * pairs  # QK^T and PV, 2 FLOPs per multiply-add
    print(json.dumps({"documents": len(lengths), "tokens": sum(lengths), "blocks": layout.num_blocks,
                      "queries": Q, "keys": KV, "visible_pairs": pairs}), flush=True)

    g = torch.Generator(device=device).manual_seed(args.seed)

    def tensor(heads, length):
        if args.layout == "strided":
            return torch.randn(1, length, heads, args.head_dim, device=device, generator=g,
                               dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(1, heads, length, args.head_dim, device=device, generator=g, dtype=torch.bfloat16)

    q0, k0, v0, grad_out = tensor(args.heads, Q), tensor(args.kv_heads, KV), tensor(args.kv_heads, KV), tensor(args.heads, Q)
    first = None
    for setting in args.settings:
        opts = options(setting, args.head_dim)
        compile_flex_attention(opts)  # as training compiles it (one kernel per shape, these options)
        kernel = drafter.flex_kernel

        def call(q, k, v):
            return kernel(q, k, v, block_mask=block_mask, scale=args.head_dim ** -0.5, enable_gqa=True)

        q, k, v = (t.detach().clone().requires_grad_() for t in (q0, k0, v0))
        try:
            out = call(q, k, v)
            out.backward(grad_out)
        except Exception as e:  # noqa: BLE001 - a setting this machine cannot run is reported, not fatal
            print(json.dumps({"setting": setting, "error": f"{type(e).__name__}: {str(e)[:500]}"}), flush=True)
            continue
        result = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
        with torch.no_grad():
            fwd = mean_ms(lambda: call(q0, k0, v0), args.repeats)

        def forward_backward():
            q.grad = k.grad = v.grad = None
            call(q, k, v).backward(grad_out)

        both = mean_ms(forward_backward, args.repeats)
        line = {"setting": setting, "options": opts, "layout": args.layout, "forward_ms": round(fwd, 3),
                "forward_backward_ms": round(both, 3), "backward_ms": round(both - fwd, 3),
                "forward_tflops": round(fwd_flops / fwd / 1e9, 1),
                "backward_tflops": round(2 * fwd_flops / (both - fwd) / 1e9, 1)}
        if first is None:
            first = result
        else:
            line["max_abs_diff_out_dq_dk_dv"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(result, first)]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
