"""`eagle3-gguf serve`: llama-cpp-python's OpenAI-compatible server with the head, end to end over HTTP."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from contextlib import closing, contextmanager

import llama_cpp
import pytest

from eagle3_gguf.native import CACHE_TYPES

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

N_CTX = 512
ALIAS = "tiny"
PLAIN = dict(temperature=0.0, repeat_penalty=1.0)  # what the requests below ask for
EXTRA = {"repeat_penalty": 1.0}  # the server's own default is 1.1
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=2)) as c:
                c.request("GET", "/v1/models")
                if c.getresponse().status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not come up in time")


def raw_post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=60)) as c:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()


@contextmanager
def serving(tiny_target, tiny_head, *flags):
    """`eagle3-gguf serve` on the tiny pair in a subprocess; yields its port."""
    port = free_port()
    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft", str(tiny_head),
           "--port", str(port), "-c", str(N_CTX), "--alias", ALIAS, "-t", "2", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(proc, port)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def openai_client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_target, tiny_head):
    with serving(tiny_target, tiny_head) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def plain(tiny_target):
    # the server's exactness settings (serve.py: flash attention, bf16 V cache)
    llm = llama_cpp.Llama(model_path=str(tiny_target), n_ctx=N_CTX, flash_attn=True, type_v=CACHE_TYPES["bf16"],
                          verbose=False)
    yield llm
    llm.close()


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


@pytest.mark.parametrize("flags, expected", [
    (["--draft-p-min", "1.5"], "--draft-p-min must be in [0, 1) (got 1.5)"),
    (["--draft-max", "33"], "--draft-max must be between 0 and 32 (got 33)"),
    (["--port", "0"], "--port must be in 1..65535 (got 0)"),
    (["--draft-policy", "greedy"], "--draft-policy must be adaptive or fixed (got greedy)"),
    (["--spec-sampling", "bogus"], "--spec-sampling must be rejection or match (got bogus)"),
    (["--draft-temp-scale", "-1"], "--draft-temp-scale cannot be negative (got -1.0)"),
    (["--spec-sampling", "match", "--draft-temp-scale", "0.5"],
     "--draft-temp-scale shapes the rejection rule's draft distribution: it has no effect with --spec-sampling match"),
])
def test_bad_flags_one_line(tiny_target, tiny_head, flags, expected):
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(tiny_target), "--draft",
                        str(tiny_head), *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {expected}"]
