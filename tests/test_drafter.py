"""The drafter: train/serve consistency, attention paths, cache, published format, taps,
mask token choice, parameter counts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config

from conftest import random_packed_row, tiny_drafter, tiny_target_config
from dflash_train.core.drafter import (
    DFlashDrafter,
    DrafterCache,
    build_drafter_config,
    count_parameters,
    default_target_layer_ids,
    resolve_mask_token_id,
)
from dflash_train.core.loss import LossSettings
from dflash_train.core.masks import build_attention_masks, build_layout, sample_anchors, step_generator

H = 64


def _packed_case(seed, block_size, num_docs=3, num_anchors=5):
    gen = torch.Generator().manual_seed(seed)
    lengths, loss_mask = random_packed_row(gen, num_docs, max_len=30, pad=2)
    T = loss_mask.numel()
    anchors = sample_anchors(loss_mask, lengths, num_anchors, gen, pad_to_multiple=2)
    layout = build_layout(anchors, loss_mask, lengths, block_size)
    features = torch.randn(1, T, 0, generator=gen)  # width set by caller
    input_ids = torch.randint(0, 120, (T,), generator=gen)
    return lengths, loss_mask, layout, input_ids, gen


def _train_forward(drafter, layout, feats_T, embed_NB, backend):
    masks = build_attention_masks(layout, drafter.layer_types, drafter.config.sliding_window, backend)
    return drafter(feats_T[None], embed_NB[None], layout.position_ids(), attention_mask=masks)[0]


@pytest.mark.parametrize("window", [None, 7])
def test_train_serve_consistency(window):
    """Training forward on a packed row == inference forward per block with only the context
    of positions < anchor (what serving gives the drafter), to 1e-5 in fp32."""
    B = 4
    drafter = tiny_drafter(num_layers=2, block_size=B, sliding_window=window)
    n_taps = len(drafter.target_layer_ids)
    checked = 0
    for seed in range(4):
        lengths, loss_mask, layout, input_ids, gen = _packed_case(seed, B)
        feats = torch.randn(layout.num_ctx, n_taps * H, generator=gen)
        table = torch.randn(128, H, generator=gen)
        embed = table[layout.block_input_ids(input_ids, 127)]
        with torch.no_grad():
            out = _train_forward(drafter, layout, feats, embed, "sdpa").view(-1, B, H)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        for n, a in enumerate(layout.anchors_N.tolist()):
            if a < 0:
                continue
            d = int(layout.doc_T[a])
            s = int(starts[d])
            ctx = feats[s:a][None]
            pos = torch.arange(0, a - s + B)[None]
            with torch.no_grad():
                ref = drafter(ctx, embed.view(-1, B, H)[n][None], pos)[0]
            torch.testing.assert_close(out[n], ref, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked > 10


def test_mixed_precision_training_keeps_activations_in_bf16():
    """Training runs float32 master weights under bf16 autocast; serving runs bf16 weights. Every
    RMSNorm (hidden, q/k, layer and final norms) returns its input's dtype in both, so training's
    activations are bf16 as serving's are (before, a float32 weight made them float32: the q/k
    path, rope and the lm_head's input ran in float32 in training only), and the two forwards
    agree to bf16 rounding."""
    from dflash_train.core.drafter import RMSNorm

    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, H).to(torch.bfloat16)
    x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (norm.weight * x32.to(torch.bfloat16)).to(torch.bfloat16), atol=0, rtol=0)
    assert norm(x.float()).dtype == torch.float32  # float32 inference is untouched

    B = 4
    drafter = tiny_drafter(num_layers=2, block_size=B)
    lengths, loss_mask, layout, input_ids, gen = _packed_case(0, B)
    feats = torch.randn(layout.num_ctx, len(drafter.target_layer_ids) * H, generator=gen).to(torch.bfloat16)
    embed = torch.randn(128, H, generator=gen)[layout.block_input_ids(input_ids, 127)].to(torch.bfloat16)
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
             for m in drafter.modules() if isinstance(m, RMSNorm)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        train = _train_forward(drafter, layout, feats, embed, "sdpa")
    for h in hooks:
        h.remove()
    assert train.dtype == torch.bfloat16 and set(seen) == {torch.bfloat16}, set(seen)
    with torch.no_grad():
        serve = _train_forward(drafter.to(torch.bfloat16), layout, feats, embed, "sdpa")
    assert serve.dtype == torch.bfloat16
    err = (train.float() - serve.float()).abs().max() / serve.float().abs().max()
    assert err < 0.05, err


def test_flex_forward_equals_dense():
    B = 4
    for window in (None, 9):
        drafter = tiny_drafter(num_layers=2, block_size=B, sliding_window=window)
        lengths, loss_mask, layout, input_ids, gen = _packed_case(11, B, num_docs=4)
        feats = torch.randn(layout.num_ctx, 2 * H, generator=gen)
        embed = torch.randn(layout.num_blocks * B, H, generator=gen)
        with torch.no_grad():
            dense = _train_forward(drafter, layout, feats, embed, "sdpa")
            flex = _train_forward(drafter, layout, feats, embed, "flex")
        torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


def test_cached_inference_matches_one_shot():
    """Serving loop shape: context arrives in pieces through the cache, blocks are cropped off."""
    B = 4
    for window in (None, 6):
        drafter = tiny_drafter(num_layers=3, block_size=B, sliding_window=window)
        gen = torch.Generator().manual_seed(5)
        feats = torch.randn(1, 13, len(drafter.target_layer_ids) * H, generator=gen)
        block = torch.randn(1, B, H, generator=gen)
        with torch.no_grad():
            one_shot = drafter(feats, block, torch.arange(13 + B)[None])
            cache = DrafterCache()
            first = drafter(feats[:, :9], block, torch.arange(9 + B)[None], past_key_values=cache, use_cache=True)
            assert cache.get_seq_length() == 9 + B
            cache.crop(9)  # drop the block, keep context 0..8
            second = drafter(feats[:, 9:], block, torch.arange(9, 13 + B)[None], past_key_values=cache)
        torch.testing.assert_close(second, one_shot, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(first, one_shot)


def test_gradients_reach_every_drafter_parameter():
    B = 4
    drafter = tiny_drafter(num_layers=2, block_size=B).train()
    lengths, loss_mask, layout, input_ids, gen = _packed_case(3, B)
    feats = torch.randn(layout.num_ctx, 2 * H, generator=gen)
    embed = torch.randn(layout.num_blocks * B, H, generator=gen)
    _train_forward(drafter, layout, feats, embed, "sdpa").square().mean().backward()
    for name, p in drafter.named_parameters():
        assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name


def test_published_parameter_names_and_no_target_weights():
    drafter = tiny_drafter(num_layers=2)
    names = set(drafter.state_dict())
    per_layer = {
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight",
    }
    want = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {"norm.weight", "fc.weight", "hidden_norm.weight"}
    assert names == want


def test_save_load_round_trip_is_bit_exact(tmp_path):
    drafter = tiny_drafter(num_layers=2, block_size=4, sliding_window=8).to(torch.bfloat16)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"target_layer_ids": drafter.target_layer_ids, "mask_token_id": 127,
                                    "block_size": 4}
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["sliding_window"] == 8
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert loaded.block_size == 4 and loaded.mask_token_id == 127
    x = torch.randn(1, 5, 2 * H, dtype=torch.bfloat16)
    e = torch.randn(1, 4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(drafter(x, e, torch.arange(9)[None]), loaded(x, e, torch.arange(9)[None]))


def test_foreign_published_config_loads_as_written(tmp_path):
    """A folder written by another exporter: block_size inside dflash_config, legacy
    rope_theta, explicit taps and mask id, extra fields, 'model.' name prefix."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "vocab_size": 128, "max_position_embeddings": 512,
        "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
        "num_target_layers": 30, "torch_dtype": "bfloat16", "use_cache": False,
        "dflash_config": {"block_size": 10, "target_layer_ids": [2, 7, 28], "mask_token_id": 101},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    reference = DFlashDrafter(Qwen3Config(**{**cfg, "layer_types": ["full_attention"]}))
    from safetensors.torch import save_file

    save_file({f"model.{k}": v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.target_layer_ids == [2, 7, 28]
    assert loaded.mask_token_id == 101 and loaded.block_size == 10
    assert loaded.fc.weight.shape == (64, 3 * 64)
    assert loaded.config.rope_parameters["rope_theta"] == 1000000.0
    for k, v in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


def test_bad_folders_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDrafter.from_pretrained(tmp_path)
    # A model's config (no block_size, no dflash_config) is not a drafter: said in one line.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="not a DFlash drafter folder .a llama model's folder"):
        DFlashDrafter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 1, "block_size": 4}))
    with pytest.raises(ValueError) as err:
        DFlashDrafter.from_pretrained(tmp_path)
    msg = str(err.value)
    assert "target_layer_ids is missing" in msg and "mask_token_id is missing" in msg and "vocab_size" in msg
    drafter = tiny_drafter(num_layers=1)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    cfg["layer_types"] = ["full_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing.*layers.1"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_default_taps():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(30, 3) == [1, 14, 27]
    cfg = build_drafter_config(tiny_target_config(), num_layers=3, mask_token_id=1)
    assert cfg.dflash_config["target_layer_ids"] == default_target_layer_ids(8, 3)
    cfg = build_drafter_config(tiny_target_config(), num_layers=3, mask_token_id=1, target_layer_ids=[0, 6])
    assert cfg.dflash_config["target_layer_ids"] == [0, 6]
    cfg = build_drafter_config(tiny_target_config(), num_layers=2, num_taps=4, mask_token_id=1)
    assert len(cfg.dflash_config["target_layer_ids"]) == 4


def test_config_errors_are_reported_together():
    with pytest.raises(ValueError) as err:
        build_drafter_config(
            tiny_target_config(), num_layers=2, block_size=1, mask_token_id=1,
            target_layer_ids=[3, 8], layer_types=["full_attention", "sliding_attention"],
        )
    msg = str(err.value)
    assert "block_size" in msg and "target_layer_ids" in msg and "sliding_window" in msg


def test_rope_settings_come_from_the_target():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = build_drafter_config(tiny_target_config(rope_parameters=rope), num_layers=1, mask_token_id=1)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 8.0
    d = DFlashDrafter(cfg)
    plain = DFlashDrafter(build_drafter_config(tiny_target_config(), num_layers=1, mask_token_id=1))
    assert not torch.allclose(d.rotary_emb.inv_freq, plain.rotary_emb.inv_freq)


def test_all_sliding_window_is_one_setting():
    cfg = build_drafter_config(tiny_target_config(), num_layers=3, mask_token_id=1, sliding_window=2048)
    assert cfg.layer_types == ["sliding_attention"] * 3 and cfg.sliding_window == 2048


def test_mask_token_choice_on_real_smollm2(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    rows = 49152
    chosen = resolve_mask_token_id(tok, rows)
    name = tok.convert_ids_to_tokens(chosen)
    assert chosen not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    assert name.startswith("<") and chosen in tok.all_special_ids or chosen in tok.added_tokens_decoder
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=True, add_generation_prompt=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert chosen not in ids
    assert resolve_mask_token_id(tok, rows, configured=chosen) == chosen
    ordinary = tok("hello").input_ids[0]
    with pytest.raises(ValueError, match="ordinary vocabulary token"):
        resolve_mask_token_id(tok, rows, configured=ordinary)
    with pytest.raises(ValueError, match="no embedding row"):
        resolve_mask_token_id(tok, rows, configured=rows)
    # Qwen-style: embedding rows past the tokenizer's vocabulary are preferred.
    assert resolve_mask_token_id(tok, rows + 64) == len(tok)


def test_mask_token_prefers_reserved_special(smollm2_path):
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]})
    rid = tok.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert resolve_mask_token_id(tok, len(tok)) == rid
    with pytest.raises(ValueError, match="explicitly"):
        resolve_mask_token_id(None, 100)


def _count_on_meta(cfg):
    with torch.device("meta"):
        return count_parameters(DFlashDrafter(cfg))


def test_parameter_counts_of_published_shapes(smollm2_path):
    qwen3_8b = Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    n = _count_on_meta(build_drafter_config(qwen3_8b, num_layers=5, mask_token_id=151669))
    assert 1.0e9 < n < 1.1e9, n
    from transformers import AutoConfig

    smol = AutoConfig.from_pretrained(smollm2_path)
    n_smol = _count_on_meta(build_drafter_config(smol, num_layers=5, mask_token_id=16))
    layer = 576 * (9 * 64) * 2 + 576 * (3 * 64) * 2 + 3 * 576 * 1536 + 2 * 64 + 2 * 576
    assert n_smol == 5 * layer + 5 * 576 * 576 + 2 * 576


def _train_on_iid_tokens(mask_for, steps=80, V=32, B=4, seed=0):
    """Train on fresh i.i.d. random tokens whose context feature at p encodes token p: the
    next tokens are unpredictable unless the mask leaks context at or after the anchor."""
    from dflash_train.core.loss import block_loss

    torch.manual_seed(seed)
    target = tiny_target_config(vocab_size=V, num_hidden_layers=4)
    drafter = DFlashDrafter(build_drafter_config(target, num_layers=1, block_size=B, mask_token_id=V - 1, num_taps=1)).train()
    embed = torch.randn(V, H) * 0.5
    lm_head = torch.randn(V, H) * 0.1
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        gen = step_generator(seed, step)
        lengths = torch.tensor([40, 25, 31])
        T = int(lengths.sum())
        ids = torch.randint(0, V - 1, (T,), generator=gen)
        loss_mask = torch.ones(T, dtype=torch.bool)
        anchors = sample_anchors(loss_mask, lengths, 12, gen)
        layout = build_layout(anchors, loss_mask, lengths, B)
        feats = embed[ids][None]
        mask = mask_for(layout)
        hidden = drafter(feats, embed[layout.block_input_ids(ids, V - 1)][None], layout.position_ids(), attention_mask=mask)[0]
        out = block_loss(hidden, lm_head, layout.labels(ids), layout.valid_NB.flatten(), B, LossSettings(gamma=2.0))
        opt.zero_grad()
        out.loss().backward()
        opt.step()
        losses.append(out.loss().item())
    return sum(losses[-10:]) / 10


def test_training_cannot_see_the_future():
    """End to end through anchors, layout, mask, drafter and loss: with the real mask the loss
    stays at chance on unpredictable tokens; a mask that leaks one position drives it down."""
    import math

    from dflash_train.core.masks import block_mask_mod, dense_mask

    def real(layout):
        return build_attention_masks(layout, ["full_attention"], None, "sdpa")

    def leaky(layout):  # context visible up to and including the first predicted position
        shifted = layout.anchors_N + 2
        mod = block_mask_mod(shifted, layout.ctx_start_N, layout.num_ctx, layout.block_size)
        Q = layout.num_blocks * layout.block_size
        return dense_mask(mod, Q, layout.num_ctx + Q, "cpu")

    chance = math.log(31)
    assert _train_on_iid_tokens(real) > chance - 0.2
    assert _train_on_iid_tokens(leaky) < chance - 0.5
