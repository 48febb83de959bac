"""`dflash-train` command line: argument parsing, dispatch, and the one place where errors become
`dflash-train CMD: ...` lines and exit statuses (errors.py states the contract)."""

from __future__ import annotations

import argparse
import os
import sys

from dflash_train import __version__
from dflash_train.app import commands
from dflash_train.bench.workloads import WORKLOADS
from dflash_train.core.config import BUNDLED_TARGET, DEFAULT_MAX_RECORD_BYTES, QWEN_CODER_TARGET, TINY_TARGET
from dflash_train.core import locks
from dflash_train.core.errors import FAILED, INTERRUPTED, PEER_LOST, UserError
from dflash_train.data import preparation, regenerate, serving, sources, target_prompts
from dflash_train.eval import evaluate
from dflash_train.train.metrics import quiet_progress_bars

TARGET_HELP = f"the target's Hugging Face folder, or {BUNDLED_TARGET} / {QWEN_CODER_TARGET} / {TINY_TARGET}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash drafters for speculative decoding of a frozen target LLM.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_commands(subparsers)
    add_data_commands(subparsers)
    add_eval_command(subparsers)
    add_bench_command(subparsers)
    add_plan_command(subparsers)
    add_plot_command(subparsers)
    return parser


def add_train_commands(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a drafter (no arguments: the embedded default, SmolLM2-135M on bundled ShareGPT)",
        description="Train a DFlash drafter. Settings come from the defaults, then --config, then "
        "section.key=value overrides. Re-running with the same output dir resumes.",
    )
    train.add_argument("--config", metavar="FILE", help="YAML config (see configs/ and README.md)")
    train.add_argument("--output-dir", metavar="DIR", help="overrides output_dir")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. optim.lr=3e-4")
    train.set_defaults(func=commands.run_train)

    export = subparsers.add_parser("export", help="write a checkpoint's drafter in the published format")
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoints/step-N folder")
    export.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    export.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    export.add_argument("--force", action="store_true",
                        help="replace the drafter already exported to --out (without it, an existing export is kept "
                        "and the command refuses)")
    export.set_defaults(func=commands.run_export)


def add_data_commands(subparsers) -> None:

    data_parser = subparsers.add_parser("data", help="prepare, regenerate or make chat data")
    data_commands = data_parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    prepare = data_commands.add_parser(
        "prepare", help="tokenize chat files into a cached dataset of token ids and loss masks"
    )
    prepare.add_argument("--data", nargs="+", required=True, metavar="PATH",
                         help=".json/.jsonl/.parquet files or folders of them (ShareGPT or OpenAI messages)")
    prepare.add_argument("--target", required=True, metavar="DIR",
                         help=f"{TARGET_HELP} (its tokenizer and chat template are used)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder for the dataset and report.json")
    prepare.add_argument("--max-length", type=int, default=preparation.DEFAULT_MAX_LENGTH, metavar="N",
                         help="longest sample in tokens (default %(default)s)")
    prepare.add_argument("--overlong", choices=preparation.OVERLONG_CHOICES, default="truncate",
                         help="what to do with longer samples (default %(default)s)")
    prepare.add_argument("--strict", action="store_true",
                         help="fail listing every bad record instead of skipping them")
    add_record_limit_argument(prepare)
    prepare.set_defaults(func=commands.run_prepare)

    regen = data_commands.add_parser(
        "regenerate", help="replace every assistant turn with the target's own response (resumable)"
    )
    regen.add_argument("--data", nargs="+", required=True, metavar="PATH",
                       help=".json/.jsonl/.parquet files or folders of them")
    regen.add_argument("--target", required=True, metavar="DIR", help=TARGET_HELP)
    regen.add_argument("--out", required=True, metavar="FILE",
                       help="JSONL output; an existing one is resumed, not overwritten")
    regen.add_argument("--max-new-tokens", type=int, default=regenerate.DEFAULT_MAX_NEW_TOKENS, metavar="N",
                       help="longest response in tokens (default %(default)s)")
    regen.add_argument("--temperature", type=float, default=0.0,
                       help="0 is greedy (default); above 0 samples")
    regen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling")
    regen.add_argument("--batch-size", type=int, default=64, metavar="N",
                       help="turns decoded at once; a finished row is refilled with the next turn (default "
                       "%(default)s; on a GPU try 256-512)")
    regen.add_argument("--no-graphs", action="store_true",
                       help="run every decoding step eagerly (no CUDA graphs; CPU always does)")
    regen.add_argument("--no-overlap", action="store_true",
                       help="read each decode step's tokens before queueing the next (the host's work then runs "
                       "in series with the GPU's; by default the next step is queued first)")
    regen.add_argument("--continue-turns", action=argparse.BooleanOptionalAction, default=False,
                       help="a conversation's next turn goes on in its row from the keys its last turn left there, "
                       "and only the new text is prefilled (faster on CPU, slower on a GPU, where a whole causal "
                       "prefill is cheaper; off by default: every turn's prompt is prefilled whole)")
    regen.add_argument("--max-prompt-length", type=int, default=preparation.DEFAULT_MAX_LENGTH, metavar="N",
                       help="a conversation is cut before the first turn whose prompt is longer")
    regen.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    regen.add_argument("--seed", type=int, default=0, help="sampling seed")
    regen.add_argument("--limit", type=int, default=None, metavar="N",
                       help="stop after N more records (the output stays resumable)")
    add_workers_argument(regen, "regenerate chunks", "target copy", "the output equals --workers 1's")
    add_record_limit_argument(regen)
    add_server_arguments(regen)
    regen.set_defaults(func=commands.run_regenerate)


    add_source_command(data_commands)


def add_source_command(data_commands) -> None:
    source = data_commands.add_parser(
        "source", help="write chat records of a prompt source: offline (code, arithmetic) to regenerate, or "
        "conversations the target writes itself")
    source.add_argument("--source", required=True, choices=(*sources.SOURCES, target_prompts.SOURCE),
                        help="python-functions: documented functions of this Python's standard library "
                        "(signature and docstring -> the function); python-packages: the same from the installed "
                        "libraries (--packages); word-problems: arithmetic word problems "
                        "generated from --seed (question -> worked solution); target-prompts: conversations the "
                        "target writes itself, its user turns sampled and answered at T=0 (--target, --limit)")
    source.add_argument("--out", required=True, metavar="FILE", help="JSONL output (ShareGPT records)")
    source.add_argument("--limit", type=int, default=None, metavar="N",
                        help="the first N records (python-functions, python-packages: all by default; word-problems "
                        "and target-prompts need it)")
    source.add_argument("--seed", type=int, default=0, help="the order of python-functions, the problems of "
                        "word-problems, the samples of target-prompts (default %(default)s)")
    source.add_argument("--packages", default=None, metavar="NAMES",
                        help="python-packages: the packages to read, import names separated by commas (default: "
                        f"those of {','.join(sources.PACKAGES)} that are installed)")
    source.add_argument("--force", action="store_true",
                        help="replace an --out that holds other records (without it, only an earlier output of "
                        "the same --source and --seed is replaced, and the command refuses other files)")
    add_target_prompt_arguments(source)
    source.set_defaults(func=commands.run_source)


def add_target_prompt_arguments(parser) -> None:
    """`data source --source target-prompts`: the target and how it writes (docs/DATA.md)."""
    defaults = target_prompts.TargetPromptOptions(limit=1)
    group = parser.add_argument_group("target-prompts", "conversations written by the target itself")
    group.add_argument("--target", default=None, metavar="DIR", help=TARGET_HELP)
    group.add_argument("--temperature", type=float, default=None,
                       help=f"sampling temperature of the written user turns (default {defaults.temperature})")
    group.add_argument("--top-p", type=float, default=None, help=f"nucleus mass (default {defaults.top_p})")
    group.add_argument("--turns", type=int, default=None, metavar="N",
                       help=f"user turns per conversation at most, each drawn from 1..N (default {defaults.max_turns})")
    group.add_argument("--system-share", type=float, default=None, metavar="X",
                       help="share of conversations opening with a system message the target writes (default "
                       f"{defaults.system_share})")
    group.add_argument("--max-prompt-tokens", type=int, default=None, metavar="N",
                       help=f"a written turn not ended within N tokens is dropped (default "
                       f"{defaults.max_prompt_tokens})")
    group.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                       help=f"longest answer in tokens, as `data regenerate` (default {defaults.max_new_tokens})")
    group.add_argument("--max-length", type=int, default=None, metavar="N",
                       help=f"no turn is added past N tokens of conversation (default {defaults.max_length})")
    group.add_argument("--near-duplicate", type=float, default=None, metavar="J",
                       help="MinHash Jaccard similarity at which a first user turn repeats an earlier one "
                       f"(default {defaults.near_duplicate})")
    group.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help=f"turns decoded at once (default {defaults.batch_size}; on a GPU try 256-1024)")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    group.add_argument("--no-graphs", action="store_true", help="run every decoding step eagerly")


def add_server_arguments(parser) -> None:
    """`data regenerate --server`: the turns answered by OpenAI-compatible serving engines."""

    group = parser.add_argument_group(
        "serving engines", "send every turn, rendered with --target's chat template, to the /v1/completions "
        "endpoint of vLLM, SGLang or `transformers serve` instead of generating here")
    group.add_argument("--server", action="append", metavar="URL",
                       help="base URL of a server, e.g. http://127.0.0.1:8000 (repeat for several; "
                       "not with --workers or --device)")
    group.add_argument("--concurrency", type=int, default=serving.DEFAULT_CONCURRENCY, metavar="N",
                       help="requests in flight over all servers (default %(default)s)")
    group.add_argument("--server-model", metavar="NAME",
                       help="the model name to request (default: the one model each server's /v1/models lists)")
    group.add_argument("--timeout", type=float, default=serving.DEFAULT_TIMEOUT_S, metavar="S",
                       help="seconds per request attempt (default %(default)s)")
    group.add_argument("--retries", type=int, default=serving.DEFAULT_RETRIES, metavar="N",
                       help="retries of a refused, failed (5xx) or timed-out request, with exponential "
                       "backoff (default %(default)s)")


def add_record_limit_argument(parser) -> None:
    """`--max-record-bytes N` of the commands that read chat files (data.max_record_bytes)."""
    parser.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES, metavar="N",
                        help="a record (a line, an element of a JSON array) longer than N bytes is skipped unread and "
                        "reported with its line (default %(default)s)")


def add_workers_argument(parser, what: str, copy: str, same: str) -> None:
    """`--workers N` of the commands that spread work over processes (workers.parallel_map)."""
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help=f"{what} in N processes, each with its own {copy} (round-robin over visible "
                        f"GPUs with --device cuda); {same} (default %(default)s)")


def add_eval_command(subparsers) -> None:

    ev = subparsers.add_parser(
        "eval", help="speculative decoding with a drafter: tau per prompt set, speedup, histogram",
        description="Run DFlash speculative decoding of the target with a drafter on prompt sets and "
        "write JSON results (OUTPUT), a markdown summary (.md) and an acceptance histogram (.png).",
    )
    ev.add_argument("--target", required=True, metavar="DIR",
                    help=TARGET_HELP)
    ev.add_argument("--drafter", required=True, metavar="DIR", help="a drafter folder in the published DFlash format")
    ev.add_argument("--prompts", action="append", metavar="NAME_OR_FILE",
                    help="mt-bench, humaneval, gsm8k or a JSONL file of {\"turns\": [...]}; comma-separated "
                    "or repeated for several sets (results per set); this or --walk")
    ev.add_argument("--walk", action="append", metavar="DATA",
                    help="instead of decoding prompts, the walked tau of the drafter on chat files (.json, "
                    ".jsonl, .parquet, folders of them) or a prepared folder: the acceptance of every turn "
                    "of the data as serving would walk it, from one forward per sample, no generation "
                    "(repeated for several sets; --limit N: first N samples; docs/EVALUATION.md)")
    ev.add_argument("--limit", type=int, default=None, metavar="N", help="first N prompts of each set")
    ev.add_argument("--max-new-tokens", type=int, default=evaluate.DEFAULT_MAX_NEW_TOKENS, metavar="N",
                    help="tokens per response at most (default %(default)s)")
    ev.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); above 0 samples")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed (T > 0)")
    ev.add_argument("--output", default="eval.json", metavar="FILE",
                    help="JSON results; the .md summary and .png histogram go next to it (default %(default)s)")
    ev.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ev.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="target and drafter dtype; auto: bfloat16 on CUDA, float32 on CPU")
    ev.add_argument("--no-speedup", action="store_true",
                    help="skip the target-only decoding (speedup and losslessness check)")
    ev.add_argument("--speedup-turns", type=int, default=evaluate.DEFAULT_SPEEDUP_TURNS, metavar="K",
                    help="the speedup times the first K turns of each set, both decoders in one process with "
                    "nothing else running (default %(default)s)")
    ev.add_argument("--eager-turns", type=int, default=evaluate.DEFAULT_EAGER_TURNS, metavar="K",
                    help="on a GPU, the first K timed turns of each set are timed again with every step run "
                    "eagerly, without CUDA graphs: `speedup_eager` beside `speedup` (default %(default)s; 0: skip)")
    ev.add_argument("--no-graphs", action="store_true",
                    help="run every decoding step eagerly (no CUDA graphs; CPU always does)")
    add_workers_argument(ev, "decode the prompts", "target and drafter copy", "results equal --workers 1's")
    ev.add_argument("--batch-size", type=int, default=1, metavar="N",
                    help="decode N records of a set per batch, turn by turn (with --workers: in each worker); "
                    "results equal batch size 1's, the speedup is still timed at batch size 1 (default 1; "
                    "on a GPU try 32)")
    ev.set_defaults(func=commands.run_eval)


def add_bench_command(subparsers) -> None:

    b = subparsers.add_parser(
        "bench", help="time the training step on a synthetic workload: stage times, samples/s, MFU",
        description="Run the training step (the one `train` runs) on synthetic data with a randomly "
        "initialised target of a real shape, after warm-up, and print stage times, samples/s, target "
        "tokens/s, useful-FLOP MFU, GPU idle share and peak memory; the last line is one JSON object. "
        "See docs/PERFORMANCE.md.",
    )
    b.add_argument("--workload", required=True, choices=sorted([*WORKLOADS, "decode"]),
                   help="; ".join(f"{k}: {w.description}" for k, w in WORKLOADS.items())
                   + "; decode: the decoding engine (regeneration tokens/s by rows, batch-1 ms per token of "
                   "both decoders, graphs and eager; docs/PERFORMANCE.md)")
    b.add_argument("--steps", type=int, default=None, metavar="N", help="timed steps (default: the workload's)")
    b.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed steps first (default: the workload's; paper: one whole epoch)")
    b.add_argument("--output", default=None, metavar="FILE", help="also write the JSON object here")
    b.add_argument("--drafter-only", action="store_true",
                   help="skip the target forward (random features): the drafter step alone")
    b.add_argument("--profile-steps", type=int, default=None, metavar="N",
                   help="steps run under torch.profiler after timing, for the GPU idle share, replaying the "
                   "timed steps' batches from the first (CUDA; default: as many as were timed; 0: none)")
    b.add_argument("--profile", action="store_true",
                   help="also write the kernels ranked by device time to bench-WORKLOAD-kernels.txt next to --output "
                   "(decode: 10 regeneration steps at the largest --rows)")
    b.add_argument("--peak-tflops", type=float, default=None, metavar="X",
                   help="the chip's dense bf16 peak for MFU when it is not known by name")
    b.add_argument("--rows", default=None, metavar="N,N,...",
                   help="decode: row counts of the regeneration rate (default 1,64,256,512)")
    b.add_argument("--eager-rows", default=None, metavar="N,N,...",
                   help="decode: the row counts also measured without graphs (default: all of --rows)")
    b.add_argument("--new-tokens", type=int, default=None, metavar="N", help="decode: tokens per request (128)")
    b.add_argument("--drafter-layers", type=int, default=None, metavar="N",
                   help="decode: layers of the random drafter whose batch-1 speculative cycle is timed (5)")
    b.add_argument("--prompt-lengths", default=None, metavar="LO,HI",
                   help="decode: prompt lengths drawn uniformly from LO..HI tokens (64,512; real chats: e.g. "
                   "16,1024 with --new-tokens 320)")
    b.add_argument("--target", default=None, metavar="DIR",
                   help="decode: a real target folder (default: random weights of SmolLM2-135M's shape); "
                   "training workloads: random weights of this target's shape instead of the workload's (its "
                   "config.json alone is read; the same as the override target.path=DIR), e.g. to measure the "
                   "peak memory of your target's run before downloading its weights")
    b.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="decode: the device")
    b.add_argument("--no-overlap", action="store_true",
                   help="decode: regeneration reads each step's tokens before queueing the next")
    b.add_argument("--attention", choices=("auto", "varlen", "masked"), default="auto",
                   help="decode: the target's attention in decode and verify steps (auto: each row's own keys "
                   "through FlashAttention on a CUDA GPU in half precision, else the masked width bucket)")
    b.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. train.compile=true")
    b.set_defaults(func=commands.run_bench_command)


def add_plan_command(subparsers) -> None:

    p = subparsers.add_parser(
        "plan", help="per-GPU memory of training layouts on N GPUs, from the target's config.json (nothing loads)",
        description="Count, per GPU, what training needs: the target's shard and its forward, the drafter's "
        "weights, gradients and AdamW state, the drafter step's activations for the largest micro-batch, against "
        "the GPU's memory. With no layout option, every layout of --gpus GPUs is planned (colocated and "
        "disaggregated, each target TP, the drafter replicated or with FSDP), those that fit first; with one, that "
        "layout alone, refused (exit 2) when it does not fit. Settings: the config file's defaults (the paper "
        "recipe), then --config, then section.key=value overrides, as `train` reads them. docs/TRAINING.md, "
        "'Planning memory for several GPUs'.",
    )
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes (default %(default)s)")
    p.add_argument("--target", default=None, metavar="DIR", help=f"{TARGET_HELP} (default: target.path)")
    p.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                   help="plan a bench workload instead: its settings and its own batches, on its target shape "
                   "or --target's (what `bench --workload NAME [--target DIR]` measures)")
    p.add_argument("--config", metavar="FILE", help="YAML config, as for `train`")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, metavar="X",
                   help="memory of one GPU in GiB (default %(default)g)")
    p.add_argument("--target-tp", type=int, default=None, metavar="N",
                   help="plan this layout: the target split over N GPUs (tensor parallel)")
    p.add_argument("--target-ranks", type=int, default=None, metavar="K",
                   help="plan this layout: disaggregated, K target ranks per node")
    p.add_argument("--fsdp", action="store_true", help="plan this layout: the drafter sharded with FSDP")
    p.add_argument("--supervised-share", type=float, default=1.0, metavar="S",
                   help="share of a sample's tokens that carry loss, for the worst-case micro-batch (default 1: "
                   "any data; chat data with long prompts has less)")
    p.add_argument("--all", action="store_true", help="list every layout (default: those that fit and a few more)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. data.token_budget=8192")
    p.set_defaults(func=commands.run_plan)


def add_plot_command(subparsers) -> None:

    p = subparsers.add_parser(
        "plot", help="draw a run's curves (PNG) and write its summary.json from metrics.jsonl",
        description="Draw loss, learning rate, walked / served tau, tokens/s and the stage shares over "
        "steps from RUN_DIR/metrics.jsonl (an overview and one PNG per panel beside it), write "
        "RUN_DIR/summary.json and print the summary. `train` does the same when it ends.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (output_dir of `train`)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="the overview PNG; the panels go beside it as FILE's name + -loss.png, ... "
                   "(default RUN_DIR/plots/run.png)")
    p.set_defaults(func=commands.run_plot_cli)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    locks.remember_command(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    # argparse takes one run of positionals: overrides on both sides of an option
    # (`a=1 --output-dir D b=2`) leave the second run over; it belongs to the overrides too.
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:  # said by the command's parser: `dflash-train CMD: error: ...`
            subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            (subparsers.choices.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.version:
        print(__version__)
        return 0
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return run_command(args)


def run_command(args) -> int:
    """`args.func(args)` under the error contract (errors.py): a UserError is said in its own
    words with its exit status, a file operation the system refused (a full disk) exits 1; any
    other exception is a bug and keeps its traceback."""

    command = " ".join(c for c in (args.command, getattr(args, "data_command", None)) if c)
    quiet_progress_bars()  # off a terminal: no bar of any library redraws into a log file
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        say(command, err)
        if err.exit_code == PEER_LOST:
            sys.stdout.flush()
            # Not a normal exit: tearing down process groups whose peers are gone can block.
            os._exit(PEER_LOST)
        return err.exit_code
    except OSError as err:
        say(command, err)
        return FAILED
    except KeyboardInterrupt:
        print(f"\ndflash-train {command}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


def say(command: str, err: BaseException) -> None:
    """The error's message (and any notes added on its way up) as `dflash-train CMD: ...`."""
    lines = [str(err) or type(err).__name__, *getattr(err, "__notes__", [])]
    print(f"dflash-train {command}: " + "\n".join(lines), file=sys.stderr, flush=True)

