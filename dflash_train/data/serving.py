"""Serving engines: regeneration answered by OpenAI-compatible servers (vLLM, SGLang, `transformers serve`).

Owns talking to those servers for `data regenerate --server`. A ServerPool over one or more
base URLs sends prompts, already rendered with the target's chat template, to their
`/v1/completions` endpoint through the `openai` client; keeps at most `concurrency` requests in
flight over all servers; gives each request to the server with the fewest in flight; lets the
client retry refused connections, timeouts and 408/409/429/5xx answers with exponential backoff
(0.5 s doubling up to 8 s, minus up to 25% jitter; a server's Retry-After wins); then fails with
a ServerError naming the server and the cause. `check()` asks every server once, before any
work, so a wrong URL or model name fails in seconds.

Also owns what is sent: the prompt text whose server-side tokenization equals ours
(`prompt_text`) and the per-turn sampling seed (`turn_seed`, which local regeneration uses
too), and the `--server*` options of a run (`ServingOptions`). regenerate.py schedules the turns
(responders.ServerResponder drives a pool); nothing here reads or writes records.

The `openai` client is an optional dependency (the `serving` extra), so it is imported inside the
functions that use it, only when `--server` is given.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

from dflash_train.core.errors import FAILED, InputError, UserError

DEFAULT_CONCURRENCY = 32
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_RETRIES = 3
CONNECT_TIMEOUT_S = 10.0
PROBE_PROMPT = "Hello"  # check()'s one-token request
RETRIED_STATUS = (408, 409, 429)  # and every 5xx: the statuses the openai client retries


@dataclass(frozen=True)
class ServingOptions:
    """The serving engines a regeneration sends its turns to (`--server URL`, repeated) and how
    (`--concurrency`, `--server-model`, `--timeout`, `--retries`); ServerPool checks them."""

    urls: tuple[str, ...]
    concurrency: int = DEFAULT_CONCURRENCY
    model: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    retries: int = DEFAULT_RETRIES

    def pool(self) -> ServerPool:
        """A ServerPool over these servers (an InputError when the settings are invalid)."""
        return ServerPool(self.urls, concurrency=self.concurrency, model=self.model, timeout=self.timeout,
                          retries=self.retries)


class ServerError(UserError, RuntimeError):
    """A server refused, failed or timed out (after its retries); the message names it."""

    exit_code = FAILED


def api_base(url: str) -> str:
    """The client's base URL for a server given as `http://host:port` or `.../v1`."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def turn_seed(seed: int, position: int, turn: int) -> int:
    """The sampling seed of assistant turn `turn` (0-based) of the record at `position`: fixed
    by the data, so a turn is sampled alike by any server, at any concurrency, in a fresh or a
    resumed run (where the engine honours the request's `seed`). 31 bits, which every engine takes."""
    digest = hashlib.blake2b(f"{seed}:{position}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def prompt_text(tokenizer, text: str) -> str:
    """The text to send for a rendered prompt so that the server's token ids equal ours.

    We tokenize a rendered template without adding special tokens (the template writes its own);
    completions endpoints tokenize the prompt with them added, which for Llama-style tokenizers
    is a second BOS. The text is sent as is when that adds nothing, and without the template's
    leading BOS when the server adds exactly that one back. Token-id prompts would avoid this but
    `transformers serve` takes only text."""
    ours = tokenizer(text, add_special_tokens=False)["input_ids"]
    theirs = tokenizer(text)["input_ids"]
    if theirs == ours:
        return text
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer(text[len(bos):])["input_ids"] == ours:
        return text[len(bos):]
    raise ServerError("the target's tokenizer adds special tokens that the rendered prompt does not hold, so "
                      "a completions endpoint would generate from other tokens than the local path: "
                      f"{len(theirs)} tokens with them, {len(ours)} without")


def _retried(err: Exception) -> bool:
    import openai  # optional dependency (the serving extra): only --server needs it

    if isinstance(err, openai.APIConnectionError):  # also timeouts
        return True
    status = getattr(err, "status_code", None)
    return status is not None and (status in RETRIED_STATUS or status >= 500)


def describe(err: Exception, timeout: float) -> str:
    """The cause of a failed request, in words: timed out, connection failed (why), or the
    HTTP status and the start of the server's answer."""
    import openai  # optional dependency (the serving extra): only --server needs it

    if isinstance(err, openai.APITimeoutError):
        if timeout <= CONNECT_TIMEOUT_S:
            return f"timed out after {timeout:g} s"
        return f"timed out ({CONNECT_TIMEOUT_S:g} s to connect, {timeout:g} s to answer)"
    if isinstance(err, openai.APIConnectionError):
        return f"connection failed ({err.__cause__ or err})"
    if isinstance(err, openai.APIStatusError):
        body = err.response.text.strip().replace("\n", " ")
        return f"HTTP {err.status_code}: {body[:300]}"
    return f"{type(err).__name__}: {err}"


@dataclass
class _Server:
    url: str
    client: Any  # openai.OpenAI
    model: str | None
    num_in_flight: int = 0
    num_sent: int = 0


class ServerPool:
    """Completion requests spread over OpenAI-compatible servers.

    `check()` first (it resolves each server's model name), then `submit(...)` from any thread:
    a Future of `(text, finished)`. At most `concurrency` requests are in flight over all
    servers; each goes to the server with the fewest in flight (then the fewest sent). `model`
    names the model on every server; without it each server's `/v1/models` must list exactly one.
    `timeout` is per request attempt in seconds; a request is tried `retries + 1` times.
    A server started with an API key reads it from $OPENAI_API_KEY."""

    def __init__(self, urls: Iterable[str], concurrency: int = DEFAULT_CONCURRENCY, model: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES):
        try:
            import openai  # optional dependency (the serving extra): only --server needs it
        except ModuleNotFoundError as err:
            raise InputError("--server needs the openai client: pip install 'dflash-train[serving]'") from err
        urls = list(urls)
        problems = [f"server {u!r} is not an http(s) URL" for u in urls if not u.startswith(("http://", "https://"))]
        problems += [f"{name}={value} (need > 0)" for name, value in
                     (("concurrency", concurrency), ("timeout", timeout)) if value <= 0]
        if retries < 0:
            problems.append(f"retries={retries} (need >= 0)")
        if not urls:
            problems.append("no server given")
        if problems:
            raise InputError("invalid server settings: " + "; ".join(problems))
        key = os.environ.get("OPENAI_API_KEY") or "none"  # local engines accept any key
        # A host that drops packets fails within CONNECT_TIMEOUT_S, not after a whole answer's time.
        timeouts = openai.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
        self._servers = [_Server(u, openai.OpenAI(base_url=api_base(u), api_key=key, timeout=timeouts,
                                                  max_retries=retries), model) for u in urls]
        self.concurrency, self.timeout, self.retries = concurrency, timeout, retries
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dflash-server")
        self._checked = False

    def check(self) -> dict[str, str]:
        """Ask every server, without retries, for its model name (unless given) and for one
        token of a completion; a ServerError names the first that does not answer. Returns
        each URL's model name."""
        import openai  # optional dependency (the serving extra): only --server needs it

        for server in self._servers:
            client = server.client.with_options(max_retries=0)
            try:
                if server.model is None:
                    server.model = self._served_model(server, client)
                client.completions.create(model=server.model, prompt=PROBE_PROMPT, max_tokens=1, temperature=0.0)
            except openai.OpenAIError as err:
                what = f" a completion of model {server.model!r}" if server.model is not None else ""
                raise ServerError(f"server {server.url} does not answer{what}: {describe(err, self.timeout)}") from err
        self._checked = True
        return {s.url: s.model for s in self._servers}

    def _served_model(self, server: _Server, client) -> str:
        import openai  # optional dependency (the serving extra): only --server needs it

        try:
            names = [m.id for m in client.models.list()]
        except openai.APIStatusError as err:
            names, cause = [], describe(err, self.timeout)
        else:
            cause = f"it lists {names}"
        if len(names) == 1:
            return names[0]
        raise ServerError(f"server {server.url}: cannot tell which model to ask ({cause}); name it with "
                          "--server-model (for `transformers serve FOLDER`: FOLDER as given there)")

    def submit(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0) -> Future:
        """A Future of `(text, finished)` for one completion of `prompt` (text as the model
        sees it; see prompt_text); `finished` is False when it stopped at `max_new_tokens`
        (finish_reason "length"). It raises ServerError once the retries are spent."""
        assert self._checked, "ServerPool.check() resolves the model names: call it first"
        return self._executor.submit(self._complete, prompt, max_new_tokens, temperature, top_p, seed)

    def _complete(self, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int) -> tuple[str, bool]:
        import openai  # optional dependency (the serving extra): only --server needs it

        with self._lock:
            server = min(self._servers, key=lambda s: (s.num_in_flight, s.num_sent))
            server.num_in_flight += 1
            server.num_sent += 1
        try:
            response = server.client.completions.create(
                model=server.model, prompt=prompt, max_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p if temperature > 0 else 1.0, seed=seed,
            )
        except openai.OpenAIError as err:
            tries = f" (after {self.retries + 1} attempts)" if _retried(err) and self.retries else ""
            raise ServerError(f"server {server.url}: {describe(err, self.timeout)}{tries}") from err
        finally:
            with self._lock:
                server.num_in_flight -= 1
        if not response.choices:
            raise ServerError(f"server {server.url} answered a completion without choices")
        choice = response.choices[0]
        return choice.text, choice.finish_reason == "stop"

    def close(self) -> None:
        """Drop the requests not yet sent and close the connections (requests in flight fail)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        for server in self._servers:
            server.client.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
