"""The slot pool behind `serve --parallel` (eagle3_gguf/slots.py): four generations at once on one target,
their target decodes in shared batches, give each its alone-answer and draft exactly as alone (the cycle on
sequence `seq`, its rows and hidden states read back at `row0`)."""

from __future__ import annotations

import dataclasses

import threading
from contextlib import closing

import pytest
from llama_cpp import _internals

from eagle3_gguf.assets import default_head_path
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.llama import Eagle3Llama
from eagle3_gguf.native import CACHE_TYPES
from eagle3_gguf.slots import Engine, SlotPool

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A list of fruits:"]
GREEDY = dict(temperature=0.0, repeat_penalty=1.0)
KW = dict(n_ctx=256, n_batch=64, verbose=False, flash_attn=True, type_v=CACHE_TYPES["bf16"])


def answer(llm, prompt: str, stream: bool) -> tuple[str, int, int]:
    """The text, and the drafts the call made and kept."""
    if stream:
        text = "".join(c["choices"][0]["text"] for c in llm.create_completion(prompt, max_tokens=40, stream=True,
                                                                               **GREEDY))
    else:
        text = llm.create_completion(prompt, max_tokens=40, **GREEDY)["choices"][0]["text"]
    return text, llm.spec_stats.n_drafted, llm.spec_stats.n_accepted


@pytest.fixture(scope="module")
def engine():
    engine = Engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def llm(smollm2_path, engine):
    """SmolLM2 and the shipped head (a head whose drafts the target keeps), built on the engine's thread."""
    llm = engine.call(lambda: Eagle3Llama(model_path=str(smollm2_path), draft_model_path=str(default_head_path()),
                                          draft_policy="fixed", draft_max=4, **KW))
    engine.adopt_llama(llm)  # as serve does
    with closing(llm):
        yield llm


def test_slots_at_once_answer_and_draft_as_alone(llm, engine):
    want = [answer(llm, p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)]
    pool = SlotPool(llm, 4, engine)
    got: list = [None] * 4
    go = threading.Barrier(4)

    def one(i: int) -> None:
        slot = pool.acquire(timeout=60)
        go.wait()
        try:
            got[i] = answer(slot, PROMPTS[i], stream=i % 2 == 0)
        except BaseException as e:  # reported by the assertion below
            got[i] = e
        finally:
            pool.release(slot)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want  # texts, and the very same drafts made and kept: the head read the right rows
    assert sum(accepted for _, _, accepted in got) > 0
    st = pool.joint.stats
    assert st.most_sequences >= 2 and st.sequences > st.decodes  # the decodes were shared
    # a slot used again continues from its own sequence's prefix, alone
    slot = pool.acquire(timeout=5)
    try:
        assert answer(slot, PROMPTS[1], stream=False) == want[1]
    finally:
        pool.release(slot)


def test_slot_pool_refusals(llm, engine):
    pool = SlotPool(llm, 1, engine)
    slot = pool.acquire()
    with pytest.raises(Eagle3Error, match="cannot decode plainly \\(empty prompt\\)"):
        list(slot.generate([]))
    pool.release(slot)
    with pytest.raises(Eagle3Error, match="not out of this pool"):
        pool.release(slot)


def test_engine_computes_every_adopted_graph_on_its_thread(llm, engine, monkeypatch):
    """serve builds the model on the engine's thread and routes every graph there (the target's, the head's,
    and llama-cpp-python's own decodes): ggml's OpenMP team belongs to the computing thread."""
    threads = []

    def graph(_ctx_ptr, *_args) -> int:
        threads.append(threading.current_thread().name)
        return 0

    for ctx in (llm._e3_pair.target, llm._e3_pair.head):
        ctx._run(graph)
    assert threads == ["eagle3-engine", "eagle3-engine"]
    assert engine.call(lambda: threading.current_thread().name) == "eagle3-engine"
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda: 1 / 0)
    llama_decode = _internals.llama_cpp.llama_decode
    decoding = set()

    def recorded(*args):
        decoding.add(threading.current_thread().name)
        return llama_decode(*args)

    monkeypatch.setattr(_internals.llama_cpp, "llama_decode", recorded)
    plain = dict(GREEDY, max_tokens=12)
    llm.draft_config = dataclasses.replace(llm.draft_config, draft_max=0)  # plain decoding, llama-cpp-python's own decodes
    try:
        text = llm.create_completion(PROMPTS[0], **plain)["choices"][0]["text"]
    finally:
        llm.draft_config = dataclasses.replace(llm.draft_config, draft_max=4)
    assert llm.spec_fallback == "draft_max is 0"
    assert decoding == {"eagle3-engine"}
    assert text == llm.create_completion(PROMPTS[0], **plain)["choices"][0]["text"]


def test_a_failed_shared_decode_fails_only_its_own_slot(llm, engine):
    """One slot decodes past its context's end (its KV stream is full) while another answers: the shared batch
    fails, its rows go again one slot at a time, and only the slot that overflowed gets the error."""
    want = answer(llm, PROMPTS[2], stream=False)
    pool = SlotPool(llm, 2, engine)
    a, b = pool.acquire(), pool.acquire()
    # b's cycles are mostly one row, as a's last ones: they share batches (a slot's config is its own)
    b.draft_config = dataclasses.replace(b.draft_config, draft_p_min=0.999)
    assert a.draft_config.draft_p_min == llm.draft_config.draft_p_min != 0.999
    long_prompt = a.tokenize(b"A list of fruits:" * 200)[:a.n_ctx() - 8]
    got: dict = {}

    def overflow() -> None:
        try:
            for _ in a.generate(long_prompt, temp=0.0):
                pass
        except Eagle3Error as e:
            got["a"] = e

    def answers() -> None:
        got["b"] = answer(b, PROMPTS[2], stream=False)

    threads = [threading.Thread(target=overflow), threading.Thread(target=answers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert str(got["a"]) == "llama_decode found no room in the KV cache (rc=1): the context is full: raise -c"
    assert got["b"][0] == want[0]  # its text (it drafted less)
    pool.release(a)
    pool.release(b)
