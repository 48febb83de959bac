"""Hugging Face modeling entry of an exported drafter (`trust_remote_code=True`).

The export copies this file and drafter.py next to the weights, so that
`AutoModel.from_pretrained(folder, trust_remote_code=True)` builds the very model this project
trains, with the published calling convention and parameter names.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel, Qwen3Config

from .drafter import DFlashDrafter, RMSNorm, build_modules


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        build_modules(self, config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    forward = DFlashDrafter.forward
