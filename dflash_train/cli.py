"""`dflash-train` command line: argument parsing and dispatch only, no logic."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash drafters for speculative decoding of a frozen target LLM.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_data_commands(commands)
    return parser


def add_data_commands(commands) -> None:
    from dflash_train import data, regenerate

    data_parser = commands.add_parser("data", help="prepare or regenerate chat data")
    data_commands = data_parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    prepare = data_commands.add_parser(
        "prepare", help="tokenize chat files into a cached dataset of token ids and loss masks"
    )
    prepare.add_argument("--data", nargs="+", required=True, metavar="PATH",
                         help=".json/.jsonl/.parquet files or folders of them (ShareGPT or OpenAI messages)")
    prepare.add_argument("--target", required=True, metavar="DIR",
                         help="the target's Hugging Face folder (its tokenizer and chat template are used)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder for the dataset and report.json")
    prepare.add_argument("--max-length", type=int, default=data.DEFAULT_MAX_LENGTH, metavar="N",
                         help="longest sample in tokens (default %(default)s)")
    prepare.add_argument("--overlong", choices=data.OVERLONG_CHOICES, default="truncate",
                         help="what to do with longer samples (default %(default)s)")
    prepare.add_argument("--strict", action="store_true",
                         help="fail listing every bad record instead of skipping them")
    prepare.set_defaults(func=data.run_prepare)

    regen = data_commands.add_parser(
        "regenerate", help="replace every assistant turn with the target's own response (resumable)"
    )
    regen.add_argument("--data", nargs="+", required=True, metavar="PATH",
                       help=".json/.jsonl/.parquet files or folders of them")
    regen.add_argument("--target", required=True, metavar="DIR", help="the target's Hugging Face folder")
    regen.add_argument("--out", required=True, metavar="FILE",
                       help="JSONL output; an existing one is resumed, not overwritten")
    regen.add_argument("--max-new-tokens", type=int, default=regenerate.DEFAULT_MAX_NEW_TOKENS, metavar="N",
                       help="longest response in tokens (default %(default)s)")
    regen.add_argument("--temperature", type=float, default=0.0,
                       help="0 is greedy (default); above 0 samples")
    regen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling")
    regen.add_argument("--batch-size", type=int, default=32, metavar="N", help="prompts per generate call")
    regen.add_argument("--max-prompt-length", type=int, default=data.DEFAULT_MAX_LENGTH, metavar="N",
                       help="a conversation is cut before the first turn whose prompt is longer")
    regen.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    regen.add_argument("--seed", type=int, default=0, help="sampling seed")
    regen.add_argument("--limit", type=int, default=None, metavar="N",
                       help="stop after N more records (the output stays resumable)")
    regen.set_defaults(func=regenerate.run_regenerate)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from dflash_train import __version__

        print(__version__)
        return 0
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
