"""Float32 losslessness of the decoding engine on a real target, on any device: for the first
turn of the first K prompts of MT-Bench, HumanEval and GSM8K, the engine's target-only output
(the slot decoder, CUDA graphs on a GPU) and its speculative output (a random 1-layer drafter of
block 16, so that every token comes out of a verify step; graphs on a GPU) against transformers'
greedy `generate` (one prompt at a time). Every turn must agree (exit status 1 otherwise).

    python scripts/check_lossless.py --target bundled:qwen2.5-coder-0.5b-instruct --device cuda \\
        --prompts 3 --new-tokens 96 --out /tmp/lossless

It also exports the random drafter to OUT/random-drafter, so that `dflash-train eval --drafter
OUT/random-drafter` counts turns that differ in another dtype (docs/EVALUATION.md)."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_train.core.drafter import DFlashDrafter, build_drafter_config, resolve_mask_token_id
from dflash_train.core.export import export_drafter
from dflash_train.core.target import resolve_target_path
from dflash_train.engine.decoder import Decoder
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import stop_token_ids
from dflash_train.engine.slots import SlotDecoder
from dflash_train.eval.evaluate import first_difference
from dflash_train.eval.prompts import load_prompts, prompt_ids

SETS = ("mt-bench", "humaneval", "gsm8k")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="bundled:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=3, help="first K prompts of each set")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rows", type=int, default=8, help="rows decoded at once by both engine decoders")
    ap.add_argument("--out", required=True, help="folder: lossless.json and random-drafter/")
    args = ap.parse_args(argv)
    out, n, graphs = Path(args.out), args.new_tokens, args.device == "cuda"
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_target_path(args.target, "--target")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    stop = stop_token_ids(tokenizer, model.generation_config)
    torch.manual_seed(0)
    mask = resolve_mask_token_id(tokenizer, model.get_input_embeddings().weight.shape[0])
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=16, mask_token_id=mask))
    export_drafter(drafter, out / "random-drafter")
    drafter = drafter.to(args.device).eval()
    items = [(name, record.id, prompt_ids(tokenizer, record.first_messages()))
             for name in SETS for record in load_prompts(name, args.prompts)]
    seconds = {}
    with torch.inference_mode():
        began = time.perf_counter()
        reference = []
        for _, _, p in items:
            ids = torch.tensor([p], device=args.device)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
            g = g[0, len(p):].tolist()
            reference.append(g[: next((i + 1 for i, t in enumerate(g) if t in stop), len(g))])
        seconds["generate"] = time.perf_counter() - began
        began = time.perf_counter()
        slots = SlotDecoder.for_model(model, args.rows, max(len(p) for *_, p in items) + n + 32, graphs=graphs,
                                      stop_ids=stop, refill=1)
        for i, (_, _, p) in enumerate(items):
            slots.add(i, p, n)
        target_only = {f.key: f.output_ids for f in slots.run()}
        seconds["target_only"] = time.perf_counter() - began
        began = time.perf_counter()
        engine = Decoder(model, DFlashProposer.for_target(drafter, model, graphs=graphs), graphs=graphs)
        speculative = []
        for at in range(0, len(items), args.rows):
            batch = [p for *_, p in items[at: at + args.rows]]
            speculative += [g.output_ids[:n] for g in engine.speculate(batch, n, stop_ids=stop)]
        engine.close()
        seconds["speculative"] = time.perf_counter() - began
    turns = [{"set": name, "id": rid, "prompt_tokens": len(p), "tokens": len(reference[i]),
              "target_only_vs_generate": first_difference(target_only[i], reference[i]),
              "speculative_vs_generate": first_difference(speculative[i], reference[i]),
              "speculative_vs_target_only": first_difference(speculative[i], target_only[i])}
             for i, (name, rid, p) in enumerate(items)]
    compared = ("target_only_vs_generate", "speculative_vs_generate", "speculative_vs_target_only")
    differ = [t for t in turns if any(t[k] is not None for k in compared)]
    result = {"target": args.target, "device": args.device, "dtype": "float32", "new_tokens": n,
              "num_turns": len(turns), "num_differ": len(differ), "seconds": seconds, "turns": turns}
    (out / "lossless.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"float32 on {args.device}: {len(turns)} turns, up to {n} new tokens; turns that differ anywhere: "
          f"{len(differ)} (target-only, speculative and transformers' generate)")
    for t in differ:
        print(t)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
