"""Who answers a turn during regeneration: the target on the decoding engine (`LocalResponder`,
loaded once per process by `load_responder`, which first checks that its key/value caches fit the
free memory), or serving engines (`ServerResponder` over serving.ServerPool); and `Decoding`, the
settings every responder answers a turn with."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import AutoTokenizer

from dflash_train.core.devices import resolve_device
from dflash_train.core.target import load_target_model
from dflash_train.data.chat_files import DataError
from dflash_train.data.serving import prompt_text
from dflash_train.engine.decode import free_memory_bytes, kv_bytes_per_row
from dflash_train.engine.sampling import stop_token_ids
from dflash_train.engine.slots import SlotDecoder


@dataclass(frozen=True)
class Decoding:
    """How a turn is answered: at most `max_new_tokens` new tokens after a prompt of at most
    `max_prompt_length` tokens, sampled at `temperature` (greedy at 0) within nucleus `top_p`;
    on the decoding engine also `rows` turns decoded at once, CUDA graphs (`graphs`), the next
    step queued before the last one's tokens are read (`overlap`, slots.SlotDecoder) and a
    conversation's next turn going on in its row from the keys its last turn left there
    (`continue_turns`, slots.Continuations)."""

    max_new_tokens: int
    max_prompt_length: int
    temperature: float = 0.0
    top_p: float = 1.0
    rows: int = 1
    graphs: bool = True
    overlap: bool = True
    continue_turns: bool = False

    @property
    def positions(self) -> int:
        """Positions of a row of the engine's caches: the longest prompt, its answer and two more."""
        return self.max_prompt_length + self.max_new_tokens + 2


class Responder(Protocol):
    """What regeneration asks for answers. `submit` hands over one turn's prompt (rendered text
    and its token ids) under a key; `poll` waits until at least one submitted turn is answered
    (returns [] when none is in flight) and returns (key, answer text without the stop token,
    finished on a stop token, the answer's token ids)."""

    capacity: int  # turns worth having in flight at once

    def submit(self, key, text: str, ids: list[int], seed: int) -> None: ...

    def poll(self) -> list[tuple[Any, str, bool, list[int]]]: ...

    def engine_seconds(self) -> dict[str, float]: ...  # ENGINE_STATS it measures, so far

    @property
    def kept_prompt_tokens(self) -> int: ...  # prompt tokens not prefilled again, so far


class LocalResponder:
    """The target on the decoding engine: turns are slots.SlotDecoder requests, `rows` at a
    time, rows refilled as they finish."""

    def __init__(self, model, tokenizer, decoding: Decoding) -> None:
        self.tokenizer, self.max_new_tokens, self.capacity = tokenizer, int(decoding.max_new_tokens), int(decoding.rows)
        stop = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.slots = SlotDecoder.for_model(model, decoding.rows, decoding.positions, temperature=decoding.temperature,
                                           top_p=decoding.top_p, graphs=decoding.graphs, stop_ids=stop,
                                           overlap=decoding.overlap, continue_turns=decoding.continue_turns)
        self.text_seconds = 0.0  # ids -> text of the finished turns (host work between steps)

    @property
    def generated_tokens(self) -> int:
        return self.slots.generated

    @property
    def kept_prompt_tokens(self) -> int:
        """Prompt tokens whose keys a conversation's last turn left in its row (not prefilled)."""
        return self.slots.reused_tokens

    @property
    def load(self) -> int:
        """Turns live on the engine or waiting for a row."""
        return len(self.slots.pending) + self.slots.num_live

    @property
    def capture_seconds(self) -> float:
        return self.slots.steps.graphs.capture_seconds

    def engine_seconds(self) -> dict[str, float]:
        """ENGINE_STATS so far."""
        return dict(self.slots.seconds)

    def submit(self, key, text: str, ids: list[int], seed: int) -> None:
        self.slots.add(key, ids, self.max_new_tokens, seed)

    def poll(self, wait: bool = True) -> list[tuple[Any, str, bool, list[int]]]:
        """As Responder.poll; `wait=False`: one decode step at most, its finished turns (maybe
        none), so that a caller can step two engines in turn."""
        while self.slots.busy:
            done = self.slots.step()
            if not done and not wait:
                return []
            if done:
                began = time.perf_counter()
                answers = [f.output_ids[:-1] if f.stopped else f.output_ids for f in done]
                texts = self.tokenizer.batch_decode(answers, skip_special_tokens=True,
                                                    clean_up_tokenization_spaces=False)
                self.text_seconds += time.perf_counter() - began
                return [(f.key, text, f.stopped, ids) for f, text, ids in zip(done, texts, answers)]
        return []


class ServerResponder:
    """Turns answered by serving engines (serving.ServerPool): each submitted turn is one
    completion request of its rendered prompt (serving.prompt_text: the server's token ids are
    ours), with its turn seed; at most the pool's concurrency are in flight (the servers decode
    with their own rows: `decoding`'s rows and engine switches do not apply)."""

    def __init__(self, pool, tokenizer, decoding: Decoding) -> None:
        self.pool, self.tokenizer = pool, tokenizer
        self.max_new_tokens = int(decoding.max_new_tokens)
        self.temperature, self.top_p = float(decoding.temperature), float(decoding.top_p)
        self.capacity = int(pool.concurrency)
        self.futures: dict = {}
        self.generated_tokens = 0
        self.capture_seconds = 0.0
        self.kept_prompt_tokens = 0  # a server's own prefix cache is its business

    def engine_seconds(self) -> dict[str, float]:
        """None of ENGINE_STATS: the engines' time is the servers'."""
        return {}

    def submit(self, key, text: str, ids: list[int], seed: int) -> None:
        future = self.pool.submit(prompt_text(self.tokenizer, text), self.max_new_tokens, self.temperature,
                                  self.top_p, seed)
        self.futures[future] = key

    def poll(self) -> list[tuple[Any, str, bool, list[int]]]:
        """The requests that completed; a ServerError (the server named) once one failed."""
        if not self.futures:
            return []
        done, _ = wait(self.futures, return_when=FIRST_COMPLETED)
        out = []
        for future in done:
            key = self.futures.pop(future)
            text, finished = future.result()
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self.generated_tokens += len(ids)
            out.append((key, text, finished, ids))
        return out


CACHE_MEMORY_SHARE = 0.9  # of the free memory, at most, for the engine's key/value caches


def check_cache_memory(model, device, *decodings: Decoding) -> None:
    """The engines of `decodings` (allocated together) hold key/value caches for `rows` rows of
    max_prompt_length + max_new_tokens positions each: where they would not fit in the memory free
    on the device, a DataError says how much they need and the largest --batch-size that fits,
    instead of the process dying of an out-of-memory error."""
    free = free_memory_bytes(device)
    if free is None:
        return
    dtype = next(model.parameters()).dtype
    per_row = sum(kv_bytes_per_row(model.config, decoding.positions, dtype) for decoding in decodings)
    rows = max(int(decoding.rows) for decoding in decodings)
    if rows * per_row <= CACHE_MEMORY_SHARE * free:
        return
    fit = int(CACHE_MEMORY_SHARE * free // per_row)
    hint = (f"lower --batch-size to at most {fit if fit < 64 else fit // 64 * 64} (or shorten --max-prompt-length / "
            f"--max-new-tokens)" if fit >= 1 else "no row fits: lower --max-prompt-length or --max-new-tokens")
    positions = " + ".join(f"{decoding.positions:,}" for decoding in decodings)
    raise DataError(f"--batch-size {rows}: the decoding engine's key/value caches for {rows} rows of {positions} "
                    f"positions take {rows * per_row / 2**30:.1f} GiB on {device.type}, and {free / 2**30:.1f} GiB "
                    f"are free there; {hint}")


def load_responder(target, device: str, decoding: Decoding, model=None, tokenizer=None):
    """(LocalResponder on the target, tokenizer): the target loaded once per process."""
    dev = resolve_device(device, setting="--device")
    if model is None:
        model, loaded_tokenizer = load_target_model(str(target), dev)
        tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(target)
    model = model.to(dev).eval()
    check_cache_memory(model, dev, decoding)
    return LocalResponder(model, tokenizer, decoding), tokenizer
