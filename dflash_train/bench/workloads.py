"""The training bench's synthetic workloads (`--workload`): the target shapes, the run settings
each starts from, random token data of the workload's lengths, the random-initialised target of
a real shape the run captures from, and the random-feature stand-in for `--drafter-only`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from datasets import Dataset
from datasets.table import InMemoryTable
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.core.config import ConfigError, load_config
from dflash_train.core.target import Target, target_config_of

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
# SmolLM2-135M-Instruct's shape (the bundled target; Llama architecture, tied embeddings).
SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)
TINY_TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@dataclass(frozen=True)
class Workload:
    description: str
    target: dict
    """Qwen3Config fields of the random-initialised target."""
    settings: dict
    """Config tree the run starts from (then the command line's overrides)."""
    lengths: tuple[int, int]
    """Sample lengths are drawn uniformly from [min, max] tokens (fixed when equal)."""
    num_samples: int
    """Synthetic samples in one epoch (the data cursor cycles through epochs)."""
    warmup: int | None
    """Untimed steps before timing; None: one whole epoch (every batch shape seen once)."""
    steps: int
    supervised: float = 0.5
    """Share of each sample, at its end, that carries loss (the assistant part)."""


# The settings of configs/qwen3-8b.yaml that both 8B workloads share (compiled target and
# drafter layers, 4 anchor buckets per doubling, the 5-layer block-16 drafter; Qwen3's first
# unused token as the mask).
QWEN3_8B_RUN = {"target": {"compile": True}, "train": {"compile": True, "anchor_buckets_per_doubling": 4},
                "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 151669}}

WORKLOADS: dict[str, Workload] = {
    "w2": Workload(
        "Qwen3-8B-shaped target, 5-layer drafter, block 16, 768-token samples (last half "
        "supervised), 256 anchors per sample",
        QWEN3_8B,
        {**QWEN3_8B_RUN,
         "data": {"max_length": 768, "token_budget": 6144, "bucket_boundaries": [768]},
         "objective": {"num_anchors": 256}},
        lengths=(768, 768), num_samples=128, warmup=5, steps=20,
    ),
    "paper": Workload(
        "Qwen3-8B-shaped target, 5-layer drafter, block 16, lengths uniform in 256..3072 "
        "(last half supervised), 512 anchors per sample, 8 length buckets",
        QWEN3_8B,
        {**QWEN3_8B_RUN,
         "data": {"max_length": 3072, "token_budget": 8192, "max_batch_size": 32, "num_buckets": 8},
         "objective": {"num_anchors": 512}},
        lengths=(256, 3072), num_samples=256, warmup=None, steps=20,
    ),
    "smollm2": Workload(
        "SmolLM2-135M-shaped target, 5-layer drafter, block 16, lengths uniform in 128..1536 "
        "(last half supervised), 512 anchors per sample: the quality run's training step",
        SMOLLM2_135M,
        {"target": {"compile": True}, "train": {"compile": True},
         "drafter": {"num_layers": 5, "block_size": 16, "mask_token_id": 49151},
         "data": {"max_length": 2048, "token_budget": 16384, "max_batch_size": 64},
         "objective": {"num_anchors": 512}},
        lengths=(128, 1536), num_samples=256, warmup=None, steps=20,
    ),
    "tiny": Workload(
        "CPU-sized: 4-layer hidden-64 target, 2-layer drafter, block 8, lengths 32..128, "
        "16 anchors per sample (tests)",
        TINY_TARGET,
        {"drafter": {"num_layers": 2, "block_size": 8, "num_taps": 2, "mask_token_id": 511},
         "data": {"max_length": 128, "token_budget": 512, "num_buckets": 2},
         "objective": {"num_anchors": 16}, "train": {"anchor_multiple": 8, "num_threads": 1}},
        lengths=(32, 128), num_samples=48, warmup=2, steps=10,
    ),
}



# --------------------------------------------------------------------------- data and target


def synthetic_dataset(workload: Workload, mask_token_id: int, seed: int):
    """Random token ids (never the mask token) with the workload's lengths; the last
    `supervised` share of every sample carries loss."""
    rng = np.random.default_rng(seed)
    low, high = workload.lengths
    lengths = rng.integers(low, high + 1, workload.num_samples)
    vocab = min(int(workload.target["vocab_size"]), mask_token_id)
    ids, masks = [], []
    for n in lengths.tolist():
        ids.append(rng.integers(0, vocab, n))
        mask = np.zeros(n, dtype=bool)
        mask[n - int(round(n * workload.supervised)):] = True
        masks.append(mask)
    # Named by what draws it: no content hash (datasets hashes with dill, which some pyarrow
    # and Python pairings cannot pickle).
    table = InMemoryTable.from_pydict({"input_ids": ids, "loss_mask": masks, "length": lengths})
    return Dataset(table, fingerprint=f"bench-{workload.num_samples}-{low}-{high}-{seed}-{mask_token_id}")


def target_config(workload: Workload):
    """The transformers config of the workload's target (Qwen3 unless it names a model_type)."""
    fields = dict(workload.target)
    return AutoConfig.for_model(fields.pop("model_type", "qwen3"), **fields)


def build_random_target(config, device: torch.device, dtype: torch.dtype, seed: int):
    """`build_target` for train.loop.build: a randomly initialised causal LM of `config`'s shape,
    built directly on `device` in `dtype` (no weights on disk to read)."""
    def build(layer_ids: list[int], labels: str) -> Target:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return Target(model, layer_ids, labels)

    return build


class RandomFeatureTarget:
    """The target's stand-in for `--drafter-only`: random features of the tapped width (one
    tensor per batch shape, made once), random frozen embedding and lm_head; no forward runs.
    With no `layer_ids` it is the heads of a disaggregated bench's drafter rank (as
    `target.TargetHeads`: embedding and lm_head of the target's shape, no features)."""

    def __init__(self, config, layer_ids: list[int], device: torch.device, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device).manual_seed(seed)
        H, V = int(config.hidden_size), int(config.vocab_size)
        self.num_features = len(layer_ids) * H
        self.device, self.dtype, self.gen = device, dtype, gen
        self.embed_weight = torch.randn(V, H, generator=gen, device=device, dtype=dtype) * 0.02
        self.lm_head_weight = torch.randn(V, H, generator=gen, device=device, dtype=dtype) * 0.02
        self.features: dict[tuple, torch.Tensor] = {}

    def capture(self, input_ids_bL: torch.Tensor):
        shape = tuple(input_ids_bL.shape)
        if shape not in self.features:
            self.features[shape] = torch.randn(*shape, self.num_features, generator=self.gen,
                                               device=self.device, dtype=self.dtype)
        return self.features[shape], None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.embed_weight)


def workload_settings(workload: str, overrides: list[str], drafter_only: bool = False):
    """(the run's settings, the transformers config of its random target): the workload's
    settings plus `overrides`, and its target's shape, or the shape of the folder that a
    `target.path=DIR` override names (its config.json alone is read)."""
    given = [item.split("=", 1)[1] for item in overrides if item.startswith("target.path=")]
    shape = target_config_of(given[-1]) if given else None
    cfg = workload_config(workload, overrides, drafter_only, shape)
    return cfg, shape if shape is not None else target_config(WORKLOADS[workload])


def workload_config(workload: str, overrides: list[str], drafter_only: bool = False, shape=None):
    """The workload's settings plus `overrides`, checked for what a synthetic run needs; `shape`:
    the transformers config of the random target (None: the workload's)."""
    if workload not in WORKLOADS:
        raise ConfigError([f"--workload {workload!r} is unknown: choose one of {', '.join(WORKLOADS)}"])
    wl = WORKLOADS[workload]
    cfg = load_config(None, overrides, base=wl.settings)
    if drafter_only and cfg.objective.labels != "data":
        raise ConfigError([f"--drafter-only runs no target, so objective.labels={cfg.objective.labels} has no "
                           f"labels: drop one of the two"])
    vocab = int(wl.target["vocab_size"] if shape is None else shape.get_text_config().vocab_size)
    mask = cfg.drafter.mask_token_id
    if mask is None or not 0 <= mask < vocab:
        raise ConfigError([f"drafter.mask_token_id={mask}: synthetic data has no tokenizer to choose a mask token "
                           f"from; set one below the target's vocabulary of {vocab} (e.g. {vocab - 1})"])
    return cfg
