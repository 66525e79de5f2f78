"""chain.c: a draft's steps in one C call, against Eagle3Session.draft's Python loop on the same head state."""

from __future__ import annotations

import copy
import ctypes

import pytest
from llama_cpp import llama_cpp as C

from eagle3_gguf import chain
from eagle3_gguf.batch import Batch
from eagle3_gguf.draft import NativeJudge
from eagle3_gguf.errors import DecodeError, Eagle3Error
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.acceptance import N_BINS
from eagle3_gguf.costs import CostCurve
from eagle3_gguf.policy import AdaptivePolicy, FixedPolicy
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import tokenize

pytestmark = pytest.mark.skipif(not chain.available(), reason="chain.c needs a C compiler here")

PROMPT = "Once upon a time, in a small village, there lived an old clockmaker who"


def adaptive(k_max: int) -> AdaptivePolicy:
    """The adaptive policy on cheap rows (a GPU's shape of curve), its tables saying a draft is kept about as often as
    its confidence says, a little less further on."""
    rows = [1.0 + 0.1 * n + 0.025 * n * (n - 1) for n in range(max(k_max, 8) + 1)]  # 1.0 1.1 1.25 1.45 1.7 ...
    policy = AdaptivePolicy(CostCurve([3e-3 * x for x in rows], 0.3e-3, 0.2e-3, "given", frozen=True), k_max)
    acc = policy.acc
    for i in range(k_max):
        for b in range(N_BINS):
            acc.hits[i * N_BINS + b] = 100.0 * (b + 0.5) / N_BINS * (1.0 - 0.03 * i)
            acc.seen[i * N_BINS + b] = 100.0
    return policy


@pytest.fixture(scope="module")
def pairs(tiny_target, tiny_head, tiny_head_d2t):
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512, n_batch=64)) as a, \
            load_pair(tiny_target, tiny_head_d2t, PairConfig(n_ctx=512, n_batch=64)) as b:
        yield {"tiny_head": a, "tiny_head_d2t": b}


def feed_prompt(pair, s: Eagle3Session, b: Batch) -> None:
    """The head and target fresh, the prompt decoded and fed to the head."""
    prompt = tokenize(pair.target_model, PROMPT)
    s.reset()
    pair.target.clear()
    b.set(prompt, 0, logits="last")
    pair.target.decode(b)
    s.process(prompt, 0)


def drafts_both_ways(pair, k: int, n_max: int, n_alt: int, policies: list, seen: list[float] | None = None):
    """The same draft (after the same prompt and a warm-up draft) by the Python loop, then by chain.c, each judged by
    its own policy: the two (draft, the next draft after it) pairs."""
    with Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        assert s.choose_in_graph(k)
        feed_prompt(pair, s, b)
        s.draft(17, 1)  # the prompt's pairs go with this seed; each draft below seeds alone, from the same cache
        s.accept(0)
        out = []
        s.judge_sees = seen  # a stand-in head's confidences, as a replay reports them
        for policy, native in zip(policies, (False, True)):
            judge = policy.judge if seen is None else (lambda confs, n, j=policy.judge: j(seen[:len(confs)], n))
            d = s.draft(17, n_max, judge, n_alt=n_alt, native=policy.native_judge if native else None)
            s.accept(0)  # back to the cache before the draft: the seed's pair, nothing after it
            nxt = s.draft(17, 2)
            s.accept(0)
            out.append((d, nxt))
        return out


@pytest.mark.parametrize("head", ["tiny_head", "tiny_head_d2t"])
@pytest.mark.parametrize("k, n_alt", [(1, 0), (4, 3)])
def test_a_fixed_policys_draft_in_one_call_is_the_python_loops(pairs, head, k, n_alt):
    """judge_p_min's rule (p_min 0: every step; 0.5: the random head stops early): the same tokens, top
    probabilities and runner-ups (likeliest first), and the head's cache after."""
    for p_min in (0.0, 0.5):
        policies = [FixedPolicy(5, p_min), FixedPolicy(5, p_min)]
        (py, py_next), (c, c_next) = drafts_both_ways(pairs[head], k, 5, n_alt, policies)
        assert (c.tokens, c.confs, c.alt_tokens, c.alt_probs) == (py.tokens, py.confs, py.alt_tokens, py.alt_probs)
        assert (c_next.tokens, c_next.confs) == (py_next.tokens, py_next.confs)
        assert len(c.alt_tokens) == (len(c.confs) if n_alt else 0)
        assert all(sorted(alts, reverse=True) == alts and alts[0] <= conf for alts, conf in zip(c.alt_probs, c.confs))
        if p_min == 0.0:
            assert len(c.tokens) == len(c.confs) == 5
        else:  # stopped at the first step under p_min, its draft cut
            assert len(c.tokens) == len(c.confs) - 1 and c.confs[-1] < p_min <= min(c.confs[:-1], default=1.0)


@pytest.mark.parametrize("head, k_max", [("tiny_head", 6), ("tiny_head_d2t", 6), ("tiny_head", 80)])
@pytest.mark.parametrize("seen", [None, [0.97, 0.95, 0.93, 0.2, 0.9, 0.9], [0.97] * 6],
                         ids=["head's", "a stop at 4", "all high"])
def test_the_adaptive_policys_draft_in_one_call_is_the_python_loops(pairs, head, k_max, seen):
    """AdaptivePolicy.judge's rule, on the head's confidences or on ones a replay makes it see: the same draft and
    runner-ups, and the policy after it the same (its expected acceptances moved alike at every position, however
    many it has, its prediction alike)."""
    a = adaptive(k_max)
    b = copy.deepcopy(a)
    (py, py_next), (c, c_next) = drafts_both_ways(pairs[head], 4, 6, 3, [a, b], seen)
    assert (c.tokens, c.confs, c.alt_tokens, c.alt_probs) == (py.tokens, py.confs, py.alt_tokens, py.alt_probs)
    assert (c_next.tokens, c_next.confs) == (py_next.tokens, py_next.confs)
    assert list(b.acc.lookahead) == list(a.acc.lookahead) and len(set(a.acc.lookahead)) > 1
    assert b._pred == a._pred and b._star_now is None
    if seen is not None:  # the replayed confidences decide: on while they stay high, cut where one falls
        assert len(c.confs) == (4 if seen[3] < 0.5 else 6)
        assert len(c.tokens) == (3 if seen[3] < 0.5 else 6)


def test_a_draft_in_one_call_times_its_steps_and_its_graphs(pairs):
    """t_steps (the steps after the first) and the head context's native time grow as in the Python loop; a draft's
    settings chain.c cannot take are refused before the head's state is touched."""
    pair = pairs["tiny_head"]
    with Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        assert s.choose_in_graph(2)
        feed_prompt(pair, s, b)
        native0, steps0 = s.draft_ctx.t_native, s.t_steps
        d = s.draft(17, 4, native=NativeJudge)
        assert len(d.tokens) == 4 and s.t_steps > steps0 and s.draft_ctx.t_native > native0
        s.accept(0)
        pos = s.pending_pos
        with pytest.raises(Eagle3Error, match="2 runner-ups a step from a graph that chooses 2 tokens"):
            s.draft(17, 4, n_alt=2, native=NativeJudge)
        assert s.pending_pos == pos


def test_a_draft_chain_c_refuses_leaves_the_head_as_it_was(pairs):
    """Settings chain.c cannot judge (a draft longer than the adaptive policy's positions, too few or improbable
    confidences to see) are refused before the seed takes the rows set aside: the next draft is the one it would have
    been. Confidences changed in place between drafts are seen."""
    pair = pairs["tiny_head"]
    with Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        assert s.choose_in_graph(4)
        feed_prompt(pair, s, b)
        want = s.draft(17, 3, native=NativeJudge)
        feed_prompt(pair, s, b)
        policy = adaptive(3)
        with pytest.raises(Eagle3Error, match="a draft of up to 5 judged over 3 positions"):
            s.draft(17, 5, policy.judge, native=policy.native_judge)
        for seen in ([0.9, 0.9], [0.9, 0.9, float("nan")], [0.9, 1.5, 0.9]):
            s.judge_sees = seen
            with pytest.raises(Eagle3Error, match="the judge is to see"):
                s.draft(17, 3, native=NativeJudge)
        s.judge_sees = None
        got = s.draft(17, 3, native=NativeJudge)
        assert (got.tokens, got.confs) == (want.tokens, want.confs)
        s.accept(0)
        s.judge_sees = seen = [0.9, 0.9, 0.9]
        assert len(s.draft(17, 3, native=lambda: NativeJudge(p_min=0.5)).tokens) == 3
        s.accept(0)
        seen[1] = 0.1  # in place: the judge sees it
        assert len(s.draft(17, 3, native=lambda: NativeJudge(p_min=0.5)).tokens) == 1


def seeded_from_rows_aside(pair, native: bool, deferred: bool, n_rows: int = 3):
    """A draft seeded from rows set aside (every cycle's case), by the Python loop or in one C call with its seed, from
    the same fresh state: the draft, the session's seed state after it and the next draft, after rows set aside again.
    deferred: the prompt's pairs flushed first, so the deferred pair leads the seed's batch (o = 1)."""
    policy = FixedPolicy(4, 0.0)
    judge = policy.native_judge if native else None
    with Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        assert s.choose_in_graph(4)
        feed_prompt(pair, s, b)
        pos = pair.target.pos_max() + 1
        if deferred:
            s.flush()
        else:
            s.draft(17, 1)  # the prompt's pairs go with this seed
            s.accept(0)
        out = []
        for _ in range(2):
            rows = [23, 29, 31, 37][:n_rows]
            b.set(rows, pos, logits="all")
            pair.target.decode(b)
            s.keep(rows, pos)
            steps0 = s.draft_ctx.t_native
            d = s.draft(41, 4, policy.judge, n_alt=2, native=judge)
            assert s.draft_ctx.t_native > steps0
            out.append((d.tokens, d.confs, d.alt_tokens, d.alt_probs, s.pending_pos, s.pending_g.tolist(),
                        s.draft_ctx.pos_max(), len(s.aside)))
            s.accept(len(d.tokens))
            pos += n_rows
            deferred = False
        return out


@pytest.mark.parametrize("head", ["tiny_head", "tiny_head_d2t"])
@pytest.mark.parametrize("deferred", [False, True], ids=["o=0", "o=1"])
def test_a_draft_seeded_in_c_from_rows_aside_is_the_python_seeds(pairs, head, deferred):
    """chain.c's seed (the encoder on the rows set aside, their g into the decoder batch, the cache cut) then its
    steps: the same drafts, seed state (pending_g, pending_pos), head cache and rows aside as _seed_aside's, twice."""
    py = seeded_from_rows_aside(pairs[head], native=False, deferred=deferred)
    c = seeded_from_rows_aside(pairs[head], native=True, deferred=deferred)
    assert c == py
    assert all(len(d[0]) == 4 and d[7] == 0 for d in c)  # four drafts each time, nothing left aside


def test_a_seed_in_c_that_fails_moves_the_session_as_the_python_seed(pairs, monkeypatch):
    """A decode failing after chain.c made the seed's batch: the same DecodeError, and the session's seed state moved as
    _seed_aside moves it before its decode (the rows aside gone into the seed)."""
    pair = pairs["tiny_head"]
    with Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        assert s.choose_in_graph(1)
        feed_prompt(pair, s, b)
        s.draft(17, 1)
        s.accept(0)
        pos = pair.target.pos_max() + 1
        b.set([23, 29], pos, logits="all")
        pair.target.decode(b)
        s.keep([23, 29], pos)
        p0 = s.aside.pos0
        bad = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, C.llama_batch)(lambda ctx, batch: 1)  # "KV cache full"
        monkeypatch.setattr(s._chain._api, "decode", ctypes.cast(bad, ctypes.c_void_p).value)
        with pytest.raises(DecodeError):
            s.draft(41, 4, native=NativeJudge)
        assert len(s.aside) == 0 and s.pending_pos == p0 + 1 and not s._open
        assert s.draft_ctx.pos_max() == p0 - 1  # cut after the seed's position, as _seed_aside cuts it
