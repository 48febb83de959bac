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
    add_train_commands(commands)
    return parser


def add_train_commands(commands) -> None:
    train = commands.add_parser(
        "train",
        help="train a drafter (no arguments: the embedded default, SmolLM2-135M on bundled ShareGPT)",
        description="Train a DFlash drafter. Settings come from the defaults, then --config, then "
        "section.key=value overrides. Re-running with the same output dir resumes.",
    )
    train.add_argument("--config", metavar="FILE", help="YAML config (see configs/ and README.md)")
    train.add_argument("--output-dir", metavar="DIR", help="overrides output_dir")
    train.add_argument("overrides", nargs="*", metavar="section.key=value", help="e.g. optim.lr=3e-4")
    train.set_defaults(func=run_train)

    export = commands.add_parser("export", help="write a checkpoint's drafter in the published format")
    export.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoints/step-N folder")
    export.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    export.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    export.set_defaults(func=run_export)


def run_train(args) -> int:
    from dflash_train.config import ConfigError, load_config
    from dflash_train.train import TrainingStopped, train

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    try:
        cfg = load_config(args.config, overrides)
        train(cfg)
    except ConfigError as err:
        print(f"dflash-train train: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"dflash-train train: stopped: {err}", file=sys.stderr)
        return 1
    return 0


def run_export(args) -> int:
    from pathlib import Path

    import torch

    from dflash_train.checkpoint import drafter_from_checkpoint, export_drafter

    try:
        drafter = drafter_from_checkpoint(Path(args.checkpoint))
    except (ValueError, FileNotFoundError) as err:
        print(f"dflash-train export: {err}", file=sys.stderr)
        return 2
    out = export_drafter(drafter, args.out, getattr(torch, args.dtype))
    print(f"exported {args.checkpoint} -> {out}")
    return 0


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
