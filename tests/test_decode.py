"""The decoding engine (decode.py) and its token choice (sampling.py): token choice, buckets, the static cache, continuous
batching against transformers' own greedy generation, and (on a CUDA machine only) captured
CUDA graphs against eager runs of the same steps."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import SimulatedGraphs, tiny_drafter, tiny_target_config
from dflash_train.core.attention import additive_mask, causal_position_mask
from dflash_train.engine.decode import StaticCache, TargetSteps, pick, row_buckets, width_buckets
from dflash_train.engine.decoder import Decoder
from dflash_train.engine.graphs import Graphs
from dflash_train.engine.proposer import DFlashProposer
from dflash_train.engine.sampling import choose, position_uniform
from dflash_train.engine.slots import SlotDecoder

VOCAB = 128
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_target_config()).eval()


def prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt, new: int, stop: int | None = None) -> list[int]:
    """transformers' greedy generate (an explicit mask: a prompt token equal to the pad id is
    not padding)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=stop, **({} if stop is not None else {"min_new_tokens": new}))
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- token choice


def test_position_uniform_depends_on_seed_and_position_only():
    seeds, pos = torch.tensor([3, 3, 4, 2**40 + 3]), torch.arange(12).reshape(4, 3) + 5
    u = position_uniform(seeds, pos)
    assert u.dtype == torch.float32 and bool((u > 0).all() and (u < 1).all())
    for r in range(4):  # a row alone draws what it draws beside others
        assert torch.equal(position_uniform(seeds[r : r + 1], pos[r : r + 1]), u[r : r + 1])
    same = position_uniform(torch.tensor([3]), torch.tensor([[5, 6, 7]]))
    assert torch.equal(same, u[:1])
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[3])  # other seeds, other numbers
    many = position_uniform(torch.tensor([7]), torch.arange(20000)[None])[0]
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.003


def test_choose_greedy_sampling_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])[None, None].repeat(1, 6000, 1)
    pos, seed = torch.arange(6000)[None], torch.tensor([11])
    assert torch.equal(choose(logits, pos, seed), torch.zeros(1, 6000, dtype=torch.long))
    T = 1.3
    freq = torch.bincount(choose(logits, pos, seed, T)[0], minlength=5).float() / 6000
    assert torch.allclose(freq, torch.softmax(logits[0, 0] / T, -1), atol=0.03)
    # At T=1 the two most likely tokens hold 0.877 and three hold 0.964 of the mass: top-p 0.8
    # samples among two, top-p 0.9 among three, each renormalised.
    probs = torch.softmax(logits[0, 0], -1)
    for top_p, kept in ((0.8, 2), (0.9, 3)):
        freq = torch.bincount(choose(logits, pos, seed, 1.0, top_p=top_p)[0], minlength=5).float() / 6000
        assert freq[kept:].sum() == 0
        assert torch.allclose(freq[:kept], probs[:kept] / probs[:kept].sum(), atol=0.03)
    assert torch.equal(choose(logits, pos, seed, 1.0, top_p=1e-6)[0], torch.zeros(6000, dtype=torch.long))


def test_buckets():
    assert row_buckets(1) == [1] and row_buckets(6) == [1, 2, 4, 6] and row_buckets(8) == [1, 2, 4, 8]
    widths = width_buckets(1000)
    assert widths[0] == 64 and widths[-1] == 999 and widths == sorted(set(widths))
    assert all(b / a <= 1.5 for a, b in zip(widths, widths[1:-1]))
    assert pick(65, widths) == 96 and pick(64, widths) == 64
    with pytest.raises(ValueError):
        pick(1000, widths)


# --------------------------------------------------------------------------- the cache


def test_static_cache_writes_columns_of_the_chosen_rows():
    cache = StaticCache(rows=3, capacity=9)
    k = torch.arange(2 * 2 * 4 * 1, dtype=torch.float32).reshape(2, 2, 4, 1) + 1
    cache.bind(torch.tensor([[0, 1, 2, 8], [3, 4, 8, 8]]), 5, row_index=torch.tensor([2, 0]))
    keys, _ = cache.update(k, -k, 0)
    assert keys.shape == (2, 2, 5, 1)
    assert torch.equal(cache.keys[0][2, :, :3], k[0, :, :3]) and torch.equal(cache.keys[0][0, :, 3:5], k[1, :, :2])
    assert cache.keys[0][1].abs().sum() == 0  # slot 1 untouched
    cache.bind(torch.tensor([[5], [6]]), 7)  # rows 0..1, one new column each
    keys, values = cache.update(k[:, :, :1] * 10, k[:, :, :1], 0)
    assert torch.equal(keys[0, :, 5], k[0, :, 0] * 10) and torch.equal(values[1, :, 6], k[1, :, 0])
    cache.move_rows(torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(cache.keys[0][1], cache.keys[0][2])
    with pytest.raises(ValueError, match="capacity"):
        cache.bind(torch.tensor([[0]]), 9)


# --------------------------------------------------------------------------- continuous batching


class _Recorded:
    """A stand-in for a CUDA graph: says when it is destroyed and whether a capture was under way."""

    def __init__(self, name, log, capturing):
        self.name, self.log, self.capturing = name, log, capturing

    def replay(self):
        pass

    def __del__(self):
        self.log.append((self.name, self.capturing[0]))


class _RecordingGraphs(Graphs):
    """Graphs whose CUDA part is simulated on CPU: a capture runs fn once, and, as the automatic
    collector would at any allocation, collects garbage in the middle of it when collection is on."""

    def __post_init__(self):
        self.enabled, self.pool, self.log, self.capturing = True, None, [], [False]

    def _record(self, fn, static):
        self.capturing[0] = True
        try:
            outputs = fn(*static)
            if gc.isenabled():
                gc.collect()
        finally:
            self.capturing[0] = False
        return _Recorded(fn.__name__, self.log, self.capturing), outputs


def check_additive_mask_attends_as_its_bool_mask(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, 32, generator=g).to(device, dtype)
    k, v = (torch.randn(3, 2, 80, 32, generator=g).to(device, dtype) for _ in range(2))
    anchors = torch.tensor([0, 20, 60], device=device)
    block_pos = anchors[:, None] + torch.arange(16, device=device)
    for visible in ((torch.arange(80, device=device) < (anchors + 16)[:, None])[:, None, None, :],
                    causal_position_mask(block_pos, 80, window=24)):
        mask = additive_mask(visible, dtype)
        assert mask.dtype == dtype and torch.equal(mask == 0, visible)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_additive_mask_attends_as_its_bool_mask_bit_for_bit(dtype):
    """The drafter's block step hands its layers additive masks made once (attention.additive_mask):
    attention gives what it gives for the bool masks, full and sliding, rows of other lengths
    (tests/test_gpu.py: on the GPU)."""
    check_additive_mask_attends_as_its_bool_mask("cpu", dtype)


def test_a_capture_never_destroys_an_unreachable_graph():
    """A replaced step set's graphs reach their owner through their step functions: a cycle
    that only the collector frees. A collection inside a later capture would destroy them
    there, which CUDA refuses (the capture is lost, and with it the run). Graphs holds the
    collector off while it captures, and clear() destroys its graphs at once."""
    graphs = _RecordingGraphs(torch.device("cpu"))

    def replaced_step_set():
        """An owner whose captured step function closes over it, left unreachable."""
        class Owner:
            pass

        owner = Owner()
        owner.graphs = _RecordingGraphs(torch.device("cpu"))
        owner.graphs.log, owner.graphs.capturing = graphs.log, graphs.capturing

        def old(x):
            return (x + owner.graphs.num_captured,)  # the closure holds the owner: a cycle

        owner.graphs.run("old", old, torch.zeros(2))

    def new(x):
        return (x + 1,)

    was = gc.isenabled()
    gc.enable()
    try:
        gc.collect()  # the counts start from zero: no automatic collection before the capture
        replaced_step_set()  # garbage that only the collector can free
        (out,) = graphs.run("new", new, torch.zeros(2))
        assert out.tolist() == [1.0, 1.0]
        assert ("old", True) not in graphs.log, "a graph was destroyed while another was being captured"
        assert gc.isenabled(), "the collector is back on after the capture"
        gc.collect()
        assert graphs.log == [("old", False)]
        graphs.clear()
        assert graphs.log == [("old", False), ("new", False)]
    finally:
        (gc.enable if was else gc.disable)()


def _sliding_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=5, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["llama", "sliding"])
def test_the_graph_paths_decode_as_eager(tiny_target, kind, monkeypatch):
    """Every step the engine captures on a GPU (prefills of up to PREFILL_GRAPH_ROWS rows padded
    to a width bucket, the prompt context written ahead, decode steps, fused cycles), run through
    simulated graphs on CPU: target-only and speculative outputs equal transformers' greedy
    output and the eager engine's, acceptance lengths included, at batch 1 and for several rows
    (with padding rows), for a plain and a sliding-window target."""
    from conftest import tiny_drafter
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config
    from dflash_train.engine import decode, proposer

    model = tiny_target if kind == "llama" else _sliding_target()
    drafter = (tiny_drafter(num_layers=2, block_size=4, num_taps=3) if kind == "llama" else
               DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=4, num_taps=2,
                                                  mask_token_id=127)).eval())
    ps = prompts([1, 6, 29, 13, 70], seed=3)
    refs = [hf_greedy(model, p, 20) for p in ps]
    eager = Decoder(model, DFlashProposer.for_target(drafter, model, graphs=False), graphs=False)
    want = [eager.speculate([p], 20)[0] for p in ps]
    assert [w.output_ids for w in want] == refs
    monkeypatch.setattr(decode, "Graphs", SimulatedGraphs)
    monkeypatch.setattr(proposer, "Graphs", SimulatedGraphs)
    engine = Decoder(model, DFlashProposer.for_target(drafter, model))
    engine.capture(rows=1, capacity=128)
    captured_keys = set(engine.target.graphs.entries)
    assert {("prefill", 1, 64), ("prefill", 1, 96), ("decode", 1, 64), ("cycle", 1, 96)} <= captured_keys
    assert ("context", 1, 64, 64) in engine.proposer.graphs.entries
    captured = engine.target.graphs.num_captured + engine.proposer.graphs.num_captured
    for _ in range(2):  # the second time every step replays
        assert [engine.generate([p], 20)[0].output_ids for p in ps] == refs
        got = [engine.speculate([p], 20)[0] for p in ps]
        assert [(g.output_ids, g.acceptance_lengths) for g in got] == \
            [(w.output_ids, w.acceptance_lengths) for w in want]
    assert engine.target.graphs.num_captured + engine.proposer.graphs.num_captured == captured, \
        "batch 1 within the captured capacity replays what capture() captured"
    for n in (5, 3, 5):  # the engine grows to 5 rows (an eager first prefill), then 3 rows pad to 4
        assert [g.output_ids for g in engine.generate(ps[:n], 20)] == refs[:n]
        batched = engine.speculate(ps[:n], 20)
        assert [(g.output_ids, g.acceptance_lengths) for g in batched] == \
            [(w.output_ids, w.acceptance_lengths) for w in want[:n]]
    assert {("prefill", 4, 64), ("prefill", 5, 96)} <= set(engine.target.graphs.entries)
    assert {("context", 4, 64, 64), ("context", 5, 96, 96)} <= set(engine.proposer.graphs.entries)
    engine.close()
    eager.close()


def test_varlen_attention_decodes_as_the_masked_engine(tiny_target, monkeypatch):
    """Decode and verify steps whose rows each read their own keys (attention="varlen"; on CPU
    the reference of FlashAttention's variable-length path: the position mask over the whole
    cache, queries at the rows' last positions) through simulated graphs: target-only output
    with refills and speculative output, alone and batched with padding rows, equal
    transformers' greedy output and the masked engine's acceptance lengths; decode and verify
    steps take one graph per row bucket, whatever their width."""
    from dflash_train.engine import decode, proposer

    drafter = tiny_drafter(num_layers=2, block_size=4, num_taps=3)
    ps = prompts([1, 6, 29, 13, 70], seed=3)
    refs = [hf_greedy(tiny_target, p, 20) for p in ps]
    masked = Decoder(tiny_target, DFlashProposer.for_target(drafter, tiny_target, graphs=False), graphs=False,
                     attention="masked")
    want = [masked.speculate([p], 20)[0].acceptance_lengths for p in ps]
    monkeypatch.setattr(decode, "Graphs", SimulatedGraphs)
    monkeypatch.setattr(proposer, "Graphs", SimulatedGraphs)
    slots = SlotDecoder.for_model(tiny_target, 3, 128, attention="varlen", refill=1, overlap=True)
    assert slots.steps.attention == "varlen-reference" and masked.target.attention == "masked"
    for i, p in enumerate(ps):
        slots.add(i, p, 20, seed=i)
    assert {f.key: f.output_ids for f in slots.run()} == dict(enumerate(refs))
    assert {k[2] for k in slots.steps.graphs.entries if k[0] == "decode"} == {None}
    engine = Decoder(tiny_target, DFlashProposer.for_target(drafter, tiny_target), attention="varlen")
    for _ in range(2):
        assert [(g.output_ids, g.acceptance_lengths) for g in engine.speculate(ps[:3], 20)] == \
            list(zip(refs[:3], want[:3]))
        assert [engine.speculate([p], 20)[0].acceptance_lengths for p in ps] == want
    # The cycle's graphs are keyed by the drafter's width; the target's verify inside reads by row.
    assert {k[0] for k in engine.target.graphs.entries} <= {"prefill", "cycle", "decode"}
    engine.close()
    masked.close()


def test_key_counts_place_each_rows_queries_at_its_last_positions():
    """A decode step's row reads columns 0..pos; a verify block at p..p+Q-1 reads 0..p+Q-1 with
    query i at p+i; a padding row (positions -1, clamped to 0) reads Q columns, so every query
    of it sees a key."""
    from dflash_train.core.attention import KeyCounts

    decode = KeyCounts.of(torch.tensor([[7], [0], [30]]), 64, tiny_target_config(), flash=False)
    assert decode.last_R.tolist() == [7, 0, 30]
    verify = KeyCounts.of(torch.tensor([[5, 6, 7, 8], [0, 0, 0, 0]]), 64, tiny_target_config(), flash=False)
    assert verify.last_R.tolist() == [8, 3]
    cfg = tiny_target_config()
    hkv = cfg.num_key_value_heads
    group = cfg.num_attention_heads // hkv
    flash = KeyCounts.of(torch.tensor([[7], [0]]), 64, cfg, flash=True)
    assert flash.used_N.tolist() == [8] * hkv + [1] * hkv and flash.used_N.dtype == torch.int32
    assert flash.cu_q_N.tolist() == list(range(0, (2 * hkv + 1) * group, group))
    assert flash.cu_k_N.tolist() == list(range(0, (2 * hkv + 1) * 64, 64))
    flash = KeyCounts.of(torch.tensor([[5, 6, 7, 8]]), 64, cfg, flash=True)
    assert flash.used_N.tolist() == [9] * hkv and flash.cu_q_N.tolist() == list(range(0, (hkv + 1) * 4, 4))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_slot_decoder_refills_and_equals_transformers_greedy(tiny_target, rows, overlap):
    """More requests than rows, of different lengths and budgets, one ending on a stop token:
    every request gets transformers' own greedy output, whatever the row count (refills at
    different moments, rows compacted at the tail), with each step's successor queued before
    its tokens are read or not."""
    ps = prompts([1, 9, 30, 4, 17, 2, 12], seed=rows)
    budgets = [12, 5, 9, 14, 3, 10, 7]
    refs = [hf_greedy(tiny_target, p, n) for p, n in zip(ps, budgets)]
    stop = refs[3][6]  # ends request 3 (and any other that meets it) early
    refs = [r[: r.index(stop) + 1] if stop in r else r for r in refs]
    slots = SlotDecoder.for_model(tiny_target, rows, 64, stop_ids=[stop], refill=2, overlap=overlap)
    assert slots.overlap is overlap
    for i, (p, n) in enumerate(zip(ps, budgets)):
        slots.add(i, p, n, seed=i)
    done = {f.key: f for f in slots.run()}
    assert [done[i].output_ids for i in range(len(ps))] == refs
    assert [done[i].stopped for i in range(len(ps))] == [stop in r for r in refs]
    assert slots.generated == sum(len(r) for r in refs) and not slots.busy


def converse(slots: SlotDecoder, openings: list[list[int]], turns: int, budget: int, rewrite: int = -1):
    """Conversations of `turns` turns on `slots`, each next turn added under the conversation's key
    as soon as its last one is answered: its last prompt, the whole answer and new user ids. With
    `rewrite` = k, conversation k's later prompts change one of their first ids (not a
    continuation of what its slot holds). Returns {key: [output ids per turn]}."""
    prompt_of, outputs = {}, {k: [] for k in range(len(openings))}
    for k, opening in enumerate(openings):
        prompt_of[k] = list(opening)
        slots.add(k, prompt_of[k], budget, seed=k)
    while slots.busy:
        for f in slots.step():
            outputs[f.key].append(f.output_ids)
            if len(outputs[f.key]) < turns:
                user = np.random.default_rng(100 * f.key + len(outputs[f.key])).integers(0, 100, 3 + f.key % 4)
                nxt = prompt_of[f.key] + f.output_ids + user.tolist()
                if f.key == rewrite:
                    nxt[0] = (nxt[0] + 1) % 100
                prompt_of[f.key] = nxt
                slots.add(f.key, nxt, budget, seed=f.key * 10 + len(outputs[f.key]))
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_conversations_next_turn_continues_in_its_slot_with_the_same_tokens(tiny_target, overlap, temperature):
    """continue_turns: a turn added under a finished one's key, its prompt that one's prompt and
    answer and more, prefills only what is new (the keys before it kept in the slot), and every
    turn gets the tokens of prefilling the whole prompt, greedy or sampled; a conversation whose
    earlier ids changed is prefilled whole. Fewer rows than conversations: refills and the
    compaction at the tail run between turns."""
    openings = prompts([5, 11, 3, 8, 14, 2], seed=4)
    runs, reused = [], []
    for keep in (False, True):
        slots = SlotDecoder.for_model(tiny_target, 4, 160, temperature=temperature, top_p=0.95, refill=1,
                                      overlap=overlap, continue_turns=keep)
        runs.append(converse(slots, openings, turns=3, budget=6, rewrite=2))
        reused.append(slots.reused_tokens)
    assert runs[1] == runs[0] and all(len(v) == 3 for v in runs[0].values())
    assert reused[0] == 0
    # Every continued turn kept its last prompt and all but the last answer token: 6 conversations x
    # 2 later turns at most, conversation 2 (rewritten) never.
    assert 0 < reused[1] < sum(len(o) for o in openings) * 4 + 6 * 2 * 12


def test_overlapped_steps_with_requests_arriving_between_them(tiny_target, monkeypatch):
    """Regeneration's pattern, through simulated graphs (a replay rewrites the outputs of the
    graphs captured after it): requests added whenever some finish, while the next step is
    already queued; rows that end at the cache's last usable position (their one step past the
    end writes below the trash column); rows compacted, then refilled. Every request gets
    transformers' greedy output, as with the serial decoder, and the host's time is counted."""
    from dflash_train.engine import decode

    monkeypatch.setattr(decode, "Graphs", SimulatedGraphs)
    capacity = 48
    ps = prompts([3, 20, 7, 31, 1, 12, 25, 5, 9], seed=11)
    budgets = [capacity - 1 - len(p) if i % 3 == 1 else 4 + 2 * i for i, p in enumerate(ps)]
    refs = [hf_greedy(tiny_target, p, n) for p, n in zip(ps, budgets)]
    got = {}
    for overlap in (False, True):
        slots = SlotDecoder.for_model(tiny_target, 4, capacity, refill=1, overlap=overlap)
        queue = list(enumerate(zip(ps, budgets)))
        for key, (p, n) in queue[:3]:
            slots.add(key, p, n, seed=key)
        queue = queue[3:]
        out = {}
        while slots.busy or queue:
            done = slots.step() if slots.busy else []
            for f in done:
                out[f.key] = f.output_ids
            if done or not slots.busy:  # two more join for each batch that finishes
                for key, (p, n) in queue[:2]:
                    slots.add(key, p, n, seed=key)
                queue = queue[2:]
        got[overlap] = out
        assert slots.seconds["prefill_s"] > 0 and slots.seconds["wait_s"] >= 0
        assert slots.generated == sum(len(r) for r in refs)
    assert got[True] == got[False] == dict(enumerate(refs))


def test_a_refill_prefills_its_prompts_in_length_order_in_as_few_forwards_as_fit(tiny_target):
    """One refill admits every waiting request; its prompts are prefilled in length order, each
    forward filled up to the prompt-token cap (padded to its longest prompt), and every request
    still gets greedy output."""
    slots = SlotDecoder.for_model(tiny_target, 6, 128, refill=1, prefill_tokens=64)
    calls, prefill = [], slots.steps.prefill
    slots.steps.prefill = lambda s, ps, *a, **k: calls.append([len(p) for p in ps]) or prefill(s, ps, *a, **k)
    ps = prompts([30, 2, 31, 3, 9, 10], seed=7)
    for i, p in enumerate(ps):
        slots.add(i, p, 5, seed=i)
    done = {f.key: f.output_ids for f in slots.run()}
    # arrival order would take three forwards ([30, 2] padded to 60, [31, 3], [9, 10])
    assert calls == [[2, 3, 9, 10], [30, 31]]
    assert all(len(c) * max(c) <= 64 for c in calls)
    assert [done[i] for i in range(len(ps))] == [hf_greedy(tiny_target, p, 5) for p in ps]


def test_slot_decoder_sampling_is_seeded_and_independent_of_rows(tiny_target):
    ps = prompts([3, 11, 6, 20, 8], seed=5)
    runs = []
    for rows in (1, 2, 5):
        slots = SlotDecoder.for_model(tiny_target, rows, 64, temperature=0.9, top_p=0.95, overlap=rows > 1)
        for i, p in enumerate(ps):
            slots.add(i, p, 10, seed=100 + i)
        runs.append({f.key: f.output_ids for f in slots.run()})
    assert runs[0] == runs[1] == runs[2]
    greedy = Decoder(tiny_target).generate(ps, 10)
    assert [runs[0][i] for i in range(5)] != [g.output_ids for g in greedy]


def test_slot_decoder_refuses_requests_it_cannot_hold(tiny_target):
    slots = SlotDecoder.for_model(tiny_target, 2, 16)
    with pytest.raises(ValueError, match="exceed the cache"):
        slots.add("x", [1] * 10, 6)
    with pytest.raises(ValueError, match="empty prompt"):
        slots.add("y", [], 3)


def test_decoder_grows_its_caches_and_keeps_results(tiny_target):
    engine = Decoder(tiny_target, DFlashProposer.for_target(tiny_drafter(block_size=4), tiny_target), capacity=16)
    short = engine.speculate(prompts([5]), 4)[0]
    long = engine.speculate(prompts([40]), 20)[0]  # needs more than 16 positions: caches rebuilt
    assert engine.target.capacity >= 40 + 20
    assert long.output_ids == hf_greedy(tiny_target, prompts([40])[0], 20)
    assert engine.speculate(prompts([5]), 4)[0].output_ids == short.output_ids


def test_a_smaller_batch_with_longer_prompts_after_a_larger_one(tiny_target):
    """The evaluation's last batch of a set: fewer rows than the one before, longer prompts (the
    caches grow). The fused cycle pads rows to the target cache's row buckets, so the drafter's
    cache must hold as many rows as the target's whatever the batch (an H200 evaluation died on
    a 36-row batch after 64-row ones); every row still equals greedy decoding alone."""
    engine = Decoder(tiny_target, DFlashProposer.for_target(tiny_drafter(block_size=4), tiny_target), capacity=16)
    first = prompts([5, 6, 7, 5], seed=1)
    assert [g.output_ids for g in engine.speculate(first, 6)] == [hf_greedy(tiny_target, p, 6) for p in first]
    rows_before = engine.target.cache.rows
    later = prompts([30, 33, 35], seed=2)  # 3 rows pad to the 4-row bucket; more positions than before
    got = engine.speculate(later, 12)
    assert engine.target.cache.rows == rows_before and engine.target.capacity >= 35 + 12
    assert engine.proposer.row_cache.rows >= engine.target.cache.rows
    assert [g.output_ids for g in got] == [hf_greedy(tiny_target, p, 12) for p in later]
    # Then batches of every size up and down, prompts short and long, on the same engine.
    gen = torch.Generator().manual_seed(3)
    for call, rows in enumerate([1, 4, 2, 3, 1, 4]):
        ps = prompts(torch.randint(3, 60, (rows,), generator=gen).tolist(), seed=10 + call)
        new = int(torch.randint(4, 24, (1,), generator=gen))
        assert [g.output_ids for g in engine.speculate(ps, new)] == [hf_greedy(tiny_target, p, new) for p in ps], call


# --------------------------------------------------------------------------- CUDA graphs (GPU only)


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cuda_target():
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_target_config()).to("cuda").eval()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_steps_equal_eager_steps(cuda_target, dtype):
    """The same prefill, decode and verify steps, captured and eager, on identical caches:
    identical tokens, acceptance counts and features (the graph replays the eager kernels; the
    captured prefill is padded to its width bucket, and no real position sees the padding)."""
    from dflash_train.core.target import LayerTaps

    model = copy.deepcopy(cuda_target).to(dtype)
    with torch.inference_mode(), LayerTaps(model, [1, 3]) as taps:
        outs = []
        for graphs in (True, False):
            steps = TargetSteps(model, 4, 96, taps=taps, graphs=graphs)
            ps = [torch.tensor(p) for p in prompts([5, 17, 9], seed=7)]
            seeds = torch.arange(3, device="cuda")
            steps.prefill(torch.arange(1, device="cuda"), ps[:1], seeds[:1])  # allocates the cache: eager
            first, feats = steps.prefill(torch.arange(3, device="cuda"), ps, seeds)  # 3 rows of 4: captured
            pos = torch.tensor([5, 17, 9], device="cuda")
            tokens = [first]
            for _ in range(6):
                tokens.append(steps.decode(tokens[-1], pos, seeds, int(pos.max())).clone())
                pos = pos + 1
            block = torch.stack([tokens[-1]] + tokens[1:4], dim=1)
            chosen, acc, f = steps.verify(block, pos[:, None] + torch.arange(4, device="cuda"), seeds, int(pos.max()) + 3)
            outs.append((torch.stack(tokens), chosen.clone(), acc.clone(), f.clone(), feats))
            assert steps.graphs.num_captured == (3 if graphs else 0)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@gpu
def test_captured_decoding_is_lossless_in_float32(cuda_target):
    """Graphs on the GPU in float32: target-only output == transformers' greedy generate, and
    speculative output == target-only output, for rows of different lengths; again equal to
    the eager engine's."""
    model = cuda_target
    ps = prompts([1, 6, 29, 13], seed=3)
    refs = [hf_greedy(model, p, 20) for p in ps]
    for graphs in (True, False):
        drafter = tiny_drafter(num_layers=2, block_size=4, num_taps=3).cuda()
        engine = Decoder(model, DFlashProposer.for_target(drafter, model, graphs=graphs), graphs=graphs)
        engine.capture(rows=1, capacity=64)
        assert [engine.generate([p], 20)[0].output_ids for p in ps] == refs
        assert [g.output_ids for g in engine.generate(ps, 20)] == refs
        assert [engine.speculate([p], 20)[0].output_ids for p in ps] == refs
        assert [g.output_ids for g in engine.speculate(ps, 20)] == refs
        assert (engine.capture_seconds > 0) == graphs
        engine.close()


@gpu
def test_captured_slot_decoder_equals_eager(cuda_target):
    model = cuda_target
    ps = prompts([3, 40, 7, 22, 15, 9, 31], seed=9)
    runs = []
    for graphs, overlap in ((True, True), (True, False), (False, True)):
        slots = SlotDecoder.for_model(model, 4, 128, graphs=graphs, refill=1, overlap=overlap)
        for i, p in enumerate(ps):
            slots.add(i, p, 12 + i, seed=i)
        runs.append({f.key: f.output_ids for f in slots.run()})
    assert runs[0] == runs[1] == runs[2]
    assert [runs[0][i] for i in range(len(ps))] == [hf_greedy(model, p, 12 + i) for i, p in enumerate(ps)]


@gpu
def test_continued_turns_on_the_gpu_equal_whole_prefills(cuda_target):
    """On CUDA in float32, with captured steps and varlen or masked attention in the decode steps:
    the next turns that continue in their rows (an eager forward over the position mask) get the
    tokens of prefilling them whole."""
    openings = prompts([5, 40, 3, 18, 27, 9], seed=6)
    runs, kept = [], []
    for keep, attention in ((False, "auto"), (True, "auto"), (True, "masked")):
        slots = SlotDecoder.for_model(cuda_target, 4, 256, refill=1, attention=attention, continue_turns=keep)
        runs.append(converse(slots, openings, turns=3, budget=10))
        kept.append(slots.reused_tokens)
    assert runs[0] == runs[1] == runs[2] and kept[0] == 0 < kept[1] == kept[2]


@gpu
def test_queued_steps_never_wait_for_the_gpu_but_to_read_tokens(cuda_target, monkeypatch):
    """With a decode step in flight, the slot decoder's host work (booking, rows leaving,
    compaction, the next step's launch) must not synchronize with the GPU: a blocking copy to
    the device waits for the step in flight and undoes the overlap. Under CUDA's sync debug
    mode set to error, steps where rows finish and move run through; only the reading of a
    step's tokens may wait. The tokens stay transformers' greedy ones."""
    from dflash_train.engine import slots as slots_module

    model = cuda_target
    ps = prompts([3, 40, 7, 22, 15, 9, 31, 12], seed=4)
    budgets = [6 + 3 * i for i in range(len(ps))]  # rows finish on different steps, then compact
    wait = slots_module._Launched.wait

    def unchecked_wait(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    for checked in (False, True):  # the first pass captures every graph the second replays
        slots = SlotDecoder.for_model(model, 8, 128, refill=1)
        for i, (p, n) in enumerate(zip(ps, budgets)):
            slots.add(i, p, n, seed=i)
        done = {f.key: f.output_ids for f in slots.step()}  # the fill: its first tokens are read
        if checked:
            monkeypatch.setattr(slots_module._Launched, "wait", unchecked_wait)
            torch.cuda.set_sync_debug_mode("error")
        try:
            while slots.busy:
                done.update((f.key, f.output_ids) for f in slots.step())
        finally:
            torch.cuda.set_sync_debug_mode(0)
            monkeypatch.setattr(slots_module._Launched, "wait", wait)
        assert [done[i] for i in range(len(ps))] == [hf_greedy(model, p, n) for p, n in zip(ps, budgets)]


def qwen2_shaped_target(device: str):
    """Four layers of Qwen2.5-0.5B's layer shape (hidden 896, 14 query heads over 2 key/value heads
    of 64, biased q/k/v, tied embedding and lm_head), random weights, a 4,096-token vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=512,
                      rope_theta=1e6, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(device).eval()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_qwen2_shaped_target_is_lossless_batched_with_refills(device):
    """The engine on Qwen2's real head layout (7 query heads per key/value head, so 7 grouped
    query rows a decode step and 7 x B a verify step), in float32, with graphs where CUDA has
    them: 6 prompts of mixed lengths through 4 rows (refills, rows retiring at their budgets),
    target-only and speculative output both equal to transformers' greedy generate."""
    from dflash_train.core.drafter import DFlashDrafter, build_drafter_config

    model = qwen2_shaped_target(device)
    drafter = DFlashDrafter(build_drafter_config(model.config, num_layers=1, block_size=8,
                                                 mask_token_id=4095)).to(device).eval()
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randint(0, 4094, (n,), generator=gen).tolist() for n in (5, 70, 23, 140, 9, 47)]
    budgets = [20, 9, 31, 14, 26, 17]
    refs = [hf_greedy(model, p, n) for p, n in zip(ps, budgets)]
    graphs = device == "cuda"
    with torch.inference_mode():
        slots = SlotDecoder.for_model(model, 4, 192, graphs=graphs, refill=1)
        for i, (p, n) in enumerate(zip(ps, budgets)):
            slots.add(i, p, n, seed=i)
        assert {f.key: f.output_ids for f in slots.run()} == dict(enumerate(refs))
        engine = Decoder(model, DFlashProposer.for_target(drafter, model, graphs=graphs), graphs=graphs)
        for rows in ((0, 1, 2, 3), (4, 5)):
            specs = engine.speculate([ps[i] for i in rows], max(budgets[i] for i in rows))
            assert [g.output_ids[:budgets[i]] for i, g in zip(rows, specs)] == [refs[i] for i in rows]
        engine.close()


@gpu
@pytest.mark.parametrize("queries", [1, 16])
def test_flash_varlen_attention_equals_its_reference(queries):
    """FlashAttention's variable-length path on the cache as it lies (per-row key counts, stale
    columns past them, SmolLM2's 9 query heads over 3 key/value heads of 64), bf16, a padding
    row included, against the position-mask reference; and a verify block's last query equals a
    decode step at its position bit for bit (the two steps' kernels agree)."""
    from dflash_train.core.attention import KeyCounts, varlen_attention

    torch.manual_seed(0)
    R, Hkv, G, C, D = 5, 3, 3, 384, 64
    cfg = tiny_target_config(hidden_size=Hkv * G * D, num_attention_heads=Hkv * G, num_key_value_heads=Hkv,
                             head_dim=D)
    k, v = (torch.randn(R, Hkv, C, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(R, Hkv * G, queries, D, device="cuda", dtype=torch.bfloat16)
    first = torch.tensor([0, 17, 127, 300, 0], device="cuda")
    pos = first[:, None] + torch.arange(queries, device="cuda")
    pos[-1] = 0  # a padding row: every position clamped to 0
    module = torch.nn.Module()

    def attend(q, pos, flash):
        keys = KeyCounts.of(pos, C, cfg, flash)
        return varlen_attention(module, q, k, v, None, scaling=D ** -0.5, dflash_keys=keys)[0]

    got, ref = attend(q, pos, True), attend(q, pos, False)
    assert got.shape == ref.shape == (R, queries, Hkv * G, D)
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=0), float((got - ref).abs().max())
    if queries > 1:
        last = attend(q[:, :, -1:].contiguous(), pos[:, -1:], True)
        assert torch.equal(last[:-1], got[:-1, -1:])
