"""Regeneration through serving engines on CPU: a real `transformers serve` process on 127.0.0.1
(started once for the module) must write what local greedy regeneration writes; a stub server
(the standard library's) stands in for servers that fail, time out or echo what they were sent."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_regenerate import OPENAI, SHAREGPT, tiny_target, write_jsonl  # noqa: F401 - a fixture

from conftest import subprocess_env
from dflash_train.app import cli
from dflash_train.data import regenerate, serving

SERVER_START_S = 180  # a busy 2-core machine imports torch + transformers + fastapi slowly
RECORDS = SHAREGPT[:5] + OPENAI[:2]  # 12 turns, two conversations of two turns, two formats


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    """`transformers serve` of the tiny target (fp32, CPU) and its URL. The bundled tiny target
    answers every prompt with newlines, which would make equality prove nothing; this one's
    answers depend on the prompt."""
    import httpx

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # An empty hub cache: /v1/models (a scan of it in `transformers serve`) then lists nothing.
    cache = tmp_path_factory.mktemp("hub-cache")
    env = subprocess_env(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", HF_HUB_CACHE=str(cache),
                         OMP_NUM_THREADS="1")
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "transformers.cli.transformers", "serve", str(tiny_target),
                                 "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                                stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    try:
        while True:
            assert proc.poll() is None, f"transformers serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"transformers serve did not start:\n{log.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Stub(BaseHTTPRequestHandler):
    """A server of model "stub" whose behaviour is the URL's first path part: `flaky` answers
    its first completion (check()'s) and then only 503, `slow` waits 2 s before answering, any
    other answers "<seed>" (finish_reason "length" for odd seeds)."""

    requests: list[tuple[str, dict]] = []

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, body: dict) -> None:
        mode = self.path.split("/")[1]
        Stub.requests.append((self.path, body))
        if mode == "slow":
            time.sleep(2)
        if self.path.endswith("/models"):
            return self._answer(200, {"object": "list", "data": [{"id": "stub", "object": "model", "created": 0,
                                                                  "owned_by": "test"}]})
        if mode == "flaky" and sum(p == self.path for p, _ in Stub.requests) > 1:
            return self._answer(503, {"error": "overloaded"})
        seed = body.get("seed", 0)
        choice = {"index": 0, "text": f"<{seed}>", "finish_reason": "length" if seed % 2 else "stop"}
        self._answer(200, {"id": "x", "object": "text_completion", "created": 0, "model": "stub", "choices": [choice]})

    def do_GET(self):  # noqa: N802 - the standard library's name
        self._route({})

    def do_POST(self):  # noqa: N802
        self._route(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def regen(argv_tail, src, target, out, capsys):
    """`data regenerate` through the CLI: its exit status and its printed lines (stderr, where
    errors go, then stdout, whose last line is the summary)."""
    argv = ["data", "regenerate", "--data", str(src), "--target", str(target), "--out", str(out),
            "--max-new-tokens", "6", "--batch-size", "1", *argv_tail]
    status = cli.main(argv)
    printed = capsys.readouterr()
    return status, printed.err + printed.out


@pytest.fixture(scope="module")
def local_output(tiny_target, tmp_path_factory):
    """Local greedy regeneration of RECORDS (fp32, CPU): what every server run must write."""
    folder = tmp_path_factory.mktemp("local")
    src = write_jsonl(folder / "in.jsonl", RECORDS)
    options = regenerate.RegenerationOptions(max_new_tokens=6, batch_size=1, device="cpu")
    summary = regenerate.regenerate([src], tiny_target, folder / "out.jsonl", options, log=lambda *_: None)
    return src, (folder / "out.jsonl").read_text(), summary


def test_served_output_equals_local_greedy(tmp_path, tiny_target, served, local_output, capsys):
    src, expected, local = local_output
    out = tmp_path / "out.jsonl"
    status, printed = regen(["--server", served, "--server-model", str(tiny_target), "--concurrency", "3"],
                            src, tiny_target, out, capsys)
    assert status == 0, printed
    assert out.read_text() == expected
    summary = json.loads(printed.splitlines()[-1])
    assert {k: summary[k] for k in regenerate.CHUNK_STATS} == {k: local[k] for k in regenerate.CHUNK_STATS}
    answers = [turn.get("value", turn.get("content")) for line in expected.splitlines()
               for turn in json.loads(line).get("conversations", json.loads(line).get("messages"))]
    assert summary["num_turns"] == 12 and len(set(answers)) > len(RECORDS)  # prompt-dependent answers
    status, printed = regen(["--server", served, "--device", "cpu"], src, tiny_target, tmp_path / "x.jsonl", capsys)
    assert status == 2 and "--workers and --device" in printed  # bad input (errors.py)
    status, printed = regen(["--server", served], src, tiny_target, tmp_path / "x.jsonl", capsys)
    assert status == 1 and f"server {served}: cannot tell which model to ask (it lists [])" in printed
    assert "--server-model" in printed and not (tmp_path / "x.jsonl").exists()


def test_failing_servers_are_named_and_the_output_resumes(tmp_path, tiny_target, served, stub, local_output,
                                                           capsys):
    src, expected, _ = local_output
    out = tmp_path / "out.jsonl"
    model = ["--server-model", str(tiny_target)]
    assert regen(["--server", served, *model, "--limit", "2"], src, tiny_target, out, capsys)[0] == 0
    written = out.read_text()
    assert expected.startswith(written) and len(written.splitlines()) == 2

    # Nothing listens there: check() fails at once, before any request is sent or line written.
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    status, printed = regen(["--server", dead, "--server", served, *model], src, tiny_target, out, capsys)
    assert status == 1 and f"server {dead} does not answer" in printed and "connection failed" in printed
    assert time.monotonic() - started < 30 and out.read_text() == written

    # A server that passes check() and then fails every request (first in the list, so the
    # first request goes to it): retried with backoff, then a clear error; nothing is lost.
    flaky = stub + "/flaky"
    Stub.requests.clear()
    status, printed = regen(["--server", flaky, "--server", served, *model, "--retries", "1", "--concurrency", "1"],
                            src, tiny_target, out, capsys)
    assert status == 1 and f"server {flaky}: HTTP 503" in printed and "(after 2 attempts)" in printed, printed
    assert "the same command resumes" in printed
    assert [p for p, _ in Stub.requests].count("/flaky/v1/completions") >= 3  # the check, then 2 attempts
    partial = out.read_text()
    assert partial.startswith(written) and expected.startswith(partial)

    status, printed = regen(["--server", served, *model], src, tiny_target, out, capsys)
    assert status == 0 and json.loads(printed.splitlines()[-1])["num_resumed"] == len(partial.splitlines())
    assert out.read_text() == expected


def test_a_server_that_times_out_is_named(tmp_path, tiny_target, stub, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    slow = stub + "/slow"
    status, printed = regen(["--server", slow, "--timeout", "0.5", "--retries", "0", "--server-model", "stub"],
                            src, tiny_target, tmp_path / "out.jsonl", capsys)
    assert status == 1 and f"server {slow} does not answer" in printed and "timed out after 0.5 s" in printed
    assert not (tmp_path / "out.jsonl").exists()


def test_requests_spread_seeded_per_turn(tmp_path, tiny_target, stub):
    """Two servers of the asked model, sampling: every turn carries turn_seed(seed, record
    position, turn) whichever server answers it, so a run resumed mid-chunk writes the file of
    one run; finish_reason "length" counts as unfinished; the prompt is the rendered template."""
    from transformers import AutoTokenizer

    from dflash_train.data.preparation import render

    src = write_jsonl(tmp_path / "in.jsonl", SHAREGPT[:5])
    servers = serving.ServingOptions((stub + "/a", stub + "/b/v1"), concurrency=4, retries=0)
    options = regenerate.RegenerationOptions(max_new_tokens=6, batch_size=2, temperature=1.0, top_p=0.9, seed=7)
    Stub.requests.clear()
    whole = regenerate.regenerate([src], tiny_target, tmp_path / "whole.jsonl", options, servers, log=lambda *_: None)
    sent = [(path, body) for path, body in Stub.requests if path.endswith("/completions")]
    assert {path for path, _ in sent} == {"/a/v1/completions", "/b/v1/completions"}
    sent = [body for _, body in sent if body["prompt"] != serving.PROBE_PROMPT]
    assert len(sent) == 10 and {body["model"] for body in sent} == {"stub"}
    assert {body["temperature"] for body in sent} == {1.0} and {body["top_p"] for body in sent} == {0.9}
    lines = [json.loads(line) for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    seeds = [[serving.turn_seed(7, position, turn) for turn in range(2)] for position in range(5)]
    assert [[t["value"] for t in line["conversations"][1::2]] for line in lines] == \
        [[f"<{s}>" for s in pair] for pair in seeds]
    assert whole["num_unfinished"] == sum(s % 2 for pair in seeds for s in pair)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    first = [{"role": "user", "content": SHAREGPT[0]["conversations"][0]["value"]}]
    assert render(tokenizer, first, generation_prompt=True) in [body["prompt"] for body in sent]

    resumed = tmp_path / "resumed.jsonl"
    regenerate.regenerate([src], tiny_target, resumed, dataclasses.replace(options, limit=1), servers,
                          log=lambda *_: None)  # stops inside the first chunk
    regenerate.regenerate([src], tiny_target, resumed, options, servers, log=lambda *_: None)
    assert resumed.read_text() == (tmp_path / "whole.jsonl").read_text()


def test_prompt_text_leaves_the_bos_to_the_server(smollm2_path):
    from conftest import load_tokenizer
    from dflash_train.data.preparation import render

    messages = [{"role": "user", "content": "hi"}]
    plain = load_tokenizer(smollm2_path)
    text = render(plain, messages, generation_prompt=True)
    assert serving.prompt_text(plain, text) == text  # adds no special tokens: sent as rendered
    llama3 = load_tokenizer(smollm2_path, "llama3")
    llama3.bos_token, llama3.add_bos_token = "<|begin_of_text|>", True
    text = render(llama3, messages, generation_prompt=True)
    sent = serving.prompt_text(llama3, text)
    assert sent == text.removeprefix("<|begin_of_text|>")
    assert llama3(sent)["input_ids"] == llama3(text, add_special_tokens=False)["input_ids"]
    plain.add_eos_token = True  # a token the server would add at the end: no text gives our ids
    with pytest.raises(serving.ServerError, match="adds special tokens"):
        serving.prompt_text(plain, render(plain, messages, generation_prompt=True))
