"""Eagle3Llama, the drop-in llama_cpp.Llama: same answers as plain Llama, call for call."""

from __future__ import annotations

import dataclasses

import itertools
import warnings
import pickle
from contextlib import closing

import llama_cpp
import numpy as np
import pytest
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from eagle3_gguf.config import DraftConfig
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.llama import Eagle3Llama, attach_eagle3
from eagle3_gguf.native import CACHE_TYPES
from eagle3_gguf.policy import FixedPolicy
from eagle3_gguf.session import Eagle3Session
from oracle import OracleSession
from model_factory import HeadSpec, write_random_head

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
# Eagle3Llama's exactness defaults (plain Llama defaults to flash_attn=False and an f16 V cache)
EXACT = dict(flash_attn=True, type_v=CACHE_TYPES["bf16"])
KW = dict(n_ctx=512, n_batch=64, seed=1234, verbose=False, **EXACT)
GREEDY = dict(temperature=0.0)
HOT = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)  # really samples on the peaked tiny model


def use_session(llm: Eagle3Llama, session: Eagle3Session) -> None:
    llm._e3_session.close()
    llm._e3_session = session
    llm._e3_head_tokens.clear()


def text_of(r) -> str:
    return r["choices"][0]["text"]


def same(a, b) -> None:
    """Two non-streamed responses agree on everything but their ids and timestamps."""
    for key in ("id", "created", "model"):
        a.pop(key, None)
        b.pop(key, None)
    assert a == b


def same_state(plain: llama_cpp.Llama, ours: Eagle3Llama) -> None:
    assert ours.n_tokens == plain.n_tokens
    assert ours.input_ids[:ours.n_tokens].tolist() == plain.input_ids[:plain.n_tokens].tolist()


def consistent(st) -> None:
    """The statistics tell one story: accepted drafts by cycle, by position and in total agree."""
    assert st.n_accepted == sum(n * c for n, c in enumerate(st.accept_hist)) == sum(st.accepted_by_pos)
    assert sum(st.accept_hist) == st.n_target_forwards - 1  # one cycle per forward after the prefill
    assert all(0 <= a <= d for a, d in zip(st.accepted_by_pos, st.drafted_by_pos))


def chunks(stream) -> list[tuple]:
    out = []
    for c in stream:
        ch = c["choices"][0]
        out.append((ch.get("text", ch.get("delta")), ch["finish_reason"]))
    return out


@pytest.fixture(scope="module")
def plain(tiny_target):
    llm = llama_cpp.Llama(model_path=str(tiny_target), **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ours(tiny_target, tiny_head):
    llm = Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", draft_max=4, **KW)
    yield llm
    llm.close()


# -- greedy: identical responses ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_identical(plain, ours, prompt):
    same(plain.create_completion(prompt, max_tokens=40, **GREEDY), ours.create_completion(prompt, max_tokens=40, **GREEDY))
    same_state(plain, ours)
    st = ours.spec_stats
    assert ours.spec_fallback is None and st.n_drafted > 0 and st.n_generated == 40


def test_call_and_streaming_identical(plain, ours):
    same(plain(PROMPTS[1], max_tokens=30, **GREEDY), ours(PROMPTS[1], max_tokens=30, **GREEDY))
    a = chunks(plain.create_completion(PROMPTS[2], max_tokens=30, stream=True, **GREEDY))
    b = chunks(ours.create_completion(PROMPTS[2], max_tokens=30, stream=True, **GREEDY))
    assert a == b and a[-1][1] == "length"
    same_state(plain, ours)


def test_chat_identical(plain, ours):
    same(plain.create_chat_completion(CHAT, max_tokens=40, **GREEDY),
         ours.create_chat_completion(CHAT, max_tokens=40, **GREEDY))
    a = chunks(plain.create_chat_completion(CHAT, max_tokens=25, stream=True, **GREEDY))
    b = chunks(ours.create_chat_completion(CHAT, max_tokens=25, stream=True, **GREEDY))
    assert a == b
    same_state(plain, ours)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_mid_cycle(plain, ours, stream):
    full = text_of(plain.create_completion(PROMPTS[0], max_tokens=40, **GREEDY))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    if stream:
        a = chunks(plain.create_completion(PROMPTS[0], max_tokens=40, stop=[stop], stream=True, **GREEDY))
        b = chunks(ours.create_completion(PROMPTS[0], max_tokens=40, stop=[stop], stream=True, **GREEDY))
        assert a == b and a[-1][1] == "stop"
    else:
        a = plain.create_completion(PROMPTS[0], max_tokens=40, stop=stop, **GREEDY)
        b = ours.create_completion(PROMPTS[0], max_tokens=40, stop=stop, **GREEDY)
        assert a["choices"][0]["finish_reason"] == "stop"
        same(a, b)
    same_state(plain, ours)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens(plain, ours, max_tokens):
    same(plain.create_completion(PROMPTS[1], max_tokens=max_tokens, **GREEDY),
         ours.create_completion(PROMPTS[1], max_tokens=max_tokens, **GREEDY))
    same_state(plain, ours)


def test_max_tokens_beyond_context_is_clamped_alike(plain, ours):
    a = plain.create_completion(PROMPTS[0], max_tokens=5000, **GREEDY)
    b = ours.create_completion(PROMPTS[0], max_tokens=5000, **GREEDY)
    same(a, b)
    assert a["usage"]["total_tokens"] == KW["n_ctx"] and a["choices"][0]["finish_reason"] == "length"


def test_drafts_past_the_n_ctx_asked_for(tiny_target, tiny_head):
    """llama.cpp pads n_ctx=160 to 256 and Llama generates to 256 though its input_ids has 160 rows; a
    cycle of kept drafts past row 160 answers as plain Llama does (the soak found a ValueError here)."""
    kw = {**KW, "n_ctx": 160}
    with closing(llama_cpp.Llama(model_path=str(tiny_target), **kw)) as p:
        prompt = p.tokenize(PROMPTS[0].encode())
        truth = prompt + list(itertools.islice(p.generate(prompt, temp=0.0), p.n_ctx() - len(prompt)))
        base = p.create_completion(PROMPTS[0], max_tokens=5000, **GREEDY)
        assert p.n_ctx() > 160 and base["usage"]["total_tokens"] == p.n_ctx()
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             draft_max=4, **kw)) as llm:
        use_session(llm, OracleSession(llm._e3_pair.target, llm._e3_pair.head, truth=truth, schedule=[4, 3]))
        same(base, llm.create_completion(PROMPTS[0], max_tokens=5000, **GREEDY))
        assert llm.spec_stats.n_accepted > 100
        assert llm.input_ids[:llm.n_tokens].tolist() == truth[:llm.n_tokens]


def test_a_prompt_the_head_only_glimpses_answers_alike(tiny_target, tiny_head, plain, monkeypatch):
    """Where the policy does not expect drafting to pay, the head keeps only the prompt's last rows (a
    gap before them); drafting, prefix reuse and the answers go on as before."""
    monkeypatch.setattr(FixedPolicy, "wants_prompt", lambda self: False)
    prompt = " ".join([PROMPTS[2]] * 4)
    plain(prompt, max_tokens=41, **GREEDY)
    truth = plain.input_ids[:plain.n_tokens].tolist()
    base = plain(prompt, max_tokens=40, **GREEDY)
    again = plain(prompt + " And", max_tokens=20, **GREEDY)
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             draft_max=4, **KW)) as llm:
        use_session(llm, OracleSession(llm._e3_pair.target, llm._e3_pair.head, truth=truth, schedule=[4, 2]))
        same(base, llm(prompt, max_tokens=40, **GREEDY))
        session = llm._e3_session
        assert session.gaps and session.gaps[0][0] == 0 and session.shift >= len(truth) - 40 - session.window
        assert llm.spec_stats.n_accepted > 10
        same(again, llm(prompt + " And", max_tokens=20, **GREEDY))


def test_calls_in_a_row_reuse_the_prefix(plain, ours):
    """Second call extends the first's prompt (a chat turn), third shares only part of it."""
    first = PROMPTS[2]
    same(plain(first, max_tokens=20, **GREEDY), ours(first, max_tokens=20, **GREEDY))
    second = first + text_of(plain(first, max_tokens=20, **GREEDY)) + " And then"
    ours(first, max_tokens=20, **GREEDY)
    same(plain(second, max_tokens=20, **GREEDY), ours(second, max_tokens=20, **GREEDY))
    same_state(plain, ours)
    third = first + " the baker said"
    same(plain(third, max_tokens=20, **GREEDY), ours(third, max_tokens=20, **GREEDY))
    same_state(plain, ours)


def test_rewound_head_drafts_like_a_fresh_one(tiny_target, tiny_head, ours):
    """After a call with another prompt sharing a prefix, the head drafts what a fresh head drafts."""
    def drafts_of(llm, prompt):
        seen = []
        real = llm._e3_session.draft

        def spy(*a, **k):
            seen.append(real(*a, **k))
            return seen[-1]
        llm._e3_session.draft = spy
        try:
            llm(prompt, max_tokens=20, **GREEDY)
        finally:
            del llm._e3_session.draft
        return seen

    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", **KW)) as fresh:
        expected = drafts_of(fresh, PROMPTS[2] + " the baker said")
    ours(PROMPTS[2] + " a dog barked", max_tokens=10, **GREEDY)
    assert drafts_of(ours, PROMPTS[2] + " the baker said") == expected


# -- the sampler chain: seeds, penalties, grammar, logit bias, processors, criteria -------------------------
def test_seeded_sampling_identical(plain, ours):
    a = plain.create_completion(PROMPTS[2], max_tokens=30, seed=7, **HOT)
    other = plain.create_completion(PROMPTS[2], max_tokens=30, seed=8, **HOT)
    assert text_of(a) != text_of(other)  # the seed matters, so the equality below means something
    same(a, ours.create_completion(PROMPTS[2], max_tokens=30, seed=7, **HOT))
    same(plain.create_chat_completion(CHAT, max_tokens=20, seed=3, **HOT),
         ours.create_chat_completion(CHAT, max_tokens=20, seed=3, **HOT))


@pytest.mark.parametrize("extra", [dict(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
                                   dict(mirostat_mode=2, temperature=0.9)],
                         ids=["penalties", "mirostat"])
def test_stateful_samplers_identical(plain, ours, extra):
    args = {**GREEDY, **extra}
    same(plain.create_completion(PROMPTS[0], max_tokens=30, seed=5, **args),
         ours.create_completion(PROMPTS[0], max_tokens=30, seed=5, **args))


def test_grammar_identical(plain, ours):
    grammar = 'root ::= [a-z ]+ "." [a-z ]*'
    a = plain.create_completion(PROMPTS[0], max_tokens=25, grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False), **GREEDY)
    b = ours.create_completion(PROMPTS[0], max_tokens=25, grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False), **GREEDY)
    same(a, b)
    assert set(text_of(a)) <= set("abcdefghijklmnopqrstuvwxyz .")


def test_logit_bias_and_eos_identical(plain, ours):
    eos = plain.token_eos()
    full = plain.tokenize(text_of(plain(PROMPTS[1], max_tokens=12, **GREEDY)).encode(), add_bos=False)
    bias = {full[3]: -100.0}  # changes the text from the fourth token on
    same(plain(PROMPTS[1], max_tokens=12, logit_bias=bias, **GREEDY), ours(PROMPTS[1], max_tokens=12, logit_bias=bias, **GREEDY))
    a = plain(PROMPTS[1], max_tokens=12, logit_bias={eos: 30.0}, **GREEDY)
    b = ours(PROMPTS[1], max_tokens=12, logit_bias={eos: 30.0}, **GREEDY)
    same(a, b)
    assert a["choices"][0]["finish_reason"] == "stop"
    same_state(plain, ours)


def test_logits_processor_sees_the_same_calls(plain, ours):
    def recorder(log):
        def proc(input_ids, scores):
            log.append(input_ids.tolist())
            return scores
        return llama_cpp.LogitsProcessorList([proc])

    seen_plain, seen_ours = [], []
    same(plain(PROMPTS[0], max_tokens=15, logits_processor=recorder(seen_plain), **GREEDY),
         ours(PROMPTS[0], max_tokens=15, logits_processor=recorder(seen_ours), **GREEDY))
    assert seen_ours == seen_plain and len(seen_plain) == 15


def test_stopping_criteria_identical(plain, ours):
    n_prompt = len(plain.tokenize(PROMPTS[2].encode()))
    stop_at = llama_cpp.StoppingCriteriaList([lambda ids, _logits: len(ids) >= n_prompt + 9])
    a = plain(PROMPTS[2], max_tokens=30, stopping_criteria=stop_at, **GREEDY)
    b = ours(PROMPTS[2], max_tokens=30, stopping_criteria=stop_at, **GREEDY)
    same(a, b)
    assert a["choices"][0]["finish_reason"] == "stop" and a["usage"]["completion_tokens"] == 9
    same_state(plain, ours)


def test_logprobs_with_logits_all(tiny_target, tiny_head):
    kw = {**KW, "logits_all": True}
    with closing(llama_cpp.Llama(model_path=str(tiny_target), **kw)) as plain, \
            closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", **kw)) as ours:
        a = plain(PROMPTS[0], max_tokens=12, logprobs=3, **GREEDY)
        b = ours(PROMPTS[0], max_tokens=12, logprobs=3, **GREEDY)
        la, lb = a["choices"][0].pop("logprobs"), b["choices"][0].pop("logprobs")
        same(a, b)
        assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
        assert la["token_logprobs"] == pytest.approx(lb["token_logprobs"], abs=1e-4)
        assert ours.spec_stats.n_drafted > 0


# -- the speculative path really accepts -------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [GREEDY, {**HOT, "seed": 11}], ids=["greedy", "seeded"])
def test_forced_acceptance(tiny_target, tiny_head, plain, sampling):
    k = 4
    plain(PROMPTS[1], max_tokens=61, **sampling)
    truth = plain.input_ids[:plain.n_tokens].tolist()  # the prompt and the 60 tokens below
    base = plain(PROMPTS[1], max_tokens=60, **sampling)
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", draft_max=k, **KW)) as llm:
        use_session(llm, OracleSession(llm._e3_pair.target, llm._e3_pair.head, truth=truth,
                                       schedule=[0, 1, 2, 3, 4, 4, 2]))
        same(base, llm(PROMPTS[1], max_tokens=60, **sampling))
        st = llm.spec_stats
        assert all(st.accept_hist[n] > 0 for n in range(k + 1)), st.accept_hist
        assert st.tau > 1.5
        assert st.n_accepted + st.n_target_forwards == st.n_generated == 60
        consistent(st)
        same_state(plain, llm)


@pytest.mark.parametrize("cut", [13, 22, 31])
def test_stop_inside_an_accepted_run_keeps_stats_consistent(tiny_target, tiny_head, plain, cut):
    """A stop string that ends inside a cycle's accepted drafts: the text stops there, and the cycle is
    counted as accepting only the drafts that were emitted."""
    plain(PROMPTS[1], max_tokens=61, **GREEDY)
    truth = plain.input_ids[:plain.n_tokens].tolist()
    full = text_of(plain(PROMPTS[1], max_tokens=60, **GREEDY))
    stop = full[cut:cut + 4]
    base = plain(PROMPTS[1], max_tokens=60, stop=[stop], **GREEDY)
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", draft_max=4, **KW)) as llm:
        use_session(llm, OracleSession(llm._e3_pair.target, llm._e3_pair.head, truth=truth, schedule=[4]))
        same(base, llm(PROMPTS[1], max_tokens=60, stop=[stop], **GREEDY))
        st = llm.spec_stats
        assert st.n_accepted + st.n_target_forwards == st.n_generated < 60
        consistent(st)


# -- attach_eagle3 -----------------------------------------------------------------------------------------
def test_attach_eagle3(tiny_target, tiny_head, plain):
    llm = llama_cpp.Llama(model_path=str(tiny_target), **KW)
    try:
        before = llm(PROMPTS[0], max_tokens=20, **GREEDY)
        spec = attach_eagle3(llm, tiny_head, draft_max=3, draft_policy="fixed")
        assert isinstance(spec, Eagle3Llama) and isinstance(spec, llama_cpp.Llama) and type(llm) is llama_cpp.Llama
        assert spec.model_path == llm.model_path and spec._ctx is llm._ctx  # nothing loaded again
        same(before, spec(PROMPTS[0], max_tokens=20, **GREEDY))
        same(plain(PROMPTS[2], max_tokens=20, **GREEDY), spec(PROMPTS[2], max_tokens=20, **GREEDY))
        assert spec.spec_stats.draft_max == 3 and spec.spec_stats.n_drafted > 0
        # one KV cache: the plain Llama and the attached one take turns, each reusing what the cache holds
        assert llm.n_tokens == spec.n_tokens > 0
        same(plain(PROMPTS[2] + " and", max_tokens=20, **GREEDY), llm(PROMPTS[2] + " and", max_tokens=20, **GREEDY))
        same(plain(PROMPTS[2], max_tokens=20, **GREEDY), spec(PROMPTS[2], max_tokens=20, **GREEDY))
        assert spec.spec_stats.n_drafted > 0
        for again in (llm, spec):
            with pytest.raises(Eagle3Error, match="already has an EAGLE-3 head"):
                attach_eagle3(again, tiny_head)
        clone = pickle.loads(pickle.dumps(spec))  # comes back as an Eagle3Llama of the same files
        with closing(clone):
            assert type(clone) is Eagle3Llama and clone.draft_config == spec.draft_config
            same(before, clone(PROMPTS[0], max_tokens=20, **GREEDY))
    finally:
        llm.close()
    assert spec._e3_spec is None  # closing the Llama closed the head it carried


def test_attach_eagle3_keeps_a_subclass(tiny_target, tiny_head):
    class Mine(llama_cpp.Llama):
        def tokenize(self, text, add_bos=True, special=False):
            self.tokenized = getattr(self, "tokenized", 0) + 1
            return super().tokenize(text, add_bos, special)

    with closing(Mine(model_path=str(tiny_target), **KW)) as llm:
        spec = attach_eagle3(llm, tiny_head, draft_policy="fixed")
        assert isinstance(spec, Mine) and isinstance(spec, Eagle3Llama)
        spec(PROMPTS[0], max_tokens=5, **GREEDY)
        assert llm.tokenized >= 1 and spec.spec_stats.n_generated > 0  # its method ran, its state is the Llama's


# -- fallbacks and errors ----------------------------------------------------------------------------------
def test_draft_max_zero_falls_back_to_plain(plain, ours):
    ours.draft_config = dataclasses.replace(ours.draft_config, draft_max=0)
    try:
        same(plain(PROMPTS[0], max_tokens=15, **GREEDY), ours(PROMPTS[0], max_tokens=15, **GREEDY))
        assert ours.spec_fallback == "draft_max is 0" and ours.spec_stats.n_drafted == 0
    finally:
        ours.draft_config = dataclasses.replace(ours.draft_config, draft_max=4)
    same(plain(PROMPTS[0] + " Paris", max_tokens=15, **GREEDY), ours(PROMPTS[0] + " Paris", max_tokens=15, **GREEDY))
    assert ours.spec_fallback is None


def test_raw_generate_and_its_fallbacks(plain, ours):
    toks = plain.tokenize(PROMPTS[1].encode())
    a = list(itertools.islice(plain.generate(toks, temp=0.0), 10))
    b = list(itertools.islice(ours.generate(toks, temp=0.0), 10))
    assert a == b
    gen = ours.generate(toks, temp=0.0, reset=False)
    next(gen)
    gen.close()
    assert ours.spec_fallback.startswith("generate(reset=False)")
    gen = ours.generate(toks, temp=0.0)
    next(gen)
    with pytest.raises(Eagle3Error, match="send"):
        gen.send([1, 2])


def test_one_cost_key_per_setup(tiny_target, tiny_head):
    """The drop-in and the CLI's pair key the cost cache alike for the same set-up (they once used two tags,
    so one set-up was calibrated twice), and a set-up that costs differently gets another key (a KV cache
    type; weights not repacked for the CPU kernels; n_ubatch)."""
    from eagle3_gguf.pair import PairConfig, load_pair
    from eagle3_gguf.costs import CostKey

    setup = dict(n_ctx=512, n_batch=64, n_threads=2)
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             verbose=False, **setup)) as llm, \
            load_pair(tiny_target, tiny_head, PairConfig(**setup)) as pair, \
            load_pair(tiny_target, tiny_head, PairConfig(**setup, cache_type_v="f16")) as f16:
        key = CostKey.for_contexts(llm._e3_pair.target, llm._e3_pair.head, 64)
        assert key == CostKey.for_contexts(pair.target, pair.head, 64)
        assert key != CostKey.for_contexts(f16.target, f16.head, 64)
    with load_pair(tiny_target, tiny_head, PairConfig(**setup, repack=False)) as as_stored:  # weights not repacked
        assert key != CostKey.for_contexts(as_stored.target, as_stored.head, 64)
    # a narrower n_ubatch computes wide batches as ubatches: the probe compares products only up to it
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             verbose=False, n_ubatch=8, **setup)) as narrow:
        assert key != CostKey.for_contexts(narrow._e3_pair.target, narrow._e3_pair.head, 64)


def test_a_lora_adapter_is_part_of_the_set_up_the_probe_measures(tiny_target, tiny_head, tmp_path):
    """Llama(lora_path=...) computes with the adapter: the exactness probe's own context (made beside the Llama's,
    for its eval callback) computes with it too, so it judges the products the run computes (it made its context
    without: a strong adapter's F32 products parted from one-token decoding unseen, under --exact strict too), and
    the cost key names the adapter and its scale (a probe cached without it was reused with it)."""
    from eagle3_gguf.batch import Batch
    from eagle3_gguf.costs import CostKey
    from eagle3_gguf.exactness import ProbeCallback, _probe_context
    from model_factory import write_lora

    lora = write_lora(tmp_path / "lora.gguf", tiny_target)
    setup = dict(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", verbose=False,
                 n_ctx=256, n_batch=64, n_threads=1, exact="strict")  # strict: no warning where a width parts
    tokens = [1, 17, 402, 9, 33]

    def last_logits(ctx) -> np.ndarray:
        with Batch(64) as batch:
            ctx.clear()
            batch.set(tokens, 0, logits="last")
            ctx.decode(batch)
            out = ctx.logits_ith(len(tokens) - 1).copy()
            ctx.clear()
            return out

    with closing(Eagle3Llama(**setup)) as plain:
        without = last_logits(plain._e3_pair.target)
        keys_seen = [CostKey.for_contexts(plain._e3_pair.target, plain._e3_pair.head, 64)]
    for scale in (1.0, 0.5):
        with closing(Eagle3Llama(**setup, lora_path=str(lora), lora_scale=scale)) as llm:
            target = llm._e3_pair.target
            adapted = last_logits(target)
            assert not np.array_equal(adapted, without)  # the adapter changes what the target computes
            with _probe_context(target, ProbeCallback(), 64) as probe_ctx:
                assert np.array_equal(last_logits(probe_ctx), adapted)
            keys_seen.append(CostKey.for_contexts(target, llm._e3_pair.head, 64))
    assert len(set(keys_seen)) == 3


def test_the_v_cache_default_follows_where_attention_runs(tiny_target, tiny_head, monkeypatch):
    """With its layers on a GPU (pretended here: rpc.local_devices) Eagle3Llama keeps llama.cpp's f16 V, unless
    offload_kqv=False leaves the cache and attention on the CPU, where bf16 keeps them batch-invariant."""
    from eagle3_gguf import rpc
    monkeypatch.setattr(rpc, "local_devices", lambda: [1])
    kw = dict(n_ctx=256, n_batch=64, verbose=False, n_gpu_layers=-1, draft_policy="fixed", exact="off")
    for offload_kqv, v in ((True, "f16"), (False, "bf16")):
        with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, offload_kqv=offload_kqv,
                                 **kw)) as llm:
            assert llm.context_params.type_v == CACHE_TYPES[v], offload_kqv


def test_a_context_past_the_free_memory_is_refused_before_loading(tiny_target, tiny_head, monkeypatch):
    from eagle3_gguf import pair
    monkeypatch.setattr(pair, "free_memory", lambda: 2**21)
    with pytest.raises(Eagle3Error) as e:
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, n_ctx=4096, verbose=False)
    assert str(e.value) == ("a context of 4096 tokens needs 3.0 MiB for tiny-target.gguf's KV cache alone, more than "
                            "the 2.0 MiB this machine has free: lower -c (n_ctx)")


def test_exactness_defaults_and_warning_on_f16_cache(tiny_target, tiny_head):
    plain_kw = dict(n_ctx=512, n_batch=64, verbose=False)
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", **plain_kw)) as llm:
        assert llm.context_params.type_v == CACHE_TYPES["bf16"]
        assert llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    f16 = CACHE_TYPES["f16"]
    inexact = (r"^no verify batch of 2 or more rows is computed bit for bit as one-token decoding on this set-up "
               r"\(exactness probe: 1 of 1\.\.17, width 2 parts \((probed in [0-9.]+ s|cached); depths 8, 257\); "
               f"KV cache type_k={f16}, type_v={f16}; width 2 parts first at layer 0, node_[0-9]+: FLASH_ATTN_EXT over "
               r"a F16 K / F16 V cache of 512 cells, at depth 257\): speculating anyway")
    with pytest.warns(RuntimeWarning, match=inexact):
        with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head,
                                 **{**KW, "n_threads": 2, "type_v": f16})):
            pass
    with pytest.warns(RuntimeWarning, match=inexact):
        with closing(llama_cpp.Llama(model_path=str(tiny_target), **plain_kw, n_threads=2, flash_attn=True)) as llm:
            attach_eagle3(llm, tiny_head)
    with warnings.catch_warnings():  # strict: nothing to warn of (it decodes plainly), as with the defaults
        warnings.simplefilter("error")
        with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, exact="strict",
                                 **{**KW, "n_threads": 2, "type_v": f16})) as llm:
            assert llm("Once upon a time", max_tokens=8)["choices"][0]["text"]
            assert llm.spec_stats.exact.kept and llm.spec_stats.exact.rows_max == 1 and llm.spec_stats.n_drafted == 0


@pytest.mark.slow
def test_warns_without_flash_attention(smollm2_path):
    """Without flash attention SmolLM2 sums a batch row's attention in another order than a lone row's: the
    exactness probe finds width 2 inexact (as it finds every width exact with flash attention on) and says so."""
    from eagle3_gguf.assets import default_head_path

    kw = {**KW, "n_threads": 2, "flash_attn": False}
    with pytest.warns(RuntimeWarning, match=r"exactness probe: 1 of 1\.\.17, width 2 parts .*flash_attn=False"):
        with closing(Eagle3Llama(model_path=str(smollm2_path), draft_model_path=default_head_path(), **kw)) as llm:
            assert llm._e3_spec.exact.exact == 1
    with pytest.warns(RuntimeWarning, match="flash_attn=False"):
        with closing(llama_cpp.Llama(model_path=str(smollm2_path), **kw)) as llm:
            attach_eagle3(llm, default_head_path())


def test_bad_construction(tiny_target, tiny_head, smollm2_path):
    with pytest.raises(Eagle3Error, match="draft_model_path"):
        Eagle3Llama(model_path=str(tiny_target), **KW)
    with pytest.raises(Eagle3Error, match="cannot be combined"):
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head,
                    draft_model=LlamaPromptLookupDecoding(), **KW)
    with pytest.raises(Eagle3Error, match="draft_max"):
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", draft_max=-1, **KW)
    with pytest.raises(Eagle3Error, match="hidden size"):  # a head for the tiny target on SmolLM2
        Eagle3Llama(model_path=str(smollm2_path), draft_model_path=tiny_head, draft_policy="fixed", **KW)
    with pytest.raises(Eagle3Error, match="no such file"):
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head.with_name("missing.gguf"), **KW)
    with pytest.raises(Eagle3Error) as e:
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_config={"draft_max": 2}, **KW)
    assert str(e.value) == ("draft_config is a DraftConfig (eagle3_gguf.config), not a dict: DraftConfig(draft_max=..., "
                            "...), or give the knobs as arguments")
    with pytest.raises(Eagle3Error) as e:
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, rpc_servers=["127.0.0.1:1"], **KW)
    assert str(e.value) == "--rpc (rpc_servers) is one string, 'host:port,host:port', not a list"
    for kw, line in ((dict(type_v=999), "type_v=999 is no KV cache type llama.cpp takes (one of: 0 (f32), 1 (f16), 30 "
                                         "(bf16), 8 (q8_0), 2 (q4_0), 3 (q4_1), 20 (iq4_nl), 6 (q5_0), 7 (q5_1))"),
                     (dict(n_batch=-1), "n_batch must be at least 1 (got -1)"),
                     (dict(n_ubatch=-2), "n_ubatch must be 0 (as n_batch) or more (got -2)"),
                     (dict(n_ctx=-5), "n_ctx must be 0 (the model's training context) or more (got -5)")):
        with pytest.raises(Eagle3Error) as e:  # a segfault or an abort under plain Llama
            Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, **{**KW, **kw})
        assert str(e.value) == line
    tree = DraftConfig(draft_topk=2)
    chains = r"^Eagle3Llama drafts chains \(llama-cpp-python opens its context with one sequence"
    with pytest.raises(Eagle3Error, match=chains):
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_config=tree, **KW)
    llm = llama_cpp.Llama(model_path=str(tiny_target), **KW)
    try:
        with pytest.raises(Eagle3Error, match=chains):
            attach_eagle3(llm, tiny_head, draft_config=tree)
        ours = attach_eagle3(llm, tiny_head)
        with pytest.raises(Eagle3Error, match=chains):
            ours.draft_config = tree
        assert ours.draft_config.draft_topk == 1
    finally:
        llm.close()


def test_the_heads_offload_is_an_argument(tiny_target, tiny_head):
    """n_gpu_layers_draft places the head beside llama-cpp-python's n_gpu_layers for the target (default: as
    the target's), survives a pickle, and attach_eagle3 takes it too."""
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, n_gpu_layers=5,
                             n_gpu_layers_draft=1, **KW)) as llm:
        assert (llm._e3_pair.target_model.n_gpu_layers, llm._e3_pair.head_model.n_gpu_layers) == (5, 1)
        assert llm.__getstate__()["n_gpu_layers_draft"] == 1
        llm.create_completion("Hello", max_tokens=4)
        assert (llm.spec_stats.target_on, llm.spec_stats.head_on) == ("CPU", "CPU")
    with closing(llama_cpp.Llama(model_path=str(tiny_target), n_gpu_layers=-1, **KW)) as plain_llm:
        attached = attach_eagle3(plain_llm, tiny_head)  # (llama-cpp-python passes -1 on as INT32_MAX: all)
        assert attached._e3_pair.head_model.n_gpu_layers == plain_llm.model_params.n_gpu_layers > 1000
    with closing(llama_cpp.Llama(model_path=str(tiny_target), **KW)) as plain_llm:
        assert attach_eagle3(plain_llm, tiny_head, n_gpu_layers_draft=2)._e3_pair.head_model.n_gpu_layers == 2


# -- SmolLM2 ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_head(tmp_path_factory, smollm2_path):
    spec = HeadSpec(576, (2, 15, 27), n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, draft_vocab=2048)
    return write_random_head(tmp_path_factory.mktemp("smol") / "smol-head.gguf", spec, tokenizer_from=smollm2_path)


@pytest.mark.slow
def test_smollm2_chat_and_completion_identical(smollm2_path, smol_head):
    kw = dict(n_ctx=1024, n_batch=128, seed=0, verbose=False, **EXACT)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    with closing(llama_cpp.Llama(model_path=str(smollm2_path), **kw)) as plain, \
            closing(Eagle3Llama(model_path=str(smollm2_path), draft_model_path=smol_head, **kw)) as ours:
        same(plain.create_chat_completion(messages, max_tokens=48, **GREEDY),
             ours.create_chat_completion(messages, max_tokens=48, **GREEDY))
        assert chunks(plain.create_chat_completion(messages, max_tokens=24, stream=True, **GREEDY)) == \
            chunks(ours.create_chat_completion(messages, max_tokens=24, stream=True, **GREEDY))
        same(plain("The three primary colours are", max_tokens=32, seed=4, temperature=0.8),
             ours("The three primary colours are", max_tokens=32, seed=4, temperature=0.8))
        same_state(plain, ours)


def test_a_batch_narrower_than_the_probes_prefix_speculates(smollm2_path, monkeypatch, tmp_path):
    """n_batch 4 (a llama-cpp-python setting that works on plain Llama): the exactness probe decodes its 8-token
    prefix in batches of 4 ("batch of 8 tokens does not fit capacity 4" had refused every completion), and the text
    is plain Llama's, with drafts kept."""
    from eagle3_gguf.assets import default_head_path

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))  # probed here, not read from a cache
    kw = dict(n_ctx=512, n_batch=4, verbose=False, **EXACT)
    prompt = "Count from 1 to 20: 1, 2, 3, 4,"
    with closing(llama_cpp.Llama(model_path=str(smollm2_path), **kw)) as plain:
        expected = text_of(plain.create_completion(prompt, max_tokens=24, **GREEDY))
    with closing(Eagle3Llama(model_path=str(smollm2_path), draft_model_path=default_head_path(),
                             draft_policy="fixed", **kw)) as llm:
        assert text_of(llm.create_completion(prompt, max_tokens=24, **GREEDY)) == expected
        assert llm.spec_stats.n_accepted > 0


def test_what_llama_cpp_dies_on_is_an_error(tiny_target, tiny_head):
    """A grammar that does not parse (llama-cpp-python chains the NULL sampler: SIGSEGV at the first token) and a
    token id outside the vocabulary given to detokenize (std::out_of_range: SIGABRT) raise; the Eagle3Llama goes on."""
    from llama_cpp import LlamaGrammar

    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             **KW)) as llm:
        for text in ("root ::= (", 'a ::= "x"'):
            with pytest.raises(Eagle3Error) as e:
                llm.create_completion("Hi", max_tokens=4, grammar=LlamaGrammar.from_string(text, verbose=False))
            assert str(e.value) == "the grammar does not parse (llama.cpp's log says where; check its rules and its root)"
        for ids in ([10**9], [1, -1]):
            with pytest.raises(Eagle3Error) as e:
                llm.detokenize(ids)
            assert str(e.value) == f"token id {ids[-1]} is outside the vocabulary (0 to 49151)"
        assert llm.detokenize(llm.tokenize(b"Hello", add_bos=False)) == b"Hello"
        assert llm.detokenize(np.asarray(llm.tokenize(b"Hello", add_bos=False))) == b"Hello"  # as plain Llama takes
        assert text_of(llm.create_completion("Hi", max_tokens=4, grammar=LlamaGrammar.from_string(
            'root ::= "yes" | "no"', verbose=False))) in ("yes", "no")


def test_a_failed_decode_is_the_runtime_error_plain_llama_raises(plain, ours):
    """llama_decode's failures raise RuntimeError from plain Llama; ours too (an Eagle3Error as well), so code that
    catches them goes on catching them. Here a token-list prompt with an id outside the vocabulary (rc -1)."""
    from eagle3_gguf.context import decode_failure

    for llm in (plain, ours):
        with pytest.raises(RuntimeError) as e:
            llm.create_completion([1, 10**6], max_tokens=4, **GREEDY)
        if llm is ours:
            assert isinstance(e.value, Eagle3Error) and str(e.value) == decode_failure(-1)
    assert text_of(ours.create_completion("Hi", max_tokens=8, **GREEDY)) == \
        text_of(plain.create_completion("Hi", max_tokens=8, **GREEDY))  # both go on


def test_a_vocab_only_target_is_refused(tiny_target, tiny_head):
    """vocab_only=True loads no weights: llama.cpp aborts building the head's graph over it (GGML_ASSERT), so
    Eagle3Llama and attach_eagle3 refuse it in one line; plain Llama tokenizes with it as before."""
    from eagle3_gguf.llama import VOCAB_ONLY, attach_eagle3

    with pytest.raises(Eagle3Error) as e:
        Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, vocab_only=True, **KW)
    assert str(e.value) == VOCAB_ONLY
    with closing(llama_cpp.Llama(model_path=str(tiny_target), vocab_only=True, verbose=False)) as vocab:
        with pytest.raises(Eagle3Error) as e:
            attach_eagle3(vocab, tiny_head)
        assert str(e.value) == VOCAB_ONLY and vocab.tokenize(b"Hello")


def test_n_threads_minus_one_is_ggmls_default_as_on_plain_llama(tiny_target, tiny_head, monkeypatch, tmp_path):
    """llama-cpp-python hands n_threads=-1 on to llama.cpp (ggml's default count); the head and the exactness probe's
    contexts take it too, and the text is plain Llama's."""
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))  # the probe runs here, on contexts of -1 threads
    kw = {**KW, "n_threads": -1}
    with closing(llama_cpp.Llama(model_path=str(tiny_target), **kw)) as plain:
        expected = text_of(plain.create_completion(PROMPTS[0], max_tokens=16, **GREEDY))
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             **kw)) as llm:
        assert text_of(llm.create_completion(PROMPTS[0], max_tokens=16, **GREEDY)) == expected
        assert llm._e3_spec.session.draft_ctx.n_threads == -1 and llm.spec_stats.n_drafted > 0


@pytest.mark.slow
def test_a_state_loaded_at_a_padded_context_speculates_on(smollm2_path):
    """n_ctx 300 (llama.cpp pads it to 512): a plain Llama's saved state holds 300 input_ids, where a cycle keeps rows
    up to 512. Loaded into an Eagle3Llama, or into the Llama one is attached to, the next answer is plain Llama's
    from the same state, with drafts kept past row 300 (it raised numpy's ValueError on every call)."""
    from eagle3_gguf.assets import default_head_path

    prompt = "The quick brown fox jumps over the lazy dog. " * 26  # 261 tokens: the answer runs past row 300
    kw = dict(KW, n_ctx=300, n_batch=512)
    with closing(llama_cpp.Llama(model_path=str(smollm2_path), **kw)) as plain, \
            closing(Eagle3Llama(model_path=str(smollm2_path), draft_model_path=str(default_head_path()), **kw)) as ours, \
            closing(llama_cpp.Llama(model_path=str(smollm2_path), **kw)) as under:
        plain(prompt, max_tokens=1, **GREEDY)
        state = plain.save_state()
        assert len(state.input_ids) == 300
        want = plain(prompt, max_tokens=60, **GREEDY)
        assert want["usage"]["total_tokens"] > 300
        attached = attach_eagle3(under, default_head_path())
        for llm, loads in ((ours, ours), (attached, attached), (attached, under)):
            loads.load_state(state)
            got = llm(prompt, max_tokens=60, **GREEDY)
            assert text_of(got) == text_of(want) and got["usage"] == want["usage"]
            assert llm.spec_stats.n_accepted > 0


def test_a_closed_eagle3llama_refuses_every_call(tiny_target, tiny_head):
    """Plain Llama hands llama.cpp the freed model or context after close() (a segfault); an Eagle3Llama, or one
    attached to a Llama since closed, refuses in one line, and a closed Llama takes no head."""
    llm = Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", **KW)
    state = llm.save_state()
    llm.close()
    calls = [lambda x: x("Hi", max_tokens=4), lambda x: x.create_chat_completion(CHAT, max_tokens=4),
             lambda x: x.create_completion([1, 2], max_tokens=2), lambda x: x.tokenize(b"Hi"),
             lambda x: x.eval([1, 2]), lambda x: x.detokenize([1]), lambda x: x.n_ctx(), lambda x: x.n_embd(),
             lambda x: x.pooling_type(), lambda x: x.embed("Hi"), lambda x: x.save_state(),
             lambda x: x.load_state(state)]
    for call in calls:
        with pytest.raises(Eagle3Error, match="^this Eagle3Llama is closed$"):
            call(llm)
    plain = llama_cpp.Llama(model_path=str(tiny_target), **KW)
    attached = attach_eagle3(plain, tiny_head)
    plain.close()
    for call in calls:
        with pytest.raises(Eagle3Error, match="^this Eagle3Llama is closed$"):
            call(attached)
    fresh = llama_cpp.Llama(model_path=str(tiny_target), **KW)
    fresh.close()
    with pytest.raises(Eagle3Error, match="^this Llama is closed: attach the head to an open one$"):
        attach_eagle3(fresh, tiny_head)
