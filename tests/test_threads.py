"""Two Eagle3Llama objects in one process are independent (interleaved, and on two threads); one object used
from two threads at once is run in a child process, so whatever it does cannot take pytest down."""

from __future__ import annotations

import subprocess
import sys
import threading

import llama_cpp
import pytest

from eagle3_gguf.llama import Eagle3Llama
from eagle3_gguf.native import CACHE_TYPES

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A list of fruits:"]
GREEDY = dict(temperature=0.0, repeat_penalty=1.0)
N_CTX = 512


@pytest.fixture(scope="module")
def alone(tiny_target):
    llm = llama_cpp.Llama(model_path=str(tiny_target), n_ctx=N_CTX, flash_attn=True, type_v=CACHE_TYPES["bf16"],
                          verbose=False)
    yield {p: llm.create_completion(p, max_tokens=60, **GREEDY)["choices"][0]["text"] for p in PROMPTS}
    llm.close()


def stream_text(llm, prompt: str):
    for chunk in llm.create_completion(prompt, max_tokens=60, stream=True, **GREEDY):
        yield chunk["choices"][0]["text"]


def test_two_objects_interleaved_and_on_two_threads(tiny_target, tiny_head, tiny_head_d2t, alone):
    a = Eagle3Llama(model_path=str(tiny_target), draft_model_path=str(tiny_head), n_ctx=N_CTX, verbose=False)
    b = Eagle3Llama(model_path=str(tiny_target), draft_model_path=str(tiny_head_d2t), n_ctx=N_CTX, verbose=False,
                    draft_policy="fixed")
    try:
        # interleaved token by token in one thread
        for p, q in zip(PROMPTS, reversed(PROMPTS)):
            sa, sb, ta, tb = stream_text(a, p), stream_text(b, q), [], []
            for x, y in zip(sa, sb):
                ta.append(x)
                tb.append(y)
            ta += list(sa)
            tb += list(sb)
            assert ("".join(ta), "".join(tb)) == (alone[p], alone[q])
        assert b.spec_stats.n_drafted > 0  # the fixed policy really drafted with the d2t head
        # each object on its own thread, at the same time
        got: dict[str, list[str]] = {"a": [], "b": []}

        def run(name, llm, prompts):
            for p in prompts * 2:
                got[name].append(llm.create_completion(p, max_tokens=60, **GREEDY)["choices"][0]["text"])

        threads = [threading.Thread(target=run, args=("a", a, PROMPTS)),
                   threading.Thread(target=run, args=("b", b, PROMPTS[::-1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got["a"] == [alone[p] for p in PROMPTS * 2]
        assert got["b"] == [alone[p] for p in PROMPTS[::-1] * 2]
    finally:
        a.close()
        b.close()


ONE_OBJECT_TWO_THREADS = r"""
import sys, threading
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.llama import Eagle3Llama
target, head = sys.argv[1], sys.argv[2]
prompts = ["Once upon a time", "The capital of France is"]
llm = Eagle3Llama(model_path=target, draft_model_path=head, n_ctx=512, verbose=False)
for rep in range(4):
    got = [None, None]
    def run(i):
        try:
            got[i] = llm.create_completion(prompts[i], max_tokens=60, temperature=0.0,
                                           repeat_penalty=1.0)["choices"][0]["text"]
        except Eagle3Error as e:
            got[i] = "Eagle3Error: " + str(e)
    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts: t.start()
    for t in ts: t.join()
    for g in got: print(repr(g), flush=True)
"""


def test_one_object_from_two_threads_is_right_or_a_clear_error(tiny_target, tiny_head, alone):
    """Each answer is either its alone-answer or a one-line Eagle3Error saying to use one object per thread;
    the process never crashes."""
    r = subprocess.run([sys.executable, "-c", ONE_OBJECT_TWO_THREADS, str(tiny_target), str(tiny_head)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = [eval(line) for line in r.stdout.splitlines()]  # noqa: S307 (our own repr output)
    assert len(answers) == 8
    for i, got in enumerate(answers):
        want = alone[["Once upon a time", "The capital of France is"][i % 2]]
        assert got == want or (got.startswith("Eagle3Error: ") and "thread" in got), (i, got)


def test_a_stream_left_unfinished_is_superseded_cleanly(tiny_target, tiny_head, alone):
    """A new call while an earlier stream is suspended runs as on a fresh object; the old stream then raises
    a clear error instead of writing into the new call's caches, and the object goes on answering."""
    from eagle3_gguf.errors import Eagle3Error
    from eagle3_gguf.llama import SUPERSEDED

    llm = Eagle3Llama(model_path=str(tiny_target), draft_model_path=str(tiny_head), n_ctx=N_CTX, verbose=False,
                      draft_policy="fixed")
    try:
        old = stream_text(llm, PROMPTS[0])
        first = [next(old) for _ in range(3)]
        assert llm.create_completion(PROMPTS[1], max_tokens=60, **GREEDY)["choices"][0]["text"] == alone[PROMPTS[1]]
        assert llm.spec_stats.n_drafted > 0
        with pytest.raises(Eagle3Error, match="superseded"):
            list(old)
        assert "".join(first) == alone[PROMPTS[0]][:len("".join(first))]
        assert "".join(stream_text(llm, PROMPTS[2])) == alone[PROMPTS[2]]
        assert "thread" in SUPERSEDED
    finally:
        llm.close()
