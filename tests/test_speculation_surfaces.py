"""Speculation really happens on every user surface: `generate` (CLI), `Eagle3Llama` / `attach_eagle3` (the
drop-in) and `serve`, each with SmolLM2 and the shipped head on a predictable text (counting), greedy, under the
fixed policy (K=4, p_min 0, so that the head drafts every cycle). Each test asserts drafts were accepted (tokens
per target forward > 1) and that the output is the target's alone, token for token.

The server reports its statistics over HTTP (`usage.speculation` on non-streamed answers, GET /v1/eagle3/stats);
its test runs `serve`'s app (server.build_app, what the command hands to uvicorn) in this process, so it also
checks them against the Eagle3Llama it serves."""

from __future__ import annotations

import dataclasses

import http.client
import json
import threading
import time
from contextlib import closing

import llama_cpp
import pytest
from typer.testing import CliRunner

from eagle3_gguf.assets import default_head_path
from eagle3_gguf.cli.main import app
from eagle3_gguf.config import COMMAND_LINE
from eagle3_gguf.llama import Eagle3Llama, attach_eagle3
from eagle3_gguf.native import CACHE_TYPES
from eagle3_gguf.server import speculation_summary
from serving import free_port

COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # the target continues " 11, 12, ...", which the head predicts
CHAT = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
N = 40
# one thread: exact at any thread count (bf16 V cache), and a busy 2-core machine slows it least
KW = dict(n_ctx=512, n_batch=128, n_threads=1, n_threads_batch=1, seed=0, verbose=False,
          flash_attn=True, type_v=CACHE_TYPES["bf16"])
SPEC = dict(draft_policy="fixed", draft_max=4, draft_p_min=0.0)
GREEDY = dict(temperature=0.0, repeat_penalty=1.0)


def speculated(st, n_generated: int | None = None) -> None:
    """Drafts were accepted, and the counts tell one story: every emitted token is a target forward's own
    token or an accepted draft."""
    assert st.n_drafted > 0 and st.n_accepted > 0, st
    assert st.tau > 1.0
    assert st.n_generated == st.n_target_forwards + st.n_accepted
    assert st.n_accepted == sum(st.accepted_by_pos) == sum(n * c for n, c in enumerate(st.accept_hist))
    if n_generated is not None:
        assert st.n_generated == n_generated


def text_of(r) -> str:
    return r["choices"][0]["text"]


def same(a, b) -> None:
    """Two responses agree on everything but their ids and timestamps."""
    for r in (a, b):
        for key in ("id", "created", "model"):
            r.pop(key, None)
    assert a == b


def chunks(stream) -> list[tuple]:
    out = []
    for c in stream:
        ch = c["choices"][0]
        out.append((ch.get("text", ch.get("delta")), ch["finish_reason"]))
    return out


@pytest.fixture(scope="module")
def head():
    return default_head_path()


@pytest.fixture(scope="module")
def plain(smollm2_path):
    llm = llama_cpp.Llama(model_path=str(smollm2_path), **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ours(smollm2_path, head):
    llm = Eagle3Llama(model_path=str(smollm2_path), draft_model_path=head, **SPEC, **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def count_text(plain) -> str:
    text = text_of(plain(COUNT, max_tokens=N, **GREEDY))
    assert text.startswith(" 11, 12, 13,"), text  # the predictable text the tests below rely on
    return text


# -- CLI generate --------------------------------------------------------------------------------------------
def test_cli_generate_accepts_drafts(count_text):
    """The embedded pair (no -m/--draft): --json reports accepted drafts, --baseline the identity check, and
    the text is plain llama-cpp-python's."""
    r = CliRunner().invoke(app, ["generate", "-p", COUNT, "-n", str(N), "-c", "512", "-t", "1", "--draft-policy",
                                 "fixed", "--draft-max", "4", "--draft-p-min", "0", "--baseline", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    st = d["stats"]
    assert st["n_drafted"] > 0 and st["n_accepted"] > 0 and st["tau"] > 1.0, st
    assert st["n_generated"] == N == st["n_target_forwards"] + st["n_accepted"]
    assert st["n_accepted"] == sum(st["accepted_by_pos"])
    # the loop's Python by stage: every graph of a cycle timed inside its stage, so the stages add up to the whole
    stages = st["python_by_stage"]
    assert list(stages) == ["drafting", "verifying", "processing", "the rest"] and min(stages.values()) >= 0, stages
    assert stages["drafting"] > 0 and stages["verifying"] > 0
    assert abs(sum(stages.values()) - st["python_per_cycle_ms"]) < 1e-6, stages
    base = d["baseline"]
    assert base["n_accepted"] == 0 and base["n_target_forwards"] == base["n_generated"] == N
    assert d["identical"] is True
    assert d["text"] == count_text


# -- the drop-in: Eagle3Llama --------------------------------------------------------------------------------
def test_completion(plain, ours, count_text):
    same(plain(COUNT, max_tokens=N, **GREEDY), ours(COUNT, max_tokens=N, **GREEDY))
    assert ours.spec_fallback is None
    speculated(ours.spec_stats, N)


def test_streaming_completion(plain, ours):
    a = chunks(plain.create_completion(COUNT, max_tokens=N, stream=True, **GREEDY))
    b = chunks(ours.create_completion(COUNT, max_tokens=N, stream=True, **GREEDY))
    assert a == b and a[-1][1] == "length"
    speculated(ours.spec_stats, N)


def test_chat_and_streaming_chat(plain, ours):
    same(plain.create_chat_completion(CHAT, max_tokens=N, **GREEDY),
         ours.create_chat_completion(CHAT, max_tokens=N, **GREEDY))
    speculated(ours.spec_stats, N)
    a = chunks(plain.create_chat_completion(CHAT, max_tokens=N, stream=True, **GREEDY))
    b = chunks(ours.create_chat_completion(CHAT, max_tokens=N, stream=True, **GREEDY))
    assert a == b
    speculated(ours.spec_stats, N)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string(plain, ours, count_text, stream):
    stop = " 17,"
    assert stop in count_text
    if stream:
        a = chunks(plain.create_completion(COUNT, max_tokens=N, stop=[stop], stream=True, **GREEDY))
        b = chunks(ours.create_completion(COUNT, max_tokens=N, stop=[stop], stream=True, **GREEDY))
        assert a == b and a[-1][1] == "stop"
    else:
        a = plain(COUNT, max_tokens=N, stop=[stop], **GREEDY)
        b = ours(COUNT, max_tokens=N, stop=[stop], **GREEDY)
        assert text_of(a) == count_text[:count_text.index(stop)] and a["choices"][0]["finish_reason"] == "stop"
        same(a, b)
    st = ours.spec_stats
    speculated(st)
    assert st.n_generated < N


def test_grammar(plain, ours, count_text):
    """A grammar that changes the text (no digit 5): each verify row is sampled through it."""
    grammar = 'root ::= (" " [0-46-9]+ ",")+'

    def run(llm):
        return llm(COUNT, max_tokens=N, grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False),
                   **GREEDY)

    a, b = run(plain), run(ours)
    same(a, b)
    assert text_of(a).startswith(" 11, 12, 13, 14,") and "5" not in text_of(a) and text_of(a) != count_text
    speculated(ours.spec_stats, N)


def test_logits_processor(plain, ours):
    """A logits processor sees the same contexts, in the same order, with speculation as without."""
    def recorder(log):
        def proc(input_ids, scores):
            log.append(input_ids.tolist())
            return scores
        return llama_cpp.LogitsProcessorList([proc])

    seen_plain, seen_ours = [], []
    same(plain(COUNT, max_tokens=N, logits_processor=recorder(seen_plain), **GREEDY),
         ours(COUNT, max_tokens=N, logits_processor=recorder(seen_ours), **GREEDY))
    assert seen_ours == seen_plain and len(seen_plain) == N
    speculated(ours.spec_stats, N)


def test_attach_eagle3(smollm2_path, head, plain):
    with closing(llama_cpp.Llama(model_path=str(smollm2_path), **KW)) as plain_llm:
        llm = attach_eagle3(plain_llm, head, **SPEC)
        same(plain(COUNT, max_tokens=N, **GREEDY), llm(COUNT, max_tokens=N, **GREEDY))
        speculated(llm.spec_stats, N)


# -- serve ---------------------------------------------------------------------------------------------------
def post(port: int, path: str, body: dict) -> dict:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as c:
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
    assert r.status == 200, data
    return json.loads(data)


def get(port: int, path: str) -> dict:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as c:
        c.request("GET", path)
        r = c.getresponse()
        data = r.read()
    assert r.status == 200, data
    return json.loads(data)


def post_stream(port: int, path: str, body: dict) -> list[dict]:
    """The data events of a streamed answer, up to [DONE]."""
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as c:
        c.request("POST", path, body=json.dumps({**body, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        events = []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return events
            events.append(json.loads(data))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


@pytest.fixture(scope="module")
def served(smollm2_path, head):
    """`serve`'s app on SmolLM2 + the shipped head, run by uvicorn in a thread of this process; yields the
    port and the Eagle3Llama it serves (whose spec_stats describe the last request)."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from llama_cpp.server import app as server_app

    from eagle3_gguf.server import ServeConfig, build_app

    patched = {name: getattr(server_app, name) for name in ("get_llama_proxy", "get_event_publisher")}
    port = free_port()
    config = ServeConfig(model=smollm2_path, draft=head, port=port, n_ctx=512, n_threads=1, alias="smol",
                         drafting=dataclasses.replace(COMMAND_LINE, **SPEC))
    server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        llm = server_app._llama_proxy("smol")
        assert isinstance(llm, Eagle3Llama)
        yield port, llm
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        proxy, server_app._llama_proxy = server_app._llama_proxy, None
        if proxy is not None and proxy._current_model is not None:
            proxy._current_model.close()
        for name, value in patched.items():  # build_app replaced them in llama-cpp-python's module
            setattr(server_app, name, value)


def reported(port: int, llm, got: dict | None = None) -> dict:
    """The last request's statistics as serve reports them (`usage.speculation` of `got`, else GET
    /v1/eagle3/stats): the served Eagle3Llama's own."""
    spec = got["usage"]["speculation"] if got is not None else get(port, "/v1/eagle3/stats")["last"]
    assert spec == speculation_summary(llm)
    return spec


def test_serve_completion(served, count_text):
    port, llm = served
    got = post(port, "/v1/completions", dict(model="smol", prompt=COUNT, max_tokens=N, **GREEDY))
    assert got["choices"][0]["text"] == count_text and got["usage"]["completion_tokens"] == N
    speculated(llm.spec_stats, N)
    spec = reported(port, llm, got)
    assert spec["accepted"] > 0 and spec["tokens_per_forward"] > 1.0 and spec["spec_sampling"] == "greedy"


def test_serve_chat_and_stream(served, plain):
    port, llm = served
    want = plain.create_chat_completion(CHAT, max_tokens=N, **GREEDY)["choices"][0]["message"]["content"]
    got = post(port, "/v1/chat/completions", dict(model="smol", messages=CHAT, max_tokens=N, **GREEDY))
    assert got["choices"][0]["message"]["content"] == want
    speculated(llm.spec_stats, N)
    reported(port, llm, got)
    events = post_stream(port, "/v1/chat/completions", dict(model="smol", messages=CHAT, max_tokens=N, **GREEDY))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("speculation" not in (e.get("usage") or {}) for e in events)  # streams: GET /v1/eagle3/stats
    speculated(llm.spec_stats, N)
    reported(port, llm)


def test_serve_rejection_sampling(served):
    """At temperature > 0 serve verifies by rejection sampling (ServeConfig's default, as the command's) and
    says so in the statistics."""
    port, llm = served
    got = post(port, "/v1/completions", dict(model="smol", prompt=COUNT, max_tokens=N, temperature=0.8, seed=3,
                                             repeat_penalty=1.0))
    spec = reported(port, llm, got)
    assert (spec["spec_sampling"], spec["verification"]) == ("rejection", "rejection (draft q at 1x the temperature)")
    assert spec["drafted"] > 0 and spec["generated"] == N == spec["target_forwards"] + spec["accepted"]
