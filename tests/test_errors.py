"""The command line's error contract (errors.py), as a table of user mistakes across the commands:
each exits with its status and one clear `dflash-train CMD: ...` message naming the thing and the
fix, never a traceback. Rows marked early must fail before any model, tokenizer or data is
loaded: those loaders fail the test if they are reached. With $DFLASH_TRAIN_CAPTURED set to a
folder, each row's command line and captured output are written there as ROW.txt (for
`grep -R Traceback`)."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, hold_lock_in_child
from dflash_train.app import cli
from dflash_train.core.errors import BAD_INPUT, FAILED

TARGET = "bundled:tiny-random-llama"
CHAT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # free once the socket closes: nothing listens there


def save_drafter(folder: Path, target_config, mask_token_id: int) -> Path:
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config

    torch.manual_seed(0)
    config = build_drafter_config(target_config, num_layers=1, block_size=4, num_taps=2, mask_token_id=mask_token_id)
    DFlashDrafter(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The files and folders the mistakes are made with."""
    from transformers import AutoConfig, LlamaConfig

    from dflash_train.core.target import resolve_target_path

    root = tmp_path_factory.mktemp("mistakes")
    target_dir = resolve_target_path(TARGET)  # built before the loaders are forbidden
    target = AutoConfig.from_pretrained(target_dir)
    (root / "empty.jsonl").write_text("")
    (root / "random.jsonl").write_bytes(random.Random(0).randbytes(4096))
    (root / "chats.jsonl").write_text(json.dumps(CHAT) + "\n")
    (root / "users-only.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "Hi"}]}) + "\n")
    (root / "no-chats").mkdir()
    (root / "no-chats" / "notes.txt").write_text("not chat data")
    (root / "not-a-model").mkdir()
    (root / "busy").mkdir()
    (root / "busy" / "thesis.tex").write_text("keep me")
    small = dict(num_hidden_layers=target.num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=512)
    drafters = SimpleNamespace(
        good=save_drafter(root / "drafter", target, target.vocab_size - 1),
        narrow=save_drafter(root / "drafter-hidden-32", LlamaConfig(hidden_size=32, head_dim=8,
                                                                    vocab_size=target.vocab_size, **small), 5),
        small_vocab=save_drafter(root / "drafter-vocab-128", LlamaConfig(hidden_size=64, head_dim=16,
                                                                         vocab_size=128, **small), 127))
    # A run saved with train.grad_accum=2 (2 micro-batches per step): this run's global batch.
    run = root / "run-accum-2"
    assert cli.main(["train", "--config", str(TINY), "--output-dir", str(run), "train.max_steps=1",
                     "train.grad_accum=2", "data.limit=16"]) == 0
    targets = broken_targets(root / "targets", Path(target_dir))
    (root / "mine.jsonl").write_bytes(json.dumps(CHAT).encode())  # the user's own file, its last line cut
    holders = [hold_lock_in_child(root / "busy-run" / ".dflash-train.lock"),
               hold_lock_in_child(root / ".taken.jsonl.lock")]
    yield SimpleNamespace(root=root, target=str(target_dir), drafters=drafters, run=run, targets=targets)
    for holder in holders:
        holder.kill()
        holder.wait()


def broken_targets(root: Path, good: Path) -> SimpleNamespace:
    """Target folders that are wrong in one way each, made from the tiny target."""
    folders = SimpleNamespace(**{name: root / name for name in ("config_only", "no_weights", "truncated")})
    for folder in vars(folders).values():
        folder.mkdir(parents=True)
        shutil.copy(good / "config.json", folder / "config.json")
    for name in ("no_weights", "truncated"):
        for tokenizer_file in good.glob("tokenizer*"):
            shutil.copy(tokenizer_file, getattr(folders, name) / tokenizer_file.name)
    weights = (good / "model.safetensors").read_bytes()
    (folders.truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return folders


def train(*args: str):
    return lambda w, tmp: ["train", "--config", str(TINY), "--output-dir", str(tmp / "run"), *(a.format(w=w) for a in args)]


def prepare(data: str, target: str | None = None, out: str | None = None):
    return lambda w, tmp: ["data", "prepare", "--data", data.format(w=w), "--target", (target or w.target).format(w=w),
                           "--out", (out or str(tmp / "prepared")).format(w=w)]


def regenerate(*args: str, data: str = "{w.root}/chats.jsonl", out: str = "{tmp}/regen.jsonl"):
    return lambda w, tmp: ["data", "regenerate", "--data", data.format(w=w), "--target", TARGET,
                           "--out", out.format(tmp=tmp, w=w), *(a.format(port=closed_port()) for a in args)]


def evaluate(*args: str, drafter: str = "{w.drafters.good}", prompts: str = "mt-bench"):
    return lambda w, tmp: ["eval", "--target", TARGET, "--drafter", drafter.format(w=w), "--prompts",
                           prompts.format(w=w), "--output", str(tmp / "eval.json"), "--device", "cpu",
                           *(a.format(w=w) for a in args)]


def plain(*args: str):
    return lambda w, tmp: [a.format(w=w, tmp=tmp) for a in args]


# (id, argv, exit status, a fragment of the message, early: fails before any loading)
ROWS = [
    # train
    ("train-missing-data-file", train("data.paths=[/nonexistent.jsonl]"), BAD_INPUT,
     "data.paths: /nonexistent.jsonl: no such file or folder", True),
    ("train-unwritable-output", plain("train", "--output-dir", "/proc/nope"), BAD_INPUT,
     "output_dir /proc/nope: cannot write in /proc", True),
    ("train-empty-data-file", train("data.paths=[{w.root}/empty.jsonl]"), BAD_INPUT,
     "empty.jsonl: they hold no records", False),
    ("train-random-bytes-data-file", train("data.paths=[{w.root}/random.jsonl]"), BAD_INPUT,
     "records were skipped (", False),
    ("train-folder-without-chat-files", train("data.paths=[{w.root}/no-chats]"), BAD_INPUT,
     "no-chats: folder holds no .json/.jsonl/.parquet files", True),
    ("train-missing-config-file", plain("train", "--config", "{w.root}/nope.yaml"), BAD_INPUT,
     "nope.yaml: config file not found", True),
    ("train-unknown-key", train("optim.learning_rate=1e-3"), BAD_INPUT, "optim.learning_rate", True),
    ("train-limit-0", train("data.limit=0"), BAD_INPUT, "data.limit must be > 0, got 0", True),
    ("train-target-not-a-model", train("target.path={w.root}/not-a-model"), BAD_INPUT,
     "not a Hugging Face model folder (no config.json)", True),
    ("train-init-from-a-model-folder", train("drafter.init_from={w.target}"), BAD_INPUT,
     "not a DFlash drafter folder", True),
    ("train-init-from-another-targets-drafter", train("drafter.init_from={w.drafters.narrow}"), BAD_INPUT,
     "hidden size 32 != the target's 64", True),
    pytest.param("train-no-cuda", train("train.device=cuda"), BAD_INPUT,
                 "train.device=cuda but no CUDA device is visible", True, marks=NO_CUDA),
    ("train-checkpoint-of-another-global-batch",
     plain("train", "--config", str(TINY), "--output-dir", "{w.run}", "train.max_steps=2", "data.limit=16"),
     BAD_INPUT, "resuming would change the global batch", False),
    ("train-unknown-flag", plain("train", "--no-such-flag"), BAD_INPUT, "unrecognized arguments: --no-such-flag",
     True),
    ("train-target-with-only-a-config", train("target.path={w.targets.config_only}"), BAD_INPUT,
     "no tokenizer (tokenizer.json, tokenizer.model or a vocabulary file)", True),
    ("train-target-without-weights", train("target.path={w.targets.no_weights}"), BAD_INPUT,
     "no weights (model.safetensors, or shards", True),
    ("train-target-with-a-truncated-weight-file", train("target.path={w.targets.truncated}"), BAD_INPUT,
     "model.safetensors is not a readable safetensors file", True),
    ("train-target-is-a-drafter", train("target.path={w.drafters.good}"), BAD_INPUT,
     "is a DFlash drafter folder, not a target model", True),
    ("train-taps-out-of-order", train("drafter.target_layer_ids=[2,0]"), BAD_INPUT,
     "drafter.target_layer_ids must be strictly increasing", True),
    ("train-taps-repeated", train("drafter.target_layer_ids=[1,1]"), BAD_INPUT,
     "drafter.target_layer_ids must be strictly increasing", True),
    ("train-resume-with-another-architecture",
     plain("train", "--config", str(TINY), "--output-dir", "{w.run}", "train.max_steps=2", "data.limit=16",
           "train.grad_accum=2", "drafter.num_layers=2"),
     BAD_INPUT, "which a resumed run cannot change: drafter.num_layers 1 -> 2; to continue that run, set them back "
     "(drafter.num_layers=1), or to train with the new ones, choose another output_dir", True),
    ("train-output-dir-in-use", plain("train", "--config", str(TINY), "--output-dir", "{w.root}/busy-run"),
     BAD_INPUT, "/busy-run is in use by pid ", True),
    # export
    ("export-missing-checkpoint", plain("export", "--checkpoint", "{w.root}/nope", "--out", "{tmp}/d"), BAD_INPUT,
     "nope: no such folder; give a run's checkpoints/step-N folder", True),
    ("export-run-folder-for-a-checkpoint", plain("export", "--checkpoint", "{w.run}", "--out", "{tmp}/d"),
     BAD_INPUT, "is a run folder: give one of its checkpoints", True),
    ("export-over-a-folder-of-other-files",
     plain("export", "--checkpoint", "{w.run}/checkpoints/step-1", "--out", "{w.root}/busy"), BAD_INPUT,
     "holds files other than an exported drafter", True),
    ("export-over-an-export-without-force",
     plain("export", "--checkpoint", "{w.run}/checkpoints/step-1", "--out", "{w.drafters.good}"), BAD_INPUT,
     "already holds an exported drafter, which this export would replace: pass --force", True),
    # data prepare
    ("prepare-folder-without-chat-files", prepare("{w.root}/no-chats"), BAD_INPUT, "folder holds no", True),
    ("prepare-empty-data-file", prepare("{w.root}/empty.jsonl"), BAD_INPUT, "no usable records", False),
    ("prepare-missing-target", prepare("{w.root}/chats.jsonl", target="{w.root}/nope"), BAD_INPUT,
     "--target", True),
    ("prepare-unwritable-out", prepare("{w.root}/chats.jsonl", out="/proc/nope"), BAD_INPUT,
     "--out /proc/nope: cannot write in /proc", True),
    ("prepare-every-record-over-the-limit",
     lambda w, tmp: [*prepare("{w.root}/chats.jsonl")(w, tmp), "--max-record-bytes", "10"], BAD_INPUT,
     "all 1 records were skipped (1 over-long record)", False),
    ("prepare-target-with-only-a-config", prepare("{w.root}/chats.jsonl", target="{w.targets.config_only}"),
     BAD_INPUT, "no tokenizer (tokenizer.json, tokenizer.model or a vocabulary file)", True),
    # data regenerate
    ("regenerate-server-on-a-closed-port", regenerate("--server", "http://127.0.0.1:{port}"), FAILED,
     "does not answer", False),
    ("regenerate-limit-0", regenerate("--limit", "0"), BAD_INPUT, "limit=0 (need >= 1", True),
    ("regenerate-random-bytes", regenerate(data="{w.root}/random.jsonl"), BAD_INPUT, "records were skipped", True),
    ("regenerate-batch-size-0", regenerate("--batch-size", "0"), BAD_INPUT, "batch_size=0", True),
    ("regenerate-unwritable-out", regenerate(out="/proc/nope/regen.jsonl"), BAD_INPUT,
     "--out /proc/nope/regen.jsonl: cannot write in /proc", True),
    ("regenerate-caches-beyond-memory", regenerate("--max-prompt-length", "1000000000"), BAD_INPUT,
     "no row fits: lower --max-prompt-length or --max-new-tokens", False),
    ("regenerate-into-a-users-file-with-a-cut-line", regenerate(out="{w.root}/mine.jsonl"), BAD_INPUT,
     "its last line is cut off (", True),
    ("regenerate-output-in-use", regenerate(out="{w.root}/taken.jsonl"), BAD_INPUT, "taken.jsonl is in use by pid ",
     True),
    # data source
    ("source-word-problems-without-limit", plain("data", "source", "--source", "word-problems", "--out",
                                                 "{tmp}/wp.jsonl"), BAD_INPUT, "give --limit N", True),
    ("source-package-not-installed", plain("data", "source", "--source", "python-packages", "--packages",
                                           "no_such_pkg_here", "--out", "{tmp}/pk.jsonl"), BAD_INPUT,
     "--packages: not installed here: no_such_pkg_here", True),
    ("source-unwritable-out", plain("data", "source", "--source", "word-problems", "--limit", "3", "--out",
                                    "/proc/nope/wp.jsonl"), BAD_INPUT, "--out /proc/nope/wp.jsonl: cannot write in /proc",
     True),
    ("source-into-a-users-chat-file", plain("data", "source", "--source", "word-problems", "--limit", "3", "--out",
                                            "{w.root}/mine.jsonl"), BAD_INPUT,
     "its line 1 holds another record than `data source --source word-problems --seed 0` writes there", True),
    # eval
    ("eval-limit-0", evaluate("--limit", "0"), BAD_INPUT, "--limit must be >= 1", True),
    ("eval-drafter-is-the-target", evaluate(drafter="{w.target}"), BAD_INPUT, "not a DFlash drafter folder", True),
    ("eval-drafter-for-another-hidden-size", evaluate(drafter="{w.drafters.narrow}"), BAD_INPUT,
     "is a drafter for another target: hidden size 32 != the target's 64", True),
    ("eval-drafter-for-another-vocabulary", evaluate(drafter="{w.drafters.small_vocab}"), BAD_INPUT,
     "vocabulary of 128 tokens != the target's", True),
    ("eval-missing-drafter", evaluate(drafter="{w.root}/nope"), BAD_INPUT, "nope: no such folder", True),
    ("eval-target-with-a-truncated-weight-file",
     lambda w, tmp: [a if a != TARGET else str(w.targets.truncated) for a in evaluate()(w, tmp)], BAD_INPUT,
     "model.safetensors is not a readable safetensors file", True),
    ("eval-random-bytes-prompts", evaluate(prompts="{w.root}/random.jsonl"), BAD_INPUT, "random.jsonl: not UTF-8",
     True),
    ("eval-empty-prompts", evaluate(prompts="{w.root}/empty.jsonl"), BAD_INPUT, "no records", True),
    ("eval-output-over-a-users-chat-file", lambda w, tmp: [*evaluate()(w, tmp), "--output", f"{w.root}/mine.jsonl"],
     BAD_INPUT, "mine.jsonl exists and is not an eval result; writing would replace it; choose another --output",
     True),
    ("eval-unwritable-output",
     lambda w, tmp: [*evaluate()(w, tmp), "--output", "/proc/nope/eval.json"], BAD_INPUT,
     "--output /proc/nope/eval.json: cannot write in /proc", True),
    pytest.param("eval-no-cuda", lambda w, tmp: [*evaluate()(w, tmp), "--device", "cuda"], BAD_INPUT,
                 "--device=cuda but no CUDA device is visible", True, marks=NO_CUDA),
    pytest.param("eval-walk-without-assistant-turns",
                 lambda w, tmp: ["eval", "--target", TARGET, "--drafter", str(w.drafters.good), "--walk",
                                 f"{w.root}/users-only.jsonl", "--output", str(tmp / "walk.json"), "--device", "cpu"],
                 BAD_INPUT, "assistant", False),
    ("eval-missing-required-option", plain("eval", "--target", TARGET), BAD_INPUT, "the following arguments are "
     "required", True),
    # bench and plot
    ("bench-steps-0", plain("bench", "--workload", "tiny", "--steps", "0"), BAD_INPUT, "--steps must be >= 1", True),
    ("bench-bad-override", plain("bench", "--workload", "tiny", "optim.lr=-1"), BAD_INPUT, "optim.lr must be > 0",
     True),
    ("bench-unwritable-output", plain("bench", "--workload", "tiny", "--output", "/proc/nope/b.json"), BAD_INPUT,
     "--output /proc/nope/b.json: cannot write in /proc", True),
    ("bench-decode-bad-rows", plain("bench", "--workload", "decode", "--rows", "1,x", "--device", "cpu"), BAD_INPUT,
     "--rows 1,x: give row counts >= 1", True),
    ("plot-not-a-run-folder", plain("plot", "{w.root}/no-chats"), BAD_INPUT, "metrics.jsonl: no such file", True),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Model, tokenizer and data loading fail the test when reached."""
    import transformers

    from dflash_train.data import preparation

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded before the checks that need nothing heavy")

    for owner, name in ((transformers.AutoModelForCausalLM, "from_pretrained"),
                        (transformers.AutoTokenizer, "from_pretrained"), (preparation, "_build_samples")):
        monkeypatch.setattr(owner, name, forbidden)


ROWS = [r if hasattr(r, "marks") else pytest.param(*r) for r in ROWS]
IDS = [r.values[0] for r in ROWS]


@pytest.mark.parametrize("name, argv, status, fragment, early", ROWS, ids=IDS)
def test_a_user_mistake_exits_with_one_clear_message(name, argv, status, fragment, early, ws, tmp_path, capsys,
                                                      request):
    if early:
        request.getfixturevalue("no_loading")
    args = argv(ws, tmp_path)
    before = snapshot(ws.root)
    capsys.readouterr()
    try:
        got = cli.main(args)
    except SystemExit as stop:  # argparse's own errors
        got = stop.code
    said = capsys.readouterr()
    if os.environ.get("DFLASH_TRAIN_CAPTURED"):
        folder = Path(os.environ["DFLASH_TRAIN_CAPTURED"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.txt").write_text(f"$ dflash-train {' '.join(args)}\nexit {got}\n{said.out}{said.err}")
    command = " ".join(args[:2]) if args[0] == "data" else args[0]
    assert "Traceback" not in said.out + said.err, said.err
    assert got == status, said.err
    assert fragment in said.err and f"dflash-train {command}: " in said.err, said.err
    if status == BAD_INPUT and early:  # refused before anything: nothing on disk changed
        assert snapshot(ws.root) == before, name


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `root`."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_table_covers_every_command_and_the_contract():
    assert len(IDS) >= 25 and len(set(IDS)) == len(IDS)
    assert {i.split("-")[0] for i in IDS} >= {"train", "export", "prepare", "regenerate", "source", "eval", "bench",
                                               "plot"}


def test_a_bug_keeps_its_traceback(monkeypatch):
    """Only the project's errors (and the system's refusals) are said in one line: anything else
    is a bug of ours and reaches the caller with its traceback."""
    from dflash_train.app import commands

    def broken(run_dir, out=None):
        raise KeyError("a bug")

    monkeypatch.setattr(commands, "write_report", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["plot", "."])
