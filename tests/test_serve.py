"""`eagle3-gguf serve`: llama-cpp-python's OpenAI-compatible server with the head, end to end over HTTP; its
speculation statistics (`usage.speculation`, GET /v1/eagle3/stats) with SmolLM2 and the shipped head on a
predictable text, where drafts are accepted."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import tempfile
from contextlib import closing, contextmanager
from pathlib import Path

import llama_cpp
import pytest

from eagle3_gguf.assets import default_head_path
from eagle3_gguf.native import CACHE_TYPES
from serving import free_port, server_process, wait_ready  # noqa: F401  (test_serve_load, test_faults import them from here)
from test_speculation_surfaces import COUNT, N

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

N_CTX = 512
ALIAS = "tiny"
PLAIN = dict(temperature=0.0, repeat_penalty=1.0)  # what the requests below ask for
EXTRA = {"repeat_penalty": 1.0}  # the server's own default is 1.1
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
ORIGIN = "http://ui.example"  # a web page's, calling the server from another origin


def get_json(port: int, path: str) -> dict:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=60)) as c:
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 200
        return json.loads(r.read())


def raw_post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=60)) as c:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()


@contextmanager
def serving(tiny_target, tiny_head, *flags, headers: dict | None = None, banner: list | None = None):
    """`eagle3-gguf serve` on the tiny pair in a subprocess; yields its port (`headers`: what a request needs,
    an API key). `banner`: gets the server's stderr lines once it has stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft", str(tiny_head),
           "--port", str(port), "-c", str(N_CTX), "--alias", ALIAS, "-t", "2", *flags]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        try:
            with server_process(cmd, port, log, headers=headers):
                yield port
        finally:
            if banner is not None:
                banner.extend(log.read_text().splitlines())


def openai_client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_target, tiny_head):
    with serving(tiny_target, tiny_head) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def plain_llama(model):
    """A plain Llama with the server's exactness settings (server.py: flash attention, bf16 V cache)."""
    return closing(llama_cpp.Llama(model_path=str(model), n_ctx=N_CTX, flash_attn=True, type_v=CACHE_TYPES["bf16"],
                                   verbose=False))


@pytest.fixture(scope="module")
def plain(tiny_target):
    with plain_llama(tiny_target) as llm:
        yield llm


def test_llama_cpp_server_adapter(monkeypatch):
    """server.create_app_with relies on llama-cpp-python's server looking three names up in its module (it offers
    no hook): create_app builds its proxy from `LlamaProxy`, and the completion routes (streamed ones through
    `get_event_publisher`) take the model from `get_llama_proxy` at request time. This fails when that changes."""
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from eagle3_gguf import server

    assert "LlamaProxy" in server_app.set_llama_proxy.__code__.co_names
    assert "set_llama_proxy" in server_app.create_app.__code__.co_names
    for route in (server_app.create_completion, server_app.create_chat_completion):
        assert {"get_llama_proxy", "get_event_publisher"} <= set(route.__code__.co_names), route.__name__
    assert "get_llama_proxy" in server_app.get_event_publisher.__code__.co_names
    for name in ("get_llama_proxy", "get_event_publisher", "_llama_proxy", "_server_settings"):
        monkeypatch.setattr(server_app, name, getattr(server_app, name))  # restored after the test

    class Proxy:
        def __init__(self, models):
            self.models = models

    plain_proxy = server_app.LlamaProxy
    settings = ModelSettings(model="target.gguf")
    server.create_app_with(server_app, Proxy, ServerSettings(), settings)
    assert isinstance(server_app._llama_proxy, Proxy) and server_app._llama_proxy.models == [settings]
    assert server_app.LlamaProxy is plain_proxy
    assert server_app.get_llama_proxy is server.queued_llama_proxy
    assert server_app.get_event_publisher is server.event_publisher


def status_of(port: int, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, bytes]:
    return answer_of(port, method, path, headers, body)[:2]


def answer_of(port: int, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, bytes, dict]:
    """(status, body, headers with lower-case names) of one request."""
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=60)) as c:
        c.request(method, path, body=None if body is None else json.dumps(body),
                  headers={"Content-Type": "application/json", **headers})
        r = c.getresponse()
        return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}


def test_api_key(tiny_target, tiny_head, plain, tmp_path):
    """--api-key-file: every path llama-cpp-python's server guards answers 401 without the key, with a wrong one
    or another scheme, streamed or not; the right key gets the target's text; unguarded paths stay open."""
    key = tmp_path / "key"
    key.write_text("s3cret-key\nignored\n")
    right = {"Authorization": "Bearer s3cret-key"}
    banner: list[str] = []
    with serving(tiny_target, tiny_head, "--api-key-file", str(key), "--host", "0.0.0.0", headers=right,
                 banner=banner) as port:
        completion = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **EXTRA}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"},
                        {"Authorization": "Bearer s3cret-ke"}):
            for stream in (False, True):
                status, body = status_of(port, "POST", "/v1/completions", headers, {**completion, "stream": stream})
                assert (status, json.loads(body)) == (401, {"detail": "Invalid API key"}), (headers, stream)
            for path in ("/v1/models", "/v1/eagle3/stats"):
                assert status_of(port, "GET", path, headers)[0] == 401, (headers, path)
        # a browser page on another origin reads the 401, as llama-cpp-python's CORS middleware lets it
        status, _, got = answer_of(port, "GET", "/v1/models", {"Origin": ORIGIN})
        assert status == 401 and got.get("access-control-allow-origin") == ORIGIN and "x-request-id" in got, got
        assert status_of(port, "GET", "/openapi.json", {})[0] == 200  # llama-cpp-python guards no docs
        want = plain.create_completion(PROMPT, max_tokens=12, **PLAIN)["choices"][0]["text"]
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret-key", timeout=120, max_retries=0)
        assert keyed.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body=EXTRA).choices[0].text == want
        streamed = keyed.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            extra_body=EXTRA)
        assert "".join(chunk.choices[0].text for chunk in streamed) == want
        assert status_of(port, "GET", "/v1/eagle3/stats", right)[0] == 200
    serving_line = next(line for line in banner if line.startswith("serving "))  # after any first-run measuring
    assert "requests need the API key" in serving_line and not any("warning" in line for line in banner)


def test_the_key_guards_what_llama_cpp_python_guards():
    """Our key check leaves open what llama-cpp-python's server leaves open (its docs, routes its OpenAPI schema
    lists without a security mark), guards the rest (a route hidden from the schema too), rejects before the
    route is reached, and lets a browser's CORS preflight through."""
    import asyncio

    from fastapi import Depends, FastAPI
    from llama_cpp.server import app as server_app

    from eagle3_gguf.server import ApiKeyCheck, open_paths

    app = FastAPI()
    app.include_router(server_app.router)
    app.get("/v1/eagle3/stats", dependencies=[Depends(server_app.authenticate)])(lambda: {})
    unguarded = open_paths(app)
    assert {"/docs", "/openapi.json", "/redoc"} <= unguarded
    assert not {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/eagle3/stats"} & unguarded
    reached, sent = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    check = ApiKeyCheck(inner, "k3y", unguarded)
    preflight = [(b"origin", b"http://ui.example"), (b"access-control-request-method", b"POST")]
    for method, path, headers, passes in (
            ("GET", "/v1/models", [(b"authorization", b"Bearer k3y")], True),
            ("GET", "/v1/models", [(b"authorization", b"bearer k3y")], True),
            ("GET", "/v1/models", [(b"authorization", b"Bearer k3")], False),
            ("GET", "/v1/models", [], False),
            ("POST", "/v1/engines/copilot-codex/completions", [], False),  # hidden from the schema, guarded there
            ("OPTIONS", "/v1/chat/completions", preflight, True),
            ("OPTIONS", "/v1/chat/completions", [], False),
            ("GET", "/docs", [], True)):
        reached.clear(), sent.clear()
        asyncio.run(check({"type": "http", "method": method, "path": path, "headers": headers}, None, send))
        assert reached == ([path] if passes else []), (method, path, headers)
        assert passes or (sent[0]["status"], sent[1]["body"]) == (401, b'{"detail":"Invalid API key"}')


def test_an_open_host_without_a_key_is_warned_about(tiny_target, tiny_head):
    banner: list[str] = []
    with serving(tiny_target, tiny_head, "--host", "0.0.0.0", banner=banner):
        pass
    warned = [line for line in banner if not line.startswith("measuring ")]  # a first run measures before it
    assert warned[0] == "warning: serving on 0.0.0.0 without --api-key: anyone who reaches this port can use the model"


def test_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == [ALIAS]


def test_chat(client, plain):
    got = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=24, temperature=0, extra_body=EXTRA)
    want = plain.create_chat_completion(CHAT, max_tokens=24, **PLAIN)
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert got.usage.model_dump() == {**want["usage"], **{k: v for k, v in got.usage.model_dump().items()
                                                           if k not in want["usage"]}}


def test_streaming_chat(client, plain):
    stream = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            extra_body=EXTRA)
    parts, reasons = [], []
    for chunk in stream:
        parts.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    want = plain.create_chat_completion(CHAT, max_tokens=24, **PLAIN)
    assert "".join(parts) == want["choices"][0]["message"]["content"]
    assert reasons[-1] == want["choices"][0]["finish_reason"] == "length"


def test_completion_and_stop(client, plain):
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=30, temperature=0, extra_body=EXTRA)
    want = plain.create_completion(PROMPT, max_tokens=30, **PLAIN)
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"] == 30
    stop = want["choices"][0]["text"][10:13]
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                    extra_body=EXTRA)
    want = plain.create_completion(PROMPT, max_tokens=30, stop=[stop], **PLAIN)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want["choices"][0]["text"], "stop")


def test_the_kv_cache_types_are_llama_cpps_flags(tiny_target, tiny_head):
    """-ctk / -ctv as generate's and llama-server's: the served target's cache holds them, and its greedy text is a
    plain Llama's with the same cache."""
    banner: list[str] = []
    with serving(tiny_target, tiny_head, "-ctk", "bf16", "-ctv", "f16", "-v", banner=banner) as port:
        got = openai_client(port).completions.create(model=ALIAS, prompt=PROMPT, max_tokens=20, temperature=0,
                                                     extra_body=EXTRA)
    with closing(llama_cpp.Llama(model_path=str(tiny_target), n_ctx=N_CTX, flash_attn=True, type_k=CACHE_TYPES["bf16"],
                                 type_v=CACHE_TYPES["f16"], verbose=False)) as plain_same:
        want = plain_same.create_completion(PROMPT, max_tokens=20, **PLAIN)
    assert got.choices[0].text == want["choices"][0]["text"]
    kv = [line for line in banner if "llama_kv_cache: size" in line]
    # the target's cache as asked (its default: K f16, V bf16); the head's keeps its own
    assert any("K (bf16)" in line and "V (f16)" in line for line in kv) and not any("V (bf16)" in x for x in kv), kv


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    """The helpers above: a server that ends before it answers raises at once, with what it wrote to its log."""
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('error: no such model\\n'); sys.exit(2)"]
    with pytest.raises(RuntimeError, match="^the server exited with 2: error: no such model$"):
        with server_process(cmd, free_port(), tmp_path / "serve.log"):
            pass


def test_a_cache_type_llama_cpp_refuses_is_one_line(tiny_target, tiny_head):
    """q8_0's blocks of 32 do not divide the tiny target's head size of 16: llama.cpp makes no context."""
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft",
                        str(tiny_head), "-ctk", "q8_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {tiny_target}: Failed to create llama_context (n_ctx=4096, KV "
                                             "cache q8_0/auto; -v shows llama.cpp's reason)"]


def test_unknown_model_gets_the_models_answer(client, plain):
    """llama-cpp-python's server rule, kept for drop-in use: a client that hard-codes a model name it does not
    serve gets the served model's answer."""
    got = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=24, temperature=0,
                                         extra_body=EXTRA)
    want = plain.create_chat_completion(CHAT, max_tokens=24, **PLAIN)
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    got = client.completions.create(model="text-davinci-003", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body=EXTRA)
    assert got.choices[0].text == plain.create_completion(PROMPT, max_tokens=12, **PLAIN)["choices"][0]["text"]


def test_strict_model_answers_unknown_names_404(tiny_target, tiny_head, plain):
    """--strict-model opts in to 404 for other names; the served name still answers, under --draft-policy fixed."""
    with serving(tiny_target, tiny_head, "--strict-model", "--draft-policy", "fixed") as port:
        strict = openai_client(port)
        with pytest.raises(openai.NotFoundError) as e:
            strict.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
        assert "The model `gpt-4o` does not exist" in str(e.value.body)
        got = strict.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=EXTRA)
        assert got.choices[0].text == plain.create_completion(PROMPT, max_tokens=12, **PLAIN)["choices"][0]["text"]


def test_prompt_beyond_context_is_400(client):
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=ALIAS, prompt="word " * (N_CTX + 50), max_tokens=4)


def test_max_tokens_beyond_context_is_clamped(client, plain):
    """llama-cpp-python's own rule: max_tokens past the context stops at the context's end ("length")."""
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=10 * N_CTX, temperature=0,
                                    extra_body=EXTRA)
    assert got.usage.total_tokens == N_CTX and got.choices[0].finish_reason == "length"
    assert got.choices[0].text == plain.create_completion(PROMPT, max_tokens=10 * N_CTX, **PLAIN)["choices"][0]["text"]


@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": 12.5, "max_tokens": "many"}', b'{"messages": "hi"}'])
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, client, body):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, _ = raw_post(server, path, body)
    assert 400 <= status < 500, status
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=EXTRA)
    assert got.usage.completion_tokens == 3


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4, "grammar": "root ::= ("}'),  # a NULL sampler: SIGSEGV
    ("/extras/detokenize", b'{"tokens": [1000000000]}'),  # std::out_of_range: SIGABRT
])
def test_requests_llama_cpp_dies_on_fail_alone(server, client, path, body):
    """llama-cpp-python's own server dies on these; here each request fails and the server keeps serving."""
    status, answer = raw_post(server, path, body)
    assert status >= 400, (status, answer)
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=EXTRA)
    assert got.usage.completion_tokens == 3


def test_a_grammar_that_does_not_parse_is_400_streamed_or_not(server, client):
    """Checked by the target's parser before the route runs: a stream of it was a 200 with no event at all."""
    want = "the grammar does not parse (llama.cpp's log says where; check its rules and its root)"
    for path, request in (("/v1/completions", {"prompt": "hi"}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            status, answer = status_of(server, "POST", path, {}, {**request, "max_tokens": 4, "stream": stream,
                                                                  "grammar": "root ::= ("})
            assert (status, json.loads(answer)["error"]["message"]) == (400, want), (path, stream)
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={**EXTRA, "grammar": 'root ::= [a-z ]+'})
    assert got.usage.completion_tokens > 0 and set(got.choices[0].text) <= set("abcdefghijklmnopqrstuvwxyz ")


def test_a_request_that_fits_no_type_of_a_field_says_which_would():
    """A field of several types (prompt: str or list[str]) fails once per type: the 400 names them all, not the first
    alone (a prompt of token ids was told 'prompt.str: Input should be a valid string'); where the request's own
    fields say which type it meant (a message's role), that type's failure is told."""
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    from eagle3_gguf.server import RequestCheck

    cases = [(CreateCompletionRequest, {"prompt": [1, 2, 3]}, "prompt: should be one of str, list[str]"),
             (CreateCompletionRequest, {"prompt": "hi", "stop": 3}, "stop: should be one of str, list[str]"),
             (CreateCompletionRequest, {"prompt": "hi", "max_tokens": "many"},
              "max_tokens: Input should be a valid integer, unable to parse string as an integer"),
             (CreateChatCompletionRequest, {"messages": "hi"}, "messages: Input should be a valid list")]
    # a message is one of five types told apart by role: the one its role names says what it lacks (pydantic's first
    # error was the system message's, 'messages.0.ChatCompletionRequestSystemMessage.role: Input should be 'system'')
    chat = [([{"role": "user"}], "messages.0.content: Field required"),
            ([{"role": "robot", "content": "hi"}],
             "messages.0.role: should be one of 'system', 'user', 'assistant', 'tool', 'function'"),
            ([{"content": "hi"}], "messages.0.role: Field required"),
            ([{"role": "system", "content": "be brief"}, {"role": "tool", "content": "4"}],
             "messages.1.tool_call_id: Field required"),
            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content.0.image_url: Field required")]
    cases += [(CreateChatCompletionRequest, {"messages": messages}, message) for messages, message in chat]
    cases.append((CreateChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                "tool_choice": {"type": "function"}}, "tool_choice.function: Field required"))
    for model, body, message in cases:
        assert RequestCheck.check(model, json.dumps(body).encode()) == f"invalid request: {message}", body


def test_what_llama_cpp_pythons_completions_fail_on_is_400():
    """Valid requests its completion code answers 500 (or with an empty stream) get a 400 that says why."""
    from eagle3_gguf.server import refusal

    empty = "the prompt is empty, and this model adds no BOS token to start from: give it some text"
    logprobs = "logprobs need serve --parallel 1 (parallel slots keep no logits for each row)"
    cases = [({"prompt": ""}, 1, empty), ({"prompt": []}, 1, empty), ({"max_tokens": 4}, 1, empty),
             ({"prompt": ["a", "b"]}, 1, "one prompt a request: give prompt as a string"),
             ({"prompt": "hi", "logit_bias": {"abc": 1}}, 1,
              "logit_bias keys are token ids: 'abc' is not one (or set logit_bias_type to tokens)"),
             ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 1,
              "logit_bias keys are token ids: '\u00b2' is not one (or set logit_bias_type to tokens)"),
             ({"prompt": "hi", "logprobs": 0}, 2, logprobs),
             ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}, 2, logprobs)]
    for request, parallel, message in cases:
        assert refusal(request, parallel, empty_prompt_fails=True) == message, request
    fine = [({"prompt": "hi", "logprobs": 3, "logit_bias": {"15": -100, "-1": 1}}, 1), ({"prompt": ["hi"]}, 2),
            ({"prompt": "hi", "logit_bias": {"hello": 5}, "logit_bias_type": "tokens"}, 1),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                           {"role": "assistant", "content": None}], "logprobs": True}, 2),
            ({"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 0}, 2)]
    assert [refusal(request, parallel, empty_prompt_fails=True) for request, parallel in fine] == [None] * len(fine)
    assert refusal({"prompt": ""}, 1) is None  # a model that adds a BOS token decodes from it


def test_an_empty_prompt_is_400_and_the_server_keeps_serving(server, client):
    status, answer = raw_post(server, "/v1/completions", b'{"prompt": "", "max_tokens": 4, "stream": true}')
    assert status == 400 and b"the prompt is empty, and this model adds no BOS token" in answer, (status, answer)
    # with the headers llama-cpp-python's middleware gives every answer: a web page on another origin reads it
    status, _, headers = answer_of(server, "POST", "/v1/completions", {"Origin": ORIGIN}, {"prompt": "", "max_tokens": 4})
    assert status == 400 and headers.get("access-control-allow-origin") == ORIGIN and "x-request-id" in headers
    got = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=EXTRA)
    assert got.usage.completion_tokens == 3


def test_missing_server_extra_is_one_line(tiny_target, tiny_head):
    code = ("import sys; sys.modules['uvicorn'] = None; sys.argv = ['eagle3-gguf', 'serve', '-m', sys.argv[1], "
            "'--draft', sys.argv[2]]; from eagle3_gguf.cli.main import main; main()")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_target), str(tiny_head)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: the server needs uvicorn: pip install 'eagle3-gguf[server]'"]


def test_bad_pair_is_one_line(tiny_head, smollm2_path):
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(smollm2_path), "--draft",
                        str(tiny_head), "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "hidden size" in lines[0]


def test_an_address_it_cannot_listen_on_is_one_line_before_loading(tiny_target, tiny_head):
    """A --host that is no address here, or a --port another process listens on: one line, before the models load
    (llama.cpp's lines would come first with -v; uvicorn's own error came after loading, exit 3)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, expected in ((["--host", "999.999.1.1"], "--host 999.999.1.1: not an address of this machine"),
                                (["--port", str(port)], f"cannot listen on 127.0.0.1:{port} (Address already in use): "
                                                        "choose another --port or --host")):
            r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target),
                                "--draft", str(tiny_head), "-v", *flags], capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and r.stderr.startswith(f"error: {expected}"), r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("flags, expected", [
    (["--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1) (got 1.5)"),
    (["--draft-max", "33"], "--draft-max must be between 0 and 32 (got 33)"),
    (["--port", "0"], "--port must be in 1..65535 (got 0)"),
    (["--draft-policy", "greedy"], "--draft-policy must be adaptive or fixed (got greedy)"),
    (["--spec-sampling", "bogus"], "--spec-sampling must be rejection or match (got bogus)"),
    (["--draft-temp-scale", "-1"], "--draft-temp-scale must be a number, 0 or more (got -1.0)"),
    (["--spec-sampling", "match", "--draft-temp-scale", "0.5"],
     "--draft-temp-scale shapes the rejection rule's draft distribution: it has no effect with --spec-sampling match"),
    (["--parallel", "0"], "--parallel must be in 1..64 (got 0)"),
    (["--api-key", "k", "--api-key-file", "TMP/key"], "give the API key with --api-key or --api-key-file, not both"),
    (["--api-key", " "], "--api-key is empty"),
    (["--api-key", "clé"], "the API key must be printable ASCII (what an HTTP Authorization header carries)"),
    (["--api-key-file", "TMP/missing"], "TMP/missing: cannot read the API key (No such file or directory)"),
    (["-ngl", "some"], "-ngl must be a number of layers, 'auto' or 'all' (got some)"),
    (["-ctv", "foo"], "unknown KV cache type 'foo' for -ctv (one of: auto, f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, "
                      "q5_0, q5_1)"),
    (["-ctk", "auto"], "unknown KV cache type 'auto' (one of: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)"),
    (["-ts", "head"], "serve places the target's layers as llama-cpp-python does (-ngl, --rpc): --tensor-split is "
                      "generate's and bench's"),
    (["--parallel", "4", "--interrupt-requests"],
     "--interrupt-requests ends one running stream for the next request: use it with --parallel 1"),
    (["--parallel", "2", "--draft-max", "0"],
     "--parallel runs the speculative cycle on every slot: give --draft-max 1 or more"),
    (["--parallel", "8", "-c", "256"], "-c 256 split over 8 slots leaves 32 tokens each: raise -c to at least 512 or "
                                      "lower --parallel"),
])
def test_bad_flags_one_line(tiny_target, tiny_head, flags, expected, tmp_path):
    flags = [str(tmp_path / f[4:]) if f.startswith("TMP/") else f for f in flags]
    expected = expected.replace("TMP/", f"{tmp_path}/")
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft",
                        str(tiny_head), *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {expected}"]


# -- speculation statistics: SmolLM2 + the shipped head, counting (the head predicts it) -----------------------
def speculated(spec: dict, n_generated: int) -> None:
    """A request's `speculation`: drafts accepted, more than one token per target forward, and counts that
    tell one story (every token is a target forward's own or an accepted draft)."""
    assert spec["drafted"] > 0 and spec["accepted"] > 0, spec
    assert spec["tokens_per_forward"] > 1.0 and spec["fallback"] is None
    assert spec["generated"] == n_generated == spec["target_forwards"] + spec["accepted"]
    assert spec["tokens_per_forward"] == pytest.approx(n_generated / spec["target_forwards"])


@pytest.fixture(scope="module")
def smol_server(smollm2_path):
    """serve with SmolLM2 + the shipped head, drafting every cycle (fixed policy, K=4, p_min 0); rejection
    sampling (the default) with the head's temperature at half the request's."""
    flags = ["--draft-policy", "fixed", "--draft-max", "4", "--draft-p-min", "0", "--draft-temp-scale", "0.5"]
    with serving(smollm2_path, default_head_path(), *flags) as port:
        yield port


@pytest.fixture(scope="module")
def smol_plain(smollm2_path):
    with plain_llama(smollm2_path) as llm:
        yield llm


def test_usage_reports_speculation(smol_server, smol_plain):
    """A non-streamed answer carries its request's statistics in `usage.speculation`, which the OpenAI client
    keeps; the text is plain llama-cpp-python's; GET /v1/eagle3/stats reports the same request."""
    got = openai_client(smol_server).completions.create(model=ALIAS, prompt=COUNT, max_tokens=N, temperature=0,
                                                        extra_body=EXTRA)
    want = smol_plain.create_completion(COUNT, max_tokens=N, **PLAIN)
    assert got.choices[0].text == want["choices"][0]["text"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"] == N
    spec = got.usage.speculation
    speculated(spec, N)
    assert (spec["spec_sampling"], spec["verification"], spec["policy"], spec["draft_max"]) == (
        "greedy", "greedy", "fixed", 4)
    board = get_json(smol_server, "/v1/eagle3/stats")
    assert board["last"] == spec


def test_stream_reported_by_stats_endpoint(smol_server, smol_plain):
    """A stream's statistics: GET /v1/eagle3/stats after it, with totals over every request."""
    before = get_json(smol_server, "/v1/eagle3/stats")
    messages = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    stream = openai_client(smol_server).chat.completions.create(model=ALIAS, messages=messages, max_tokens=N,
                                                                temperature=0, stream=True, extra_body=EXTRA)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    want = smol_plain.create_chat_completion(messages, max_tokens=N, **PLAIN)
    assert text == want["choices"][0]["message"]["content"]
    board = get_json(smol_server, "/v1/eagle3/stats")
    speculated(board["last"], N)
    assert board["requests"] == before["requests"] + 1
    for key in ("drafted", "accepted", "target_forwards", "generated"):
        assert board["total"][key] == before["total"][key] + board["last"][key]


def test_rejection_sampling_reported(smol_server):
    """At temperature > 0, serve verifies by rejection sampling (its default, as generate's), with
    --draft-temp-scale reaching the model."""
    got = openai_client(smol_server).completions.create(model=ALIAS, prompt=COUNT, max_tokens=N, temperature=0.7,
                                                        seed=1, extra_body=EXTRA)
    spec = got.usage.speculation
    assert spec["spec_sampling"] == "rejection"
    assert spec["verification"] == "rejection (draft q at 0.5x the temperature)"
    assert spec["drafted"] > 0 and spec["generated"] == spec["target_forwards"] + spec["accepted"]
