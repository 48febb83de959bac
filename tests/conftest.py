"""Shared fixtures: tiny random configs and packed layouts, the real SmolLM2 folder and tokenizer,
variants of that tokenizer with other chat templates, and what the run tests read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
from dflash_train.engine.graphs import Graphs

# The tests' tensors are tiny: one intra-op thread avoids OpenMP hand-off costs that dominate
# (and explode when the 2-core CI machine is busy with anything else).
torch.set_num_threads(1)
# ... and in the processes the tests start (the CLI, torchrun, spawned workers), which would each
# take both cores otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


def losses(out: Path) -> dict[int, float]:
    """step -> logged loss of a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a child process (torchrun, the CLI): this checkout first on
    PYTHONPATH, whatever PYTHONPATH already holds (packages installed with --target) after it."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def in_triton_interpreter(module: str, case: str) -> None:
    """Run `module.case()` (a test module's check) in a child process under Triton's interpreter
    (TRITON_INTERPRET=1, on CPU: the interpreter is chosen when a kernel is defined)."""
    pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package (the test extra)")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
    run = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{case}()"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def hold_lock_in_child(lock_file: Path) -> subprocess.Popen:
    """A process that holds `lock_file` (as a run or a regeneration holds its own) until killed."""
    script = ("import sys, time; from pathlib import Path; from dflash_train.core import locks\n"
              "with locks.hold(Path(sys.argv[1]), 'it', 'wait'):\n"
              "    print('held', flush=True); time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(lock_file)], env=subprocess_env(),
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def tiny_target_config(**overrides) -> LlamaConfig:
    cfg = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_drafter(num_layers=2, block_size=4, seed=0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = build_drafter_config(
        tiny_target_config(), num_layers=num_layers, block_size=block_size, mask_token_id=127, **kw
    )
    return DFlashDrafter(cfg).eval()


def random_packed_row(gen: torch.Generator, num_docs: int, max_len: int = 24, pad: int = 0):
    """Random documents with random supervised spans (some documents fully unsupervised),
    plus `pad` padding positions at the end of the row."""
    lengths = torch.randint(2, max_len + 1, (num_docs,), generator=gen)
    T = int(lengths.sum()) + pad
    loss_mask = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n in lengths.tolist():
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        if kind == 0:  # no supervision at all: a document with no anchors
            pass
        elif kind == 1:  # everything after a prompt
            cut = int(torch.randint(0, n, (1,), generator=gen))
            loss_mask[start + cut : start + n] = True
        else:  # scattered supervised positions
            loss_mask[start : start + n] = torch.rand(n, generator=gen) < 0.6
        start += n
    return lengths, loss_mask


@pytest.fixture(scope="session")
def smollm2_path():
    from dflash_train.core.assets import smollm2_dir

    return smollm2_dir()

# Mimics the Llama-3 chat layout: header tokens around the role, <|eot_id|> ends every turn, a
# default system block is added when the conversation has none, contents are trimmed.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] | trim %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'Cutting Knowledge Date: December 2023' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in rest %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Mimics Qwen3: ChatML turns; an assistant turn after the last user turn keeps (or, when it is
# the final message, gets an empty) <think> block, while earlier assistant turns are rewritten
# to their text after </think>. So earlier turns render differently once later turns exist.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'assistant' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{%- set content = message['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def load_tokenizer(path, template: str | None = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if template == "llama3":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
        tokenizer.chat_template = LLAMA3_TEMPLATE
    elif template == "qwen3":
        tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session", params=["smollm2", "llama3", "qwen3"])
def any_tokenizer(request, smollm2_path):
    return request.param, load_tokenizer(smollm2_path, request.param)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def template_dirs(smollm2_path, tmp_path_factory):
    """Tokenizer folders (what --target reads) for each template."""
    dirs = {"smollm2": smollm2_path}
    for name in ("llama3", "qwen3"):
        folder = tmp_path_factory.mktemp(f"tok-{name}")
        load_tokenizer(smollm2_path, name).save_pretrained(folder)
        dirs[name] = folder
    return dirs


class ReplayedGraph:
    """A stand-in for a CUDA graph with a graph's data semantics: a replay runs the step again on
    its static inputs and writes the results into its static outputs in place; then, as a graph
    whose freed intermediates later captures of the same pool took would, it scribbles over the
    outputs of every graph captured after it (unless its Graphs' `scribble` is off: outputs that
    live outside the pool)."""

    def __init__(self, graphs, fn, static, outputs):
        self.graphs, self.fn, self.static, self.outputs = graphs, fn, static, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.fn(*self.static)):
            out.copy_(new)
        if not self.graphs.scribble:
            return
        entries = list(self.graphs.entries.values())
        mine = next(i for i, e in enumerate(entries) if e.graph is self)
        for later in entries[mine + 1:]:
            for out in later.outputs:
                out.fill_(float("nan") if out.is_floating_point() else -(2**40))


class SimulatedGraphs(Graphs):
    """Graphs on CPU with ReplayedGraph standing in for CUDA graphs: the engine's graph paths
    (buckets, padding rows, static inputs and outputs) run and are checked on CPU."""

    scribble = True

    def __post_init__(self):
        self.enabled, self.pool = True, None

    def _record(self, fn, static):
        outputs = tuple(fn(*static))
        return ReplayedGraph(self, fn, static, outputs), outputs
