"""Train/serve parity at the level of single proposals: the training forward, run on a sequence
that speculative decoding produced with anchors at that run's cycle starts, computes for every
block what the serving drafter computed in that cycle.

This is the check for the bug class that users of other trainers report most, "high training
accuracy, near-zero serving acceptance": wrong rope positions, wrong layer taps, a wrong mask token, context
visible at the anchor itself, or context features that differ between the training forward (one
clean forward of the whole sequence) and serving (prefill, then the verify passes' features of
the committed positions) all make the two sides disagree here. Float32 on CPU: the two sides
differ only by summation order.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.core.config import load_config
from dflash_train.data.batching import Batch
from dflash_train.engine.decoder import speculative_generate
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.train import step as step_module

PROMPT_LEN, MAX_NEW = 19, 40


class RecordingProposer(DFlashProposer):
    """The serving proposer, remembering each cycle's anchor position and proposals."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.anchors: list[int] = []
        self.proposals: list[torch.Tensor] = []
        self.served: list[torch.Tensor] = []

    def block_body(self, anchor_token_R, anchor_R, context_RTF, context_len_R, width):
        last: list[torch.Tensor] = []  # the drafter's last-layer output of this block step only
        handle = _capture(self.drafter.layers[-1], last)
        try:
            proposals = super().block_body(anchor_token_R, anchor_R, context_RTF, context_len_R, width)
        finally:
            handle.remove()
        assert anchor_R.numel() == 1, "one sequence"  # on CPU every cycle's block step runs eagerly
        self.anchors.append(int(anchor_R[0]))
        self.proposals.append(proposals[0].clone())
        self.served.extend(last)
        return proposals


def _run(tmp_path):
    """A tiny-config run (random 4-layer target, 1-layer block-8 drafter), without feature
    noise; its dataset only has to exist: the test builds its own micro-batch."""
    from datasets import Dataset
    from transformers import AutoConfig

    from dflash_train.core.target import load_target, resolve_target_path
    from dflash_train.train.loop import build

    cfg = load_config("configs/tiny.yaml", [f"output_dir={tmp_path}", "objective.noise=none",
                                            "train.device=cpu", "drafter.mask_token_id=16"])
    dataset = Dataset.from_dict({"input_ids": [[5] * 16], "loss_mask": [[False] * 8 + [True] * 8], "length": [16]})

    def build_target(layer_ids, labels):
        return load_target(cfg.target.path, torch.device("cpu"), "float32", layer_ids, labels)[0]

    run = build(cfg, log=lambda *a, **k: None, dataset=dataset, build_target=build_target,
                target_config=AutoConfig.from_pretrained(resolve_target_path(cfg.target.path)))
    run.step.drafter.eval()
    return run


def _capture(module, store: list):
    return module.register_forward_hook(lambda _m, _args, out: store.append(out.detach()))


@pytest.mark.parametrize("accept_all", [False, True], ids=["random", "every-proposal-accepted"])
def test_training_forward_computes_what_serving_proposed(tmp_path, monkeypatch, accept_all):
    """Speculative decoding of a prompt records, per cycle, the anchor position, the B-1
    proposals and the drafter's last-layer output. Then the trainer's own micro-batch path
    (target capture, packing, layout, mask rule, drafter forward) runs on prompt + output with
    exactly those anchors: its last-layer output of every block equals the serving one, and its
    argmax equals the proposals. `every-proposal-accepted` zeroes the final norms of target and
    drafter, so all logits tie at 0, every proposal (token 0) is accepted and each cycle's
    context grows by B positions at once (the features of several committed positions)."""
    torch.manual_seed(0)
    from dflash_train.core.target import load_target_model

    run = _run(tmp_path)
    drafter = run.step.drafter
    # Serving loads the whole target on its own (the trainer's runs only up to its last tap).
    model, _ = load_target_model(run.cfg.target.path, torch.device("cpu"), torch.float32)
    B = drafter.block_size
    if accept_all:
        with torch.no_grad():
            model.model.norm.weight.zero_()
            drafter.norm.weight.zero_()
    mask_id = drafter.mask_token_id
    prompt = torch.randint(0, 400, (PROMPT_LEN,))
    prompt[prompt == mask_id] = 1

    proposer = RecordingProposer.for_target(drafter, model)
    gen = speculative_generate(model, prompt.tolist(), proposer, MAX_NEW)
    served = proposer.served  # per block step (the prompt's context written ahead is not one)
    assert len(served) == len(proposer.proposals) == len(proposer.anchors)
    if accept_all:
        assert gen.acceptance_lengths[:-1] == [B] * (len(gen.acceptance_lengths) - 1)
    assert len(proposer.anchors) >= 4

    # The same sequence as one training micro-batch, supervised on the response.
    ids = torch.tensor(prompt.tolist() + gen.output_ids)
    L = ids.numel()
    loss_mask = torch.arange(L) >= PROMPT_LEN
    batch = Batch(ids[None], loss_mask[None], torch.tensor([L]), [0], 0, 0)
    anchors = torch.tensor(proposer.anchors)
    monkeypatch.setattr(step_module, "sample_anchors", lambda *a, **k: (anchors, anchors.numel()))
    trained: list[torch.Tensor] = []
    handle = _capture(drafter.layers[-1], trained)
    with torch.no_grad():
        out = run.step.forward(run.producer.produce(0, batch))
    handle.remove()
    assert out is not None and len(trained) == 1

    teacher_NBH = trained[0].reshape(len(anchors), B, -1)
    for n, (online_1BH, proposals) in enumerate(zip(served, proposer.proposals)):
        torch.testing.assert_close(teacher_NBH[n], online_1BH[0], rtol=1e-4, atol=1e-4,
                                   msg=f"cycle {n} (anchor {proposer.anchors[n]})")
        if not accept_all:
            logits = drafter.norm(teacher_NBH[n, 1:]) @ run.step.heads.lm_head_weight.t()
            assert torch.equal(logits.argmax(-1), proposals), f"cycle {n}"


def test_parity_check_catches_context_visible_at_the_anchor(tmp_path, monkeypatch):
    """The check above can fail: with the mask rule loosened to let a block see the target's
    feature at its own anchor (a train/serve mismatch users of other trainers hit), the training
    forward no longer computes what serving proposed."""
    from dflash_train.core import masks

    rule = masks.block_mask_mod

    def leaky(anchors_N, ctx_start_N, num_ctx, block_size, sliding_window=None):
        base = rule(anchors_N, ctx_start_N, num_ctx, block_size, sliding_window)
        T = num_ctx

        def mask_mod(b, h, q_idx, kv_idx):
            return base(b, h, q_idx, kv_idx) | (kv_idx == anchors_N[q_idx // block_size].clamp(max=T - 1))
        return mask_mod

    monkeypatch.setattr(masks, "block_mask_mod", leaky)
    with pytest.raises(AssertionError, match="cycle 0"):
        test_training_forward_computes_what_serving_proposed(tmp_path, monkeypatch, accept_all=False)
