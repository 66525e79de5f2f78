"""`eagle3-gguf serve` under load: concurrent clients queue (none is interrupted), a client that drops
mid-stream frees the model without disturbing the others, and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from test_serve import ALIAS, EXTRA, N_CTX, PLAIN, free_port, openai_client, plain, server_process  # noqa: F401

openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are",
           "In 1969, the first", "A list of fruits:", "Water boils at", "The quick brown fox"]
LENGTHS = [8, 40, 120, 24, 200, 16, 72, 300]
LONG_CTX = 2048  # the server's context here: room for a long stream to drop (the alone-answers fit in N_CTX)


@contextmanager
def serving_logged(tiny_target, tiny_head, log: Path, *flags):
    """`eagle3-gguf serve` on the tiny pair, its stderr in `log`: (the process, its port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft", str(tiny_head),
           "--port", str(port), "-c", str(N_CTX), "--alias", ALIAS, "-t", "2", *flags]
    with server_process(cmd, port, log) as proc:
        yield proc, port


def request_for(i: int) -> dict:
    """Client i's request: chat on odd i, completion on even; streaming on i % 4 in (0, 1); mixed lengths."""
    prompt, n = PROMPTS[i % len(PROMPTS)], LENGTHS[(i * 3) % len(LENGTHS)]
    kind = "chat" if i % 2 else "completion"
    return dict(kind=kind, stream=i % 4 < 2, prompt=prompt, max_tokens=n)


def alone_answer(llm, req: dict) -> str:
    if req["kind"] == "chat":
        out = llm.create_chat_completion([{"role": "user", "content": req["prompt"]}], max_tokens=req["max_tokens"],
                                         **PLAIN)
        return out["choices"][0]["message"]["content"]
    return llm.create_completion(req["prompt"], max_tokens=req["max_tokens"], **PLAIN)["choices"][0]["text"]


def ask(client, req: dict) -> str:
    common = dict(model=ALIAS, max_tokens=req["max_tokens"], temperature=0, extra_body=EXTRA, stream=req["stream"])
    if req["kind"] == "chat":
        got = client.chat.completions.create(messages=[{"role": "user", "content": req["prompt"]}], **common)
        if req["stream"]:
            return "".join(c.choices[0].delta.content or "" for c in got if c.choices)
        return got.choices[0].message.content
    got = client.completions.create(prompt=req["prompt"], **common)
    if req["stream"]:
        return "".join(c.choices[0].text for c in got)
    return got.choices[0].text


def start_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A raw streaming completion; returns the open connection and response (read it with readline)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "repeat_penalty": 1.0})
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    return c, r


def read_events(r: http.client.HTTPResponse, n: int) -> list[str]:
    """The next n `data:` lines of an SSE response."""
    events = []
    while len(events) < n:
        line = r.readline().decode().strip()
        if line.startswith("data: "):
            events.append(line[len("data: "):])
        elif not line and r.isclosed():
            break
    return events


def run_clients(port: int, reqs: list[dict]) -> list[str | BaseException]:
    results: list[str | BaseException] = [RuntimeError("no answer")] * len(reqs)
    go = threading.Barrier(len(reqs))

    def one(i: int) -> None:
        client = openai_client(port)
        go.wait()
        try:
            results[i] = ask(client, reqs[i])
        except BaseException as e:  # reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def answers_while_a_stream_drops(port: int, log: Path, reqs: list[dict], stream_tokens: int,
                                 queued: int) -> list[str]:
    """A streaming client holds the model (or a slot) while `reqs` arrive at once from their own clients; it
    drops its stream once `queued` of them are logged as queued. Each request's answer, or repr of its error."""
    conn, dropped = start_stream(port, max_tokens=stream_tokens)
    assert len(read_events(dropped, 2)) == 2

    def drop_once_queued() -> None:  # gone mid-stream, with requests queued behind it
        deadline = time.monotonic() + 30
        while log.read_text().count("queued:") < queued and time.monotonic() < deadline:
            time.sleep(0.01)
        conn.close()

    dropper = threading.Thread(target=drop_once_queued)
    dropper.start()
    got = run_clients(port, reqs)
    dropper.join()
    return [g if isinstance(g, str) else repr(g) for g in got]


@pytest.mark.slow
def test_sixteen_concurrent_clients_and_a_dropped_stream(tiny_target, tiny_head, plain, tmp_path):
    """16 clients at once (half streaming, chat and completion, 8..300 tokens) each get exactly the greedy answer
    they get alone, while a 17th client drops its stream part way; then the server still answers."""
    reqs = [request_for(i) for i in range(16)]
    want = [alone_answer(plain, r) for r in reqs]
    log = tmp_path / "serve.log"
    with serving_logged(tiny_target, tiny_head, log, "-c", str(LONG_CTX)) as (proc, port):
        assert answers_while_a_stream_drops(port, log, reqs, stream_tokens=LONG_CTX, queued=8) == want
        after = request_for(3)
        assert ask(openai_client(port), after) == alone_answer(plain, after)
        assert proc.poll() is None
    text = log.read_text()
    assert "queued:" in text and "started after" in text, text
    stopped = [line for line in text.splitlines() if "the client disconnected" in line]
    assert len(stopped) == 1, text
    n_chunks = int(stopped[0].split("after ")[1].split()[0])
    assert n_chunks < LONG_CTX - 10, stopped  # it really stopped mid-stream
    assert "Traceback" not in text, text


@pytest.mark.slow
def test_interrupt_requests_flag_keeps_llama_cpp_pythons_behaviour(tiny_target, tiny_head, tmp_path):
    """--interrupt-requests: a request that arrives while a stream runs ends that stream early, as
    llama-cpp-python's server does by default (the answer is cut short, with [DONE])."""
    with serving_logged(tiny_target, tiny_head, tmp_path / "serve.log", "--interrupt-requests") as (proc, port):
        conn, stream = start_stream(port, max_tokens=N_CTX)
        with closing(conn):
            assert len(read_events(stream, 2)) == 2
            other = threading.Thread(target=ask, args=(openai_client(port), request_for(0)))
            other.start()
            events = read_events(stream, N_CTX + 5)
            other.join(timeout=120)
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert len(texts) + 2 < N_CTX - 10  # cut short


@pytest.mark.slow
def test_parallel_slots_answer_as_alone(tiny_target, tiny_head, plain, tmp_path):
    """--parallel 4 (a slot of N_CTX each): 10 clients at once (half streaming, chat and completion, 8..300
    tokens) each get exactly their alone-answer, four at a time in shared target batches while the others
    queue, and a client that drops its stream frees its slot; then the server still answers."""
    reqs = [request_for(i) for i in range(10)]
    want = [alone_answer(plain, r) for r in reqs]
    log = tmp_path / "serve.log"
    with serving_logged(tiny_target, tiny_head, log, "-c", str(4 * N_CTX), "--parallel", "4") as (proc, port):
        assert answers_while_a_stream_drops(port, log, reqs, stream_tokens=N_CTX - 8, queued=4) == want
        after = request_for(5)
        assert ask(openai_client(port), after) == alone_answer(plain, after)
        with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=10)) as c:
            c.request("GET", "/v1/eagle3/stats")
            slots = json.loads(c.getresponse().read())["slots"]
        assert slots["n"] == 4 and slots["most_sequences"] >= 2 and slots["sequences_per_decode"] > 1, slots
        assert proc.poll() is None
    text = log.read_text()
    assert "queued:" in text and "started after" in text, text
    assert sum("the client disconnected" in line for line in text.splitlines()) == 1, text
    assert "Traceback" not in text, text
