"""Lookup drafts (lookup.py): the n-gram index, the policy's choice over it, and real runs that copy."""

from __future__ import annotations

import dataclasses
import random
from contextlib import closing

import pytest

from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.lookup import N_MAX, N_MIN, LookupIndex
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.costs import CostCurve
from eagle3_gguf.policy import AdaptivePolicy
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import tokenize
from oracle import CPU_ROWS, stated_costs


def proposal(tokens: list[int], k: int) -> tuple[list[int], int] | None:
    """By definition: the longest n (N_MAX..N_MIN) whose last n-gram occurred earlier, with the tokens that
    followed its latest earlier occurrence."""
    for n in range(N_MAX, N_MIN - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - 2, n - 2, -1):  # i: the end of an earlier occurrence
            if tokens[i - n + 1:i + 1] == tail:
                return tokens[i + 1:i + 1 + k], n
    return None


def as_pair(found):
    return None if found is None else (found.tokens, found.n)


def test_index_proposes_the_latest_longest_match():
    idx = LookupIndex()
    idx.extend([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 3, 5, 6, 7])
    assert as_pair(idx.propose(4)) == ([8, 3, 5, 6], 3)  # "5 6 7" last ended at 9 (then "8 3 ...")
    assert as_pair(idx.propose(1)) == ([8], 3)
    idx.extend([8])
    assert as_pair(idx.propose(3)) == ([3, 5, 6], 4)


def test_text_with_nothing_repeated_proposes_nothing():
    idx = LookupIndex()
    for t in range(200):
        idx.extend([t])
        assert idx.propose(4) is None


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_cut_and_grown_again_is_the_definition(seed):
    """Grown a few tokens at a time, cut back (a rejection never reaches it; a new prompt sharing a prefix
    does), grown again: at every step it proposes what the definition does."""
    rnd = random.Random(seed)
    idx, seq = LookupIndex(), []
    for _ in range(300):
        if seq and rnd.random() < 0.1:
            n = rnd.randrange(len(seq))
            del seq[n:]
            idx.truncate(n)
        else:
            new = [rnd.randrange(6) for _ in range(rnd.randint(1, 4))]
            seq += new
            idx.extend(new)
        assert idx.tokens == seq
        k = rnd.randint(1, 6)
        assert as_pair(idx.propose(k)) == proposal(seq, k)


def policy(curve: list[float], k_max: int = 4) -> AdaptivePolicy:
    return AdaptivePolicy(CostCurve([0.01 * c for c in curve], 0.002, 0.002, "given"), k_max, lookup_max=4)


DEAR = [1.0, 2.0, 2.5, 3.0, 3.6]  # verify rows on 2 CPU cores (SmolLM2 Q4_1, calibrated)
CHEAP = [1.0, 1.02, 1.04, 1.06, 1.08]  # a GPU's


def test_policy_weighs_a_lookup_by_match_and_cost():
    """Where rows are dear a short match is never verified and a long one is, whole; on a GPU the short one is too; a
    long match that keeps failing stops being verified."""
    from eagle3_gguf.lookup import Lookup

    dear, cheap = policy(DEAR), policy(CHEAP)
    assert dear.lookup(Lookup([1, 2, 3, 4], 2), 4) == 0
    assert dear.lookup(Lookup([1, 2, 3, 4], 5), 4) == 4
    assert cheap.lookup(Lookup([1, 2, 3, 4], 2), 4) >= 2
    assert dear.lookup(Lookup([1, 2, 3, 4], 5), 2) == 2  # the cap holds
    for _ in range(10):
        dear.observe_lookup(5, 4, 0, 0.02, 1)
    assert dear.lookup(Lookup([1, 2, 3, 4], 5), 4) == 0
    assert dear.stats.chosen[4] == 10  # each verified 4 lookup drafts
    one = policy(CHEAP, k_max=1)  # the head drafts one token at most; a lookup draft is capped by lookup_max
    assert one.lookup(Lookup([1, 2, 3, 4, 5], 5), 8) == 4 and one.plan(8) <= 1


def test_a_long_match_declined_again_and_again_is_probed():
    """Nothing is learnt of matches never verified: one miss at a long match's first position could price every later
    match of a text under dear rows (the README demo ran at 0.95x in place of 1.1-1.2x). The LOOKUP_PROBE_MIN-th long
    match declined in a row is verified anyway, the gap doubling while such probes miss and reset once one is kept
    whole; a verified match restarts the count; short matches are never probed."""
    from eagle3_gguf.lookup import Lookup
    from eagle3_gguf.policy import LOOKUP_PROBE_MIN

    dear = policy(DEAR)
    for _ in range(3):
        dear.observe_lookup(5, 4, 0, 0.02, 1)  # missed at the first position
    long, short = Lookup([1, 2, 3, 4], 5), Lookup([1, 2, 3, 4], 2)
    assert not any(dear.lookup(short, 4) for _ in range(3 * LOOKUP_PROBE_MIN))
    got = [dear.lookup(long, 4) for _ in range(LOOKUP_PROBE_MIN)]
    assert not any(got[:-1]) and got[-1] >= 1 and dear.stats.lookup_probes == 1
    dear.observe_lookup(5, got[-1], 0, 0.02, 1)  # the probe missed: twice as many declines to the next
    got = [dear.lookup(long, 4) for _ in range(2 * LOOKUP_PROBE_MIN)]
    assert not any(got[:-1]) and got[-1] >= 1 and dear.stats.lookup_probes == 2
    dear.observe_lookup(5, got[-1], got[-1], 0.02, got[-1] + 1)  # kept whole: back to the shortest gap
    assert dear.lookup_gap == LOOKUP_PROBE_MIN and not dear.lookup_probing
    cheap = policy(CHEAP)  # a match that pays is verified: no probe, and the count starts again
    assert all(cheap.lookup(long, 4) for _ in range(2 * LOOKUP_PROBE_MIN)) and cheap.stats.lookup_probes == 0
    assert cheap.lookup_wait == LOOKUP_PROBE_MIN


REPEATED = ("def area(width, height):\n    return width * height\n\n"
            "def area(width, height):\n    return width * height\n\n"
            "def area(width, height):\n    return width * height\n\n")


@pytest.mark.slow
def test_text_that_repeats_is_drafted_from_the_lookup(smollm2_path):
    """SmolLM2 continues a text that repeats itself by repeating it: the cycles take lookup drafts and keep
    long runs of them (from the statistics), the output is target-only's, and with lookup off it is too. The
    costs are 2 CPU cores', stated: on a busy machine measured ones move, and the lengths chosen with them."""
    from eagle3_gguf.assets import default_head_path

    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=1024, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, REPEATED)
        config = GenerateConfig(n_predict=96, draft_max=4, draft_lookup_max=4)
        base = d.generate(prompt, config, speculative=False)
        d.spec.costs = stated_costs(CPU_ROWS, 0.13, 0.04)  # up to 17 verify rows: every run below
        on = d.generate(prompt, config)
        off = d.generate(prompt, dataclasses.replace(config, draft_lookup=False))
        long = d.generate(prompt, dataclasses.replace(config, draft_lookup_max=16))
    assert on.tokens == base.tokens == off.tokens == long.tokens
    st = on.stats
    assert st.policy.cost_source == long.stats.policy.cost_source == "given"
    assert st.lookup_cycles >= 10 and st.lookup_accepted >= 3 * st.lookup_cycles
    assert st.lookup_accepted <= st.n_accepted and st.lookup_drafted <= st.n_drafted
    assert st.n_accepted + st.n_target_forwards == st.n_generated
    assert off.stats.lookup_cycles == 0
    # lookup drafts past the head's K=4: longer runs kept per cycle, fewer target forwards
    lt = long.stats
    assert lt.lookup_accepted > 4 * lt.lookup_cycles > 0 and sum(lt.accept_hist[5:]) > 0
    assert lt.n_target_forwards < st.n_target_forwards


def test_the_dropin_index_follows_its_caches(tiny_target, tiny_head):
    """Across Eagle3Llama calls that share a prefix, stop early and stream, the index holds exactly the
    tokens the caches hold, and proposes what an index built afresh from them proposes."""
    from eagle3_gguf.llama import Eagle3Llama
    from eagle3_gguf.native import CACHE_TYPES

    kw = dict(n_ctx=512, n_batch=64, seed=1, verbose=False, flash_attn=True, type_v=CACHE_TYPES["bf16"])
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, **kw)) as llm:
        for prompt, n in [("The cat sat on the mat. The cat sat on", 30), ("The cat sat on the mat. A dog", 12),
                          ("The cat sat on the mat. The cat sat on", 5)]:
            llm(prompt, max_tokens=n, temperature=0.0)
            index, held = llm._e3_spec.index, llm.input_ids[:llm.n_tokens].tolist()
            assert index.tokens[:len(held)] == held
            fresh = LookupIndex()
            fresh.extend(index.tokens)
            assert as_pair(index.propose(4)) == as_pair(fresh.propose(4))


def test_a_new_text_gives_lookup_drafts_another_chance():
    """A policy that stopped verifying lookups learns nothing more of them: without forgetting, one text's misses
    kept a long-lived policy (serve, the drop-in, bench) off lookups for every later text. Each new text keeps half of
    what earlier ones taught, so a long match is verified again a few texts on."""
    from eagle3_gguf.lookup import PRIOR_BY_N, Lookup, LookupAcceptance
    from oracle import CPU_ROWS, stated_costs

    acc = LookupAcceptance(4)
    for _ in range(30):
        acc.observe(N_MAX, 4, 0)  # every long match missed at its first token
    missed = acc.prob(N_MAX, 0)
    acc.forget()
    assert missed < acc.prob(N_MAX, 0) < PRIOR_BY_N[-1]
    policy = AdaptivePolicy(stated_costs(CPU_ROWS, 0.13, 0.04), 4, lookup_max=8)
    found = Lookup(list(range(8)), N_MAX)  # a long copy in progress
    assert policy.lookup(found, 8) > 0  # the prior: a long match is tried where rows are dear
    for _ in range(30):
        policy.observe_lookup(N_MAX, 8, 0, 0.01, 1)
    assert policy.lookup(found, 8) == 0
    texts = 0
    while policy.lookup(found, 8) == 0 and texts < 10:
        policy.begin()
        texts += 1
    assert 1 < texts < 10, texts
