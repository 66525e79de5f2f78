"""Eagle3Session + the verify loop: lossless output, the draft KV after accept(n), statistics."""

from __future__ import annotations

import time

import numpy as np
import pytest

from eagle3_gguf.batch import Batch
from eagle3_gguf.decode import GenerateConfig, Runner, Sampler
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.session import Eagle3Session, RowsAside
from eagle3_gguf.tokens import Message, apply_chat_template, tokenize
from oracle import OracleSession

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


def check_stats_add_up(st, n_tokens: int) -> None:
    assert st.n_accepted + st.n_target_forwards == st.n_generated
    assert st.n_generated == n_tokens + (1 if st.stop_reason == "eos" else 0)
    assert sum(st.accept_hist) == st.n_target_forwards - 1
    assert sum(st.accepted_by_pos) == st.n_accepted and sum(st.drafted_by_pos) == st.n_drafted
    # a cycle decodes id_last and the drafts it verifies (chains: no tree nodes, no kept branch redone)
    assert sum(st.verify_rows) == st.n_target_forwards - 1 and st.tree_cycles == 0
    assert sum((n - 1) * c for n, c in enumerate(st.verify_rows)) == st.n_drafted
    # a draft is reached where the drafts before it were all kept: every kept one was, and the first ones all are
    assert all(a <= r <= d for a, r, d in zip(st.accepted_by_pos, st.reached_by_pos, st.drafted_by_pos))
    assert not st.reached_by_pos or st.reached_by_pos[0] == st.drafted_by_pos[0]


def test_conditional_acceptance_counts_only_drafts_whose_earlier_drafts_were_kept():
    """Cycles of different lengths (as the adaptive policy drafts): 4 drafts with the first rejected, 2 drafts both
    kept, 3 drafts with 2 kept. Draft 2 was reached once (the third cycle's) and rejected; a cut cycle (the caller
    stopped reading) counts as the cycle that kept what was read."""
    from eagle3_gguf.stats import SpecStats

    st = SpecStats(draft_max=4)
    st.record_cycle(4, 0)
    st.record_cycle(2, 2)
    st.record_cycle(3, 2)
    assert st.drafted_by_pos == [3, 3, 2, 1] and st.accepted_by_pos == [2, 2, 0, 0]
    assert st.reached_by_pos == [3, 2, 1, 0]  # P(draft 1 kept | draft 0 kept) = 2/2, not 2/3
    st.cut_cycle(2, 0)  # the third cycle's output was read up to its first token
    assert st.accepted_by_pos == [1, 1, 0, 0] and st.reached_by_pos == [3, 1, 0, 0]


@pytest.fixture(scope="module")
def tiny_pair(tiny_target, tiny_head):
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512, n_batch=64)) as pair:
        yield pair


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_greedy_equals_target_only_tiny(tiny_pair, k, policy):
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s, Runner(tiny_pair.target, s) as d:
        for text in PROMPTS:
            prompt = tokenize(tiny_pair.target_model, text)
            cfg = GenerateConfig(n_predict=40, draft_max=k, draft_policy=policy)
            base = d.generate(prompt, cfg, speculative=False)
            spec = d.generate(prompt, cfg, speculative=True)
            assert spec.tokens == base.tokens
            if policy == "fixed":
                assert spec.stats.n_drafted > 0
            check_stats_add_up(spec.stats, len(spec.tokens))


def test_a_plain_run_extracts_nothing_and_the_next_speculative_run_does(smollm2_path):
    """Target-only decodes without the head's layer inputs, as llama.cpp alone would (over RPC each one is
    fetched over the network); the next speculative run extracts them again (llama.cpp must reserve its
    graph anew, or the features go stale and nothing is accepted) and drafts exactly as before."""
    from eagle3_gguf.assets import default_head_path

    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, apply_chat_template(pair.target_model, [Message("user", "Explain how a bicycle works.")]),
                          add_special=False)
        cfg = GenerateConfig(n_predict=64, draft_max=4, draft_policy="fixed")
        first = d.generate(prompt, cfg)
        base = d.generate(prompt, cfg, speculative=False)
        lid = min(s.layers)
        assert not s.extract.enabled
        with pytest.raises(Eagle3Error, match="was not extracted"):
            pair.target.layer_inp(lid, 1)
        again = d.generate(prompt, cfg)
        assert s.extract.enabled and again.tokens == first.tokens == base.tokens
        assert again.stats.accepted_by_pos == first.stats.accepted_by_pos and again.stats.n_accepted >= 10, again.stats.n_accepted


def test_a_session_extracts_after_another_on_the_target_turned_extraction_off(tiny_pair):
    """Two sessions on one target (a benchmark's contenders, each with its own head session): a plain run
    through the first turns the target's extraction off, and the second's next speculative run turns it on again
    (each session once kept its own idea of the state, and the second's run found no layer inputs)."""
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as a, Eagle3Session(tiny_pair.target, tiny_pair.head) as b, \
            Runner(tiny_pair.target, a) as plain, Runner(tiny_pair.target, b) as spec:
        prompt = tokenize(tiny_pair.target_model, PROMPTS[0])
        cfg = GenerateConfig(n_predict=32, draft_max=4, draft_policy="fixed")
        first = spec.generate(prompt, cfg)
        base = plain.generate(prompt, cfg, speculative=False)
        assert not a.extract.enabled and not b.extract.enabled
        again = spec.generate(prompt, cfg)
        assert b.extract.enabled and again.tokens == first.tokens == base.tokens and again.stats.n_drafted > 0


def test_forced_acceptance_every_length(tiny_pair):
    k = 4
    with Runner(tiny_pair.target) as plain:
        prompt = tokenize(tiny_pair.target_model, PROMPTS[1])
        base = plain.generate(prompt, GenerateConfig(n_predict=60, draft_max=0), speculative=False)
    full = prompt + base.tokens
    with OracleSession(tiny_pair.target, tiny_pair.head, truth=full, schedule=[0, 1, 2, 3, 4, 4, 2]) as s, \
            Runner(tiny_pair.target, s) as d:
        spec = d.generate(prompt, GenerateConfig(n_predict=60, draft_max=k, draft_policy="fixed"))
    assert spec.tokens == base.tokens
    st = spec.stats
    assert all(st.accept_hist[n] > 0 for n in range(k + 1)), st.accept_hist
    assert st.tau > 1.5
    check_stats_add_up(st, len(spec.tokens))


def hot(seed: int) -> Sampler:
    """A sampler that really samples on the tiny random model, whose logits are very peaked."""
    return Sampler(1.5, seed=seed, top_k=0, top_p=1.0, min_p=0.0)


def test_sampling_is_lossless_with_the_same_seed(tiny_pair):
    prompt = tokenize(tiny_pair.target_model, PROMPTS[2])
    with Runner(tiny_pair.target) as plain:
        base = plain.generate(prompt, GenerateConfig(n_predict=40), hot(7), speculative=False)
        other = plain.generate(prompt, GenerateConfig(n_predict=40), hot(8), speculative=False)
    assert base.tokens != other.tokens  # the seed matters, so the equality below means something
    full = prompt + base.tokens
    with OracleSession(tiny_pair.target, tiny_pair.head, truth=full, schedule=[3, 0, 2]) as s, \
            Runner(tiny_pair.target, s) as d:
        spec = d.generate(prompt, GenerateConfig(n_predict=40, draft_max=3, draft_policy="fixed"), hot(7))
    assert spec.tokens == base.tokens
    assert spec.stats.n_accepted > 0


def _fresh_draft(pair, session, tokens: list[int], id_last: int, k: int):
    """What a fresh run gives: prefill `tokens` in one batch, process them, draft after id_last."""
    from eagle3_gguf.batch import Batch

    pair.target.clear()
    session.reset()
    with Batch(len(tokens)) as b:
        b.set(tokens, 0, logits="last")
        pair.target.decode(b)
    session.process(tokens, 0)
    drafted = session.draft(id_last, k).tokens
    return drafted, session.draft_ctx.logits_ith(0).copy(), session.draft_ctx.pos_max()


@pytest.mark.parametrize("n_acc", [0, 1, 2, 3, 4])
def test_accept_leaves_draft_kv_as_a_fresh_run(tiny_pair, n_acc):
    """After draft → verify → accept(n) → process(kept rows), drafting again gives what a fresh
    session that saw the same accepted tokens gives."""
    from eagle3_gguf.batch import Batch

    k = 4
    model = tiny_pair.target_model
    seq = tokenize(model, "A long sentence that we will use as the ground truth for this test, word by word.")
    p = 6  # prompt length; seq[p] is id_last
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s:
        # session A: prompt, one draft, a verify batch whose first n_acc drafts are "right"
        tiny_pair.target.clear()
        s.reset()
        with Batch(64) as b:
            b.set(seq[:p], 0, logits="last")
            tiny_pair.target.decode(b)
            s.process(seq[:p], 0)
            drafts = s.draft(seq[p], k).tokens
            assert len(drafts) == k
            rows = [seq[p]] + seq[p + 1:p + 1 + n_acc] + [9999] * (k - n_acc)
            b.set(rows, p, logits="all")
            tiny_pair.target.decode(b)
        tiny_pair.target.seq_rm(0, p + n_acc + 1, -1)
        s.accept(n_acc)
        s.process(rows[:n_acc + 1], p)
        nxt = seq[p + n_acc + 1]
        drafted_a = s.draft(nxt, k).tokens
        logits_a = s.draft_ctx.logits_ith(0).copy()
        pos_a = s.draft_ctx.pos_max()
        # session B: fresh, prefilled with the same accepted tokens
        drafted_b, logits_b, pos_b = _fresh_draft(tiny_pair, s, seq[:p + n_acc + 1], nxt, k)
    assert pos_a == pos_b == p + n_acc + k - 1
    assert drafted_a == drafted_b
    np.testing.assert_allclose(logits_a, logits_b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("before", ["a draft", "a flush"])
def test_a_seed_encoded_straight_into_the_decoder_batch_drafts_as_a_fresh_run(tiny_pair, before):
    """Rows a cycle set aside (keep, not process) go through the encoder straight into the next draft's decoder
    batch with the seed: after a draft (its seed wrote the deferred pair) or after a flush (the deferred pair goes
    first). The draft, the head's logits and its cache end as a fresh session's that processed the same tokens."""
    k = 3
    seq = tokenize(tiny_pair.target_model, "A long sentence that we will use as the ground truth for this test.")
    p = 6
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s, Batch(64) as b:
        tiny_pair.target.clear()
        s.reset()
        b.set(seq[:p], 0, logits="last")
        tiny_pair.target.decode(b)
        s.process(seq[:p], 0)
        if before == "a draft":
            s.draft(seq[p], k)
            s.accept(2)
        else:
            s.flush()
        b.set(seq[p:p + 3], p, logits="all")  # the target kept 3 rows
        tiny_pair.target.decode(b)
        s.keep(seq[p:p + 3], p)
        drafted = s.draft(seq[p + 3], k).tokens
        logits, pos = s.draft_ctx.logits_ith(0).copy(), s.draft_ctx.pos_max()
        fresh, logits_b, pos_b = _fresh_draft(tiny_pair, s, seq[:p + 3], seq[p + 3], k)
    assert drafted == fresh and pos == pos_b == p + 3 + k - 2
    np.testing.assert_allclose(logits, logits_b, rtol=1e-3, atol=1e-3)


def test_context_full_stops_cleanly(tiny_target, tiny_head):
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=64)) as pair:
        n_ctx = pair.target.n_ctx
        prompt = tokenize(pair.target_model, "word " * (n_ctx - 40))
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            r = d.generate(prompt, GenerateConfig(n_predict=500, draft_max=4, draft_policy="fixed"))
            base = d.generate(prompt, GenerateConfig(n_predict=500, draft_max=4), speculative=False)
    assert r.stats.stop_reason == base.stats.stop_reason == "context full"
    assert len(prompt) + len(r.tokens) == n_ctx + 1  # the last token is sampled, never stored
    assert r.tokens == base.tokens


@pytest.mark.slow
def test_greedy_equals_target_only_smollm2(smollm2_path, tmp_path):
    from model_factory import HeadSpec, write_random_head

    head = write_random_head(tmp_path / "h.gguf", HeadSpec(576, (2, 15, 27), n_embd=576, n_head=9, n_head_kv=3,
                                                           n_ff=1536, draft_vocab=2048), tokenizer_from=smollm2_path)
    with load_pair(smollm2_path, head, PairConfig(n_ctx=1024)) as pair:
        model = pair.target_model
        prompts = [tokenize(model, apply_chat_template(model, [Message("user", q)]), add_special=False)
                   for q in ("Write a haiku about autumn.", "Explain what a hash map is.")]
        with Runner(pair.target) as plain:
            bases = [plain.generate(pr, GenerateConfig(n_predict=64), speculative=False) for pr in prompts]
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            for pr, base in zip(prompts, bases):
                spec = d.generate(pr, GenerateConfig(n_predict=64, draft_max=4, draft_policy="fixed"))
                assert spec.tokens == base.tokens
                check_stats_add_up(spec.stats, len(spec.tokens))
        full = prompts[0] + bases[0].tokens
        with OracleSession(pair.target, pair.head, truth=full, schedule=[4, 1, 3, 0, 2]) as s, \
                Runner(pair.target, s) as d:
            spec = d.generate(prompts[0], GenerateConfig(n_predict=64, draft_max=4, draft_policy="fixed"))
        assert spec.tokens == bases[0].tokens
        assert spec.stats.tau > 2.0  # the oracle schedule accepts 2 drafts per cycle on average


def test_rows_aside_keeps_order_through_growth_compaction_and_drops():
    """The preallocated rows aside hold exactly what a list of rows would: appended at the end, dropped from
    the front, moved to the front when the end is reached, grown when full."""
    aside, model_tok, model_feat = RowsAside(width=3, capacity=4), [], []
    rng = np.random.default_rng(0)
    for step in range(60):
        n = int(rng.integers(1, 4))
        tok, feat = aside.extend(n)
        new_tok = rng.integers(0, 1000, n).astype(np.int32)
        new_feat = rng.standard_normal((n, 3)).astype(np.float32)
        tok[:], feat[:] = new_tok, new_feat
        model_tok += list(new_tok)
        model_feat += list(new_feat)
        if step % 3 == 2 and len(model_tok) > 2:
            e = int(rng.integers(1, len(model_tok)))
            aside.drop_front(e)
            del model_tok[:e], model_feat[:e]
        if step % 17 == 16:
            aside.clear()
            model_tok, model_feat = [], []
        assert len(aside) == len(model_tok)
        assert aside.tokens.tolist() == [int(t) for t in model_tok]
        assert np.array_equal(aside.feats, np.array(model_feat, np.float32).reshape(-1, 3))
    assert len(aside.tok) > 4  # it grew


def test_rows_that_fail_to_be_kept_do_not_stay_aside(tiny_pair):
    """keep() makes room, then fills it: where filling fails (here features of the wrong shape), the room is
    taken back, so the next catch-up does not feed the head a half-written row."""
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s:
        width = s.extract.width
        s.keep([1, 2], 0, np.ones((2, width), np.float32))
        with pytest.raises(ValueError):
            s.keep([3, 4], 2, np.ones((3, width), np.float32))
        assert s.aside.tokens.tolist() == [1, 2] and np.array_equal(s.aside.feats, np.ones((2, width), np.float32))
        s.keep([3], 2, np.full((1, width), 2.0, np.float32))  # the next rows follow on at position 2
        assert s.aside.tokens.tolist() == [1, 2, 3]


def test_a_plain_cycles_row_is_set_aside_bit_for_bit(tiny_pair):
    """keep() of one row copies it straight out of llama.cpp's buffers (Context.copy_row): the same bytes as
    the numpy gather of several rows, at every row of a batch, and rows past a shared batch's row0 too."""
    target = tiny_pair.target
    with Eagle3Session(target, tiny_pair.head) as s, Batch(8) as b:
        target.clear()
        b.set([5, 6, 7, 8], 0, logits="all")
        target.decode(b)
        whole = s.extract.gather(4)  # [4, 3 * n_embd_tgt]
        for r in range(4):
            row = np.full(s.extract.width, np.nan, np.float32)
            target.copy_row(r, s.layers, row.ctypes.data)
            assert row.tobytes() == whole[r].tobytes()
        s.extract.row0 = 2  # slots.py: this sequence's rows start at row 2 of the shared batch
        try:
            s.keep([7], 2)
        finally:
            s.extract.row0 = 0
        assert s.aside.feats.tobytes() == whole[2:3].tobytes() and s.aside.tokens.tolist() == [7]
        missing = [lid for lid in range(target.model.n_layer) if lid not in s.layers]
        assert missing  # a layer that is not extracted: llama.cpp would abort on it, copy_row() refuses it
        with pytest.raises(Eagle3Error, match=f"layer {missing[0]} input was not extracted"):
            target.copy_row(0, [missing[0]], row.ctypes.data)
        target.clear()


def test_a_draft_with_nothing_to_seed_from_is_a_plain_cycle_that_keeps_its_row(tiny_pair):
    """Where every row since a reset was skipped (a new prompt sharing a prefix, then plain cycles the head did
    not read), the head has nothing to start a draft from: the cycle the policy wanted to draft in runs plain and
    keeps its row, and the next one drafts. Over RPC this raised 'draft() before process()' mid-benchmark."""
    from eagle3_gguf.policy import FixedPolicy
    from eagle3_gguf.speculator import Speculator
    from eagle3_gguf.stats import SpecStats

    target = tiny_pair.target
    prompt = tokenize(tiny_pair.target_model, PROMPTS[0])
    with Eagle3Session(target, tiny_pair.head) as s, Speculator(target, s, owns_session=False) as spec:
        spec.clear_target()
        s.reset()
        spec.prefill(prompt, 0, feed_head=False)  # the head reads none of it
        assert s.pending_pos < 0 and not len(s.aside)
        pick = lambda _rows, _pos, i: int(target.logits_ith(i).argmax())  # noqa: E731
        st, policy = SpecStats(draft_max=2), FixedPolicy(2)
        first = spec.cycle(policy, pick(None, 0, len(prompt) - 1), len(prompt), 4, pick, st)
        assert len(first.rows) == 1 and first.n_acc == 0 and st.n_drafted == 0
        assert s.can_seed and len(s.aside) == 1
        spec.cycle(policy, first.out[-1], len(prompt) + 1, 4, pick, st)
        assert st.n_drafted == 2


def test_a_draft_times_its_steps_after_the_first(tiny_pair):
    """t_steps: the seconds a draft spent on its steps after the first (the policy's price of a step); a draft of
    one step adds nothing."""
    seq = tokenize(tiny_pair.target_model, "A long sentence that we will use as the ground truth, word by word.")
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s:
        tiny_pair.target.clear()
        s.reset()
        with Batch(64) as b:
            b.set(seq[:6], 0, logits="last")
            tiny_pair.target.decode(b)
        s.process(seq[:6], 0)
        assert s.t_steps == 0.0
        assert len(s.draft(seq[6], 1).tokens) == 1 and s.t_steps == 0.0
        s.accept(0)
        t0 = time.perf_counter()
        assert len(s.draft(seq[6], 4).tokens) == 4
        assert 0.0 < s.t_steps < time.perf_counter() - t0


@pytest.mark.parametrize("head", ["tiny_head", "tiny_head_d2t"])
def test_the_heads_graph_chooses_the_drafts_numpy_finds_in_its_logits(request, tiny_target, head):
    """choose_in_graph(4): each draft step's token, top probability and 3 runner-ups as the graph chose them equal
    what numpy finds in the logits (a draft vocab's head too: -inf outside it); rejection sampling and trees, which
    read the logits, are refused while the graph chooses, before the head's state is touched."""
    with load_pair(tiny_target, request.getfixturevalue(head), PairConfig(n_ctx=512, n_batch=64)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Batch(64) as b:
        prompt = tokenize(pair.target_model, PROMPTS[2] * 4)
        assert len(prompt) > 33  # the prompt's queued pairs do not fit one decode with the seed while the graph chooses

        def drafts():
            s.reset()
            pair.target.clear()
            b.set(prompt, 0, logits="last")
            pair.target.decode(b)
            s.process(prompt, 0)
            out = []
            for id_last in (17, 934):
                d = s.draft(id_last, 4, lambda confs, n_max: len(confs) if len(confs) >= n_max else -1, n_alt=3)
                out.append(d)
                s.accept(0)
            return out

        want = drafts()
        assert s.choose_in_graph(4) and s.chooses_in_graph == 4
        got = drafts()
        for w, g in zip(want, got):
            assert g.tokens == w.tokens and g.alt_tokens == w.alt_tokens
            assert np.allclose(g.confs, w.confs, rtol=1e-4) and np.allclose(g.alt_probs, w.alt_probs, rtol=1e-4,
                                                                             atol=1e-7)
        b.set([17, 934, 11], len(prompt), logits="last")  # rows kept and set aside: the next draft catches up on them
        pair.target.decode(b)
        s.keep([17, 934, 11], len(prompt))
        state = (len(s.aside), len(s._q_tok), s._open, s.pending_pos)
        with pytest.raises(Eagle3Error, match=r"rejection sampling draws from the head's logits"):
            s.draft(11, 2, sampler=Sampler(temperature=0.8).rejection(1.0))
        assert (len(s.aside), len(s._q_tok), s._open, s.pending_pos) == state
        with pytest.raises(Eagle3Error, match=r"a draft tree reads the head's logits"):
            s.draft_tree(17, 2, 2, 4)
        assert not s.choose_in_graph(0)
        assert [d.tokens for d in drafts()] == [d.tokens for d in want]


def test_a_prompts_pairs_go_ahead_of_the_seed_in_a_decode_without_outputs(tiny_pair):
    """A prompt's queued pairs (more than OUTPUT_ROWS) are decoded before the first draft's seed with no output rows
    (their logits are never read), so the seed's decode holds one output; a few pairs ride along with the seed, every
    row an output (the eagle3 graph has no output-row selection)."""
    from eagle3_gguf.session import OUTPUT_ROWS

    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s, Batch(64) as b:
        prompt = tokenize(tiny_pair.target_model, PROMPTS[2] * 4)
        assert len(prompt) > OUTPUT_ROWS
        s.reset()  # the module's pair: earlier tests' heads left cells behind
        tiny_pair.target.clear()
        b.set(prompt, 0, logits="last")
        tiny_pair.target.decode(b)
        s.process(prompt, 0)
        s.draft(17, 1, lambda confs, n_max: 1)  # the seed step alone
        s.draft_ctx.logits_ith(0)
        with pytest.raises(Eagle3Error, match="no logits for batch row 1"):
            s.draft_ctx.logits_ith(1)
        s.accept(0)
        b.set([17, 934, 11], len(prompt), logits="last")
        tiny_pair.target.decode(b)
        s.keep([17, 934, 11], len(prompt))
        s.draft(5, 1, lambda confs, n_max: 1)
        assert s.draft_ctx.logits_ith(2) is not None  # two pairs (the third row's waits for its token) and the seed


@pytest.mark.parametrize("head_choice", ["off", "on"])
def test_a_head_with_a_small_batch_drafts_after_a_long_prompt(tiny_target, tiny_head, head_choice):
    """n_batch 16 (under OUTPUT_ROWS): a prompt's queued pairs still go to the head in batches that fit, and the
    text is target-only's."""
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512, n_batch=16)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, PROMPTS[2] * 3)
        assert len(prompt) > 16
        cfg = GenerateConfig(n_predict=24, draft_max=4, draft_policy="fixed")
        base = d.generate(prompt, cfg, speculative=False)
        d.spec.head_choice = head_choice
        spec = d.generate(prompt, cfg)
        assert spec.tokens == base.tokens and spec.stats.n_drafted > 0
        assert s.chooses_in_graph == int(head_choice == "on")


@pytest.mark.parametrize("graph_s, logits_s", [(1e-3, 2e-3), (2e-3, 1e-3)])
def test_auto_keeps_the_cheaper_way_to_read_the_head(tiny_target, tiny_head, graph_s, logits_s):
    """Speculator.head_choice auto compares drafts with the head's graph choosing k tokens a step against numpy
    reading its logits, each way in turn, and keeps the faster (a stand-in for the draft's clock)."""
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        ways = []

        def run_draft(steps: int) -> float:
            ways.append(s.chooses_in_graph)
            return graph_s if s.chooses_in_graph else logits_s

        chosen = d.spec._cheaper_head(4, run_draft)
        assert chosen == (4 if graph_s < logits_s else 0) and sorted(set(ways)) == [0, 4]


@pytest.mark.parametrize("cheaper", [0, 1])
def test_auto_drafts_as_the_cost_curve_was_timed(tiny_target, tiny_head, tmp_path, monkeypatch, cheaper):
    """The default (head_choice auto): the calibration's choice of how to read the head is the cost curve's, its
    cache brings it back to a new run, the statistics say it, and the text is target-only's either way."""
    from eagle3_gguf.speculator import Speculator

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))
    monkeypatch.setattr(Speculator, "_cheaper_head", lambda self, k, run_draft: cheaper * k)
    cfg = GenerateConfig(n_predict=24, draft_max=4)  # adaptive, chains: the graph would choose 1 token a step
    for source in ("measured", "cache"):
        with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512)) as pair, \
                Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            prompt = tokenize(pair.target_model, PROMPTS[0])
            base = d.generate(prompt, cfg, speculative=False)
            spec = d.generate(prompt, cfg)
            assert spec.tokens == base.tokens and spec.stats.policy.cost_source == source
            assert d.spec.costs.head_k == spec.stats.policy.head_k == s.chooses_in_graph == cheaper
            assert ("the head's tokens chosen in its graph" if cheaper else "the head's logits read") in \
                spec.stats.table()


def test_greedy_and_sampled_runs_in_turn_time_the_curve_once(tiny_target, tiny_head, tmp_path, monkeypatch):
    """A greedy run times the curve (auto: the head's two readings compared). Sampled runs, which read the head's
    logits, take it as it is, and greedy runs after them keep it: requests of both kinds in turn time nothing
    again. A calibration that fails leaves the speculator as it was."""
    from eagle3_gguf import speculator

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))
    chain, tree = GenerateConfig(n_predict=8, draft_max=4), GenerateConfig(n_predict=8, draft_max=4, draft_topk=4,
                                                                         draft_nodes=8)
    hot = Sampler(0.8, seed=1)
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=512, n_seq_max=tree.tree_sequences)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, PROMPTS[1])
        d.generate(prompt, chain)
        curve = d.spec.costs
        for sampler in (hot, None, hot, None):
            d.generate(prompt, chain, sampler)
            assert d.spec.costs is curve and not d.spec.needs_calibration(chain)
        ask = d.spec._costs_ask

        def fails(*args, **kw):
            raise Eagle3Error("timing failed")

        with monkeypatch.context() as m:
            m.setattr(speculator, "measure", fails)
            with pytest.raises(Eagle3Error, match="timing failed"):
                d.generate(prompt, tree)  # trees ask for 4 tokens a step: timed anew, and it fails
        assert d.spec.costs is curve and d.spec._costs_ask == ask
        base = d.generate(prompt, tree, speculative=False)
        assert d.generate(prompt, tree).tokens == base.tokens


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_drafts_chosen_in_the_heads_graph_keep_target_onlys_text(smollm2_path, policy):
    """Speculator.head_choice on (the shipped head on SmolLM2, greedy): the text is target-only's, drafts are
    accepted, and a fixed K=4 accepts at every position what the same run reading the head's logits does (the same
    drafts); the adaptive policy's run (its costs stated GPU-like, so that it drafts and may branch) takes its
    runner-ups from the graph (draft_topk 4)."""
    from eagle3_gguf.assets import default_head_path
    from oracle import GPU_ROWS, stated_costs

    cfg = GenerateConfig(n_predict=48, draft_max=4, draft_policy=policy, **(
        {"draft_topk": 4, "draft_nodes": 8} if policy == "adaptive" else {}))
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=2,
                                                                 n_seq_max=cfg.tree_sequences)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, apply_chat_template(pair.target_model, [Message("user", "Explain how a bicycle works.")]),
                          add_special=False)
        base = d.generate(prompt, cfg, speculative=False)
        if policy == "adaptive":
            d.spec.costs = stated_costs(GPU_ROWS, 0.02, 0.05)
        logits = d.generate(prompt, cfg)
        d.spec.head_choice = "on"
        graph = d.generate(prompt, cfg)
        assert s.chooses_in_graph == cfg.draft_topk
        assert graph.tokens == logits.tokens == base.tokens and graph.stats.n_accepted >= 8, graph.stats.n_accepted
        if policy == "fixed":
            assert graph.stats.accepted_by_pos == logits.stats.accepted_by_pos
        d.spec.head_choice = "off"
        d.generate(prompt, cfg)
        assert s.chooses_in_graph == 0
