"""Loss masks against a slow token-level reference, on the real SmolLM2 tokenizer and on
Llama-3-style and Qwen3-style (turn-rewriting) templates."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_train.data import chat_files, preparation


def special_ids(tokenizer) -> set[int]:
    ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids | set(tokenizer.all_special_ids)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference_turn(tokenizer, messages, i):
    """Assistant turn i rendered on its own: ids of messages[:i+1] and the token span [start,
    end) of the model's output. The prompt rendering is tokenized separately: the span starts
    at the first token whose text lies wholly after the prompt (a token that merges the end of
    the prompt with the start of the reply, like "\n" + "\n", belongs to neither and is not
    supervised) and ends after the last special token."""
    prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
    prompt_ids = encode(tokenizer, prompt)
    full_ids = encode(tokenizer, tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
    common = next((k for k, (a, b) in enumerate(zip(prompt_ids, full_ids)) if a != b), len(prompt_ids))
    assert common >= len(prompt_ids) - 1, "tokenization differs before the end of the prompt"
    start = common
    while not tokenizer.decode(full_ids[:start], clean_up_tokenization_spaces=False).startswith(prompt):
        start += 1
    specials = special_ids(tokenizer)
    end = len(full_ids)
    for k in range(start, len(full_ids)):
        if full_ids[k] in specials:
            end = k + 1
    return full_ids, start, end


def check_against_reference(tokenizer, messages):
    samples = preparation.tokenize_samples(tokenizer, preparation.supervised_spans(tokenizer, messages))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    expected_masks = [np.zeros(len(ids), dtype=np.uint8) for ids, _ in samples]
    for i in turns:
        full_ids, start, end = reference_turn(tokenizer, messages, i)
        homes = [
            k for k, (ids, mask) in enumerate(samples)
            if list(ids[:end]) == full_ids[:end] and mask[start:end].all()
        ]
        assert len(homes) == 1, f"assistant turn {i} is supervised in {len(homes)} samples, expected 1"
        expected_masks[homes[0]][start:end] = 1
    for (ids, mask), expected in zip(samples, expected_masks):
        assert mask.tolist() == expected.tolist()
    return samples


def msg(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = {
    "single": [msg("user", "What is 2+2?"), msg("assistant", "4.")],
    "system_multi": [
        msg("system", "You answer briefly."),
        msg("user", "Name a prime."),
        msg("assistant", "7"),
        msg("user", "Another one?"),
        msg("assistant", "Eleven, and 13 too."),
        msg("user", "Thanks"),
        msg("assistant", "You're welcome!"),
    ],
    "empty_assistant": [
        msg("user", "Say nothing."),
        msg("assistant", ""),
        msg("user", "Now say hi."),
        msg("assistant", "hi"),
    ],
    "empty_user": [msg("user", ""), msg("assistant", "You sent an empty message.")],
    "whitespace_unicode": [
        msg("user", "  spaces around \n"),
        msg("assistant", "\n  Réponse: ünïcödé 🙂 中文\n\n"),
        msg("user", "code?"),
        msg("assistant", "```python\nprint('x')\n```"),
    ],
    "thinking": [
        msg("user", "Think first."),
        msg("assistant", "<think>\nLet me see.\n</think>\n\nDone."),
        msg("user", "Again."),
        msg("assistant", "<think>\nHmm.\n</think>\n\nDone again."),
    ],
    "consecutive_users": [msg("user", "One."), msg("user", "Two."), msg("assistant", "Both read.")],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_masks_match_reference(any_tokenizer, name):
    template, tokenizer = any_tokenizer
    messages = CONVERSATIONS[name]
    samples = check_against_reference(tokenizer, messages)
    num_turns = sum(m["role"] == "assistant" for m in messages)
    if template == "qwen3":
        # Every earlier assistant turn is rewritten by a later rendering: one sample per turn.
        assert len(samples) == num_turns
    else:
        assert len(samples) == 1
        whole = encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False))
        assert samples[0][0].tolist() == whole


def test_smollm2_mask_by_hand(smollm2_tokenizer):
    """The exact supervised text for SmolLM2: content and <|im_end|>, never the default system
    prompt the template inserts, the headers, or the newline after <|im_end|>."""
    tokenizer = smollm2_tokenizer
    messages = [msg("user", "hi"), msg("assistant", "hello there"), msg("user", "bye"), msg("assistant", "bye!")]
    [(ids, mask)] = preparation.tokenize_samples(tokenizer, preparation.supervised_spans(tokenizer, messages))
    runs = [
        tokenizer.decode([int(ids[k]) for k, _ in group])
        for on, group in itertools.groupby(enumerate(mask), key=lambda x: x[1]) if on
    ]
    assert runs == ["hello there<|im_end|>", "bye!<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(ids)


def test_qwen3_keeps_reasoning_of_earlier_turn(smollm2_path):
    from conftest import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path, "qwen3")
    messages = CONVERSATIONS["thinking"]
    samples = preparation.tokenize_samples(tokenizer, preparation.supervised_spans(tokenizer, messages))
    supervised = [tokenizer.decode(ids[mask.astype(bool)]) for ids, mask in samples]
    assert supervised == [
        "<think>\nLet me see.\n</think>\n\nDone.<|im_end|>",
        "<think>\nHmm.\n</think>\n\nDone again.<|im_end|>",
    ]
    # The final sample shows the first turn as a later turn sees it: reasoning removed.
    assert "Let me see." not in tokenizer.decode(samples[1][0])


def test_bundled_sharegpt_conversations(smollm2_tokenizer):
    """The first real ShareGPT conversations, through the reader, against the reference."""
    from dflash_train.core.assets import sharegpt_json

    records = [r for r in itertools.islice(chat_files.iter_records([sharegpt_json()]), 40)
               if isinstance(r, chat_files.Record)]
    assert len(records) > 30
    for record in records[:30]:
        check_against_reference(smollm2_tokenizer, record.messages)


def test_template_without_prompt_prefix_is_an_error(smollm2_path):
    from conftest import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    # Generation prompt differs from how a finished assistant turn starts.
    tokenizer.chat_template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>bot\\n' }}{%- endif %}"
    )
    with pytest.raises(ValueError, match="generation prompt"):
        preparation.supervised_spans(tokenizer, CONVERSATIONS["single"])
