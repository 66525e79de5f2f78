"""The adaptive drafting policy on SmolLM2, end to end: it drafts K_max for a head that agrees with the
target, settles on plain decoding with a random one, and the text is the target's either way. Each test states
the costs (a frozen curve): measured and learnt ones move with the machine's load, and the choices with them."""

from __future__ import annotations

import pytest

from eagle3_gguf.assets import default_head_path
from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import chat_tokens
from model_factory import HeadSpec, write_random_head
from oracle import CPU_ROWS, GPU_ROWS, OracleSession, stated_costs

pytestmark = pytest.mark.slow

PROMPT = "List the first twenty prime numbers, one per line, with a short note on each."


@pytest.fixture(scope="module")
def random_head(tmp_path_factory, smollm2_path):
    spec = HeadSpec(576, (2, 15, 27), n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, draft_vocab=2048)
    return write_random_head(tmp_path_factory.mktemp("smol") / "random-head.gguf", spec, tokenizer_from=smollm2_path)


@pytest.mark.parametrize("k, costs", [(4, "gpu-like")])
def test_agreeing_head_drafts_k_max(smollm2_path, k, costs):
    """With verify costs like a GPU's (five rows cost about one; stated and frozen: on 2 busy cores the
    measured and learnt costs move, and with them the best length) an agreeing head gets K = 4 drafts nearly
    every cycle."""
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=1024, n_threads=2)) as pair:
        prompt = chat_tokens(pair.target_model, PROMPT)
        # the head's drafts only (lookup drafts would take their own lengths, from a curve beyond K)
        config = GenerateConfig(n_predict=200, draft_max=k, draft_policy="adaptive", draft_lookup=False)
        with Runner(pair.target) as plain:
            base = plain.generate(prompt, config, speculative=False)
        # long enough for the figures below; the target may end it at EOS before n_predict (191 tokens on a
        # 2-core AMD EPYC host, 200 on others: the CPU's kernels decide near-ties)
        assert len(base.tokens) >= 150
        with OracleSession(pair.target, pair.head, truth=prompt + base.tokens, schedule=[k], confident=True) as s, \
                Runner(pair.target, s) as d:
            if costs == "gpu-like":
                d.spec.costs = stated_costs(GPU_ROWS, 0.02, 0.05)
            spec = d.generate(prompt, config)
    assert spec.tokens == base.tokens
    pol = spec.stats.policy
    assert pol.name == "adaptive" and pol.cost_source == ("given" if costs == "gpu-like" else "measured")
    full = [n for n in pol.trace if n == k]
    assert len(full) >= 0.9 * len(pol.trace), pol.trace
    assert spec.stats.n_accepted >= 0.9 * spec.stats.n_drafted and spec.stats.tau > 0.9 * (k + 1)


def test_random_head_settles_on_plain_decoding(smollm2_path, random_head):
    with load_pair(smollm2_path, random_head, PairConfig(n_ctx=1024, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = chat_tokens(pair.target_model, PROMPT)
        # the head's drafts only (a lookup draft of the text's repeats is tried now and then)
        config = GenerateConfig(n_predict=160, draft_max=4, draft_policy="adaptive", draft_lookup=False)
        base = d.generate(prompt, config, speculative=False)
        d.spec.costs = stated_costs(CPU_ROWS, 0.13, 0.04)  # 2 CPU cores'
        spec = d.generate(prompt, config)
    assert spec.tokens == base.tokens
    pol = spec.stats.policy
    assert pol.cost_source == "given" and len(pol.trace) >= 150
    assert max(pol.trace[20:]) == 0, pol.trace  # nothing verified after 20 cycles
    # no draft step but the probes, the first cycle one of them: at these costs the head's prior (half its
    # drafts kept) pays for no draft
    assert pol.plain_cycles == len(pol.trace) - pol.probes, pol.trace
    assert pol.probes <= 6  # probes back off: cycles 1, 9, 25, 57, 121 within 160


class CountingSession(Eagle3Session):
    """Counts the one-row keep() calls: a cycle's row set aside for the head."""

    kept_one = 0

    def keep(self, tokens, pos0, feats=None, trim=True):
        self.kept_one += len(tokens) == 1
        super().keep(tokens, pos0, feats, trim)


def test_plain_cycles_keep_rows_only_within_the_sessions_window(smollm2_path, random_head):
    """While the policy decodes plainly, a cycle's row is set aside only when a probe is at most the session's
    catch-up window away: a shorter window copies fewer rows."""
    kept = {}
    for window in (3, 8):
        with load_pair(smollm2_path, random_head, PairConfig(n_ctx=1024, n_threads=2)) as pair, \
                CountingSession(pair.target, pair.head, window=window) as s, Runner(pair.target, s) as d:
            prompt = chat_tokens(pair.target_model, PROMPT)
            d.spec.costs = stated_costs(CPU_ROWS, 0.13, 0.04)
            pol = d.generate(prompt, GenerateConfig(n_predict=160, draft_max=4, draft_lookup=False)).stats.policy
        assert pol.cost_source == "given" and max(pol.trace[20:]) == 0, pol.trace
        assert s.kept_one <= (window + 1) * (pol.probes + 1), (window, s.kept_one, pol.probes)
        kept[window] = s.kept_one
    assert kept[3] < kept[8], kept
