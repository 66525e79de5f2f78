"""Draft trees (tree.py): each node's row is its path's, the walk keeps the target's choices, and a run that
keeps branches gives target-only's text, where a chain of the same head keeps nothing."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from eagle3_gguf.assets import default_head_path
from eagle3_gguf.batch import Batch
from eagle3_gguf.config import DraftConfig
from eagle3_gguf.decode import GenerateConfig, Runner, Sampler
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.draft import Draft
from eagle3_gguf.session import Eagle3Session
from eagle3_gguf.tokens import chat_tokens, tokenize
from eagle3_gguf.tree import DraftTree, Expansion, branch_candidates, chain_tree, walk, with_branches

PROMPT = "Write a short poem about the sea, then explain its imagery in two sentences."


def tree_of(tokens, parents, chain) -> DraftTree:
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(list(tokens), list(parents), depths, chain, [1.0] * len(tokens))


# root 10; chain 11 -> 12 -> 13; branches: 21 beside 11 (child of the root), 22 beside 13 (child of 12), and
# 23 under 21 (a deeper branch)
TREE = tree_of([10, 11, 12, 13, 21, 22, 23], [-1, 0, 1, 2, 0, 2, 4], chain=3)


def test_sequences_give_each_node_exactly_its_path():
    seqs, n = TREE.sequences()
    assert n == 2  # the leaves off the chain: 22 and 23
    for i in range(len(TREE.tokens)):
        # the nodes row i attends (shares a sequence with, at a depth not past its own) are its path
        sees = {j for j in range(len(TREE.tokens)) if set(seqs[i]) & set(seqs[j]) and TREE.depths[j] <= TREE.depths[i]}
        assert sees == {0, *TREE.path(i)}, (i, seqs)


def test_walk_follows_the_target_among_children():
    def target(choices):
        return lambda row: choices[row]

    # the target takes the chain, then the branch beside 13, then a token of its own
    w = walk(TREE, target({0: 11, 1: 12, 2: 22, 5: 7}))
    assert w.out == [11, 12, 22, 7] and w.path == [1, 2, 5] and w.on_chain == 2
    w = walk(TREE, target({0: 21, 4: 23, 6: 8}))  # the branch at depth 1, and its child
    assert w.out == [21, 23, 8] and w.path == [4, 6] and w.on_chain == 0
    w = walk(TREE, target({0: 99}))
    assert w.out == [99] and w.path == [] and w.on_chain == 0
    w = walk(TREE, target({0: 11, 1: 12, 2: 13, 3: 5}))
    assert w.out == [11, 12, 13, 5] and w.on_chain == 3
    w = walk(TREE, target({0: 11, 1: 12}), stop=lambda t: t == 12)  # an end token ends the cycle as its own
    assert w.out == [11, 12] and w.path == [1]


def test_branches_are_the_likeliest_runner_ups():
    draft = Draft([11, 12, 13], [0.5, 0.5, 0.5], [], [[21, 31], [22, 32], [23, 33]],
                  [[0.4, 0.1], [0.3, 0.2], [0.45, 0.05]])
    chain = chain_tree(10, draft)
    assert chain.probs == [1.0, 0.5, 0.25, 0.125]
    ranked = branch_candidates(chain, draft)
    # reach x probability: 21 0.4, 22 0.15, 23 0.1125, 31 0.1, 32 0.1 (a tie: the shallower first), 33 0.0125
    assert [b.token for b in ranked] == [21, 22, 23, 31, 32, 33]
    tree = with_branches(chain, ranked[:3])
    assert tree.tokens == [10, 11, 12, 13, 21, 22, 23] and tree.parents == [-1, 0, 1, 2, 0, 1, 2]
    assert tree.depths == [0, 1, 2, 3, 1, 2, 3] and tree.chain == 3
    assert tree.probs[4:] == pytest.approx([0.4, 0.15, 0.1125])
    assert with_branches(chain, []).tokens == [10, 11, 12, 13]
    # a weight of the policy's: the head's confidences calibrated, a branch's worth against its row's cost
    assert chain_tree(10, draft, accept=lambda i, conf: 0.5 * conf).probs == [1.0, 0.25, 0.0625, 0.015625]
    assert [b.token for b in branch_candidates(chain, draft, lambda d, reach, p: p if d == 2 else 0.0)] == [22, 32]


def test_the_likeliest_candidates_make_the_tree():
    """EAGLE-2's selection: the n candidates likeliest to be reached, each with its path; the chain follows the
    likeliest child from the root, the other nodes come after it by depth."""
    cands = Expansion(10)
    cands.add_children(0, [11, 21], [0.6, 0.3])  # nodes 1, 2
    cands.add_children(1, [12, 22], [0.5, 0.4])  # nodes 3, 4: reached 0.3 and 0.24
    cands.add_children(2, [23, 33], [0.9, 0.1])  # nodes 5, 6: 0.27 and 0.03
    cands.add_children(3, [13, 24], [0.7, 0.2])  # nodes 7, 8: 0.21 and 0.06
    assert cands.likeliest(2, 2) == [3, 5] and cands.likeliest(1, 5) == [1, 2]
    tree = cands.best(5)  # 11 0.6, 21 and 12 0.3, 23 0.27, 22 0.24
    assert tree.tokens == [10, 11, 12, 21, 22, 23] and tree.parents == [-1, 0, 1, 0, 1, 3]
    assert tree.depths == [0, 1, 2, 1, 2, 2] and tree.chain == 2
    assert tree.probs == pytest.approx([1.0, 0.6, 0.3, 0.3, 0.24, 0.27])
    tree = cands.best(6)  # and 13 at 0.21, under 12: the chain grows
    assert tree.tokens == [10, 11, 12, 13, 21, 22, 23] and tree.chain == 3
    assert cands.best(1).tokens == [10, 11] and cands.best(1).chain == 1


def test_a_tree_needs_sequences_in_both_contexts(tiny_target, tiny_head):
    config = GenerateConfig(draft_policy="fixed", draft_topk=2, n_predict=4)
    assert config.tree_nodes == 8 and config.tree_sequences == 8
    assert DraftConfig(draft_topk=4, draft_nodes=6).tree_sequences == 9 and DraftConfig().tree_sequences == 1
    with pytest.raises(Eagle3Error, match="--draft-topk must be between 1 and 8 \\(got 9\\)"):
        DraftConfig.from_flags(draft_topk=9)
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=64)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        with pytest.raises(Eagle3Error, match=r"needs contexts with 8 sequences \(these have 1\)"):
            d.generate(tokenize(pair.target_model, "Hello"), config)
    # llama.cpp reserves an output row per sequence, at most n_batch (itself at most n_ctx): past it, a GGML abort
    with pytest.raises(Eagle3Error) as e:
        load_pair(tiny_target, tiny_head, PairConfig(n_ctx=16, n_batch=64, n_seq_max=17))
    assert str(e.value) == ("a context of 16 batch rows cannot serve 17 sequences (llama.cpp reserves an output row for "
                            "each): raise -c and the batch to at least 17, or use fewer (a draft tree's: --draft-topk, "
                            "--draft-nodes)")
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=16, n_seq_max=16)) as pair:
        assert pair.target.n_seq_max == 16


@pytest.fixture(scope="module")
def pair(smollm2_path):
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=1024, n_threads=2, n_seq_max=9)) as p:
        yield p


def test_a_tree_row_is_its_path_decoded_as_a_chain(pair):
    """Each node's logits from one tree batch equal, bit for bit, the last row of its path decoded as a chain
    after the same prefix (flash attention skips the cells a row's mask hides)."""
    target = pair.target
    prompt = tokenize(pair.target_model, "The quick brown fox jumps over the lazy dog. The quick")
    n = len(prompt)
    tree = tree_of([prompt[-1], 1000, 1001, 1002, 2000, 2001, 2002], [-1, 0, 1, 2, 0, 2, 4], chain=3)
    batch = Batch(64, n_seq_max=8)
    target.clear()
    batch.set(prompt[:-1], 0, logits="none")
    target.decode(batch)
    seqs, n_branch = tree.sequences()
    for s in range(1, n_branch + 1):
        target.seq_cp(0, s)
    batch.set_tree(tree.tokens, [n - 1 + d for d in tree.depths], seqs)
    target.decode(batch)
    rows = target.logits(len(tree.tokens)).copy()  # [N + 1, n_vocab]
    for node in range(len(tree.tokens)):
        path = [tree.tokens[0], *(tree.tokens[i] for i in tree.path(node))]
        target.clear()
        batch.set(prompt[:-1], 0, logits="none")
        target.decode(batch)
        batch.set(path, n - 1, logits="all")
        target.decode(batch)
        assert np.array_equal(rows[node], target.logits(len(path))[-1]), node


def test_a_tree_batch_hands_back_the_logits_of_rows_the_targets_graph_chose_nothing_for(pair):
    """With the target's graph choosing sequence 0's tokens, a tree batch (rows of branch sequences too) has a row of
    sequence 0 alone chosen (its argmax), one of branch sequences alone not; every row has either its choice or its
    logits, bit for bit those without the choice; a chosen row's logits are refused."""
    target = pair.target
    prompt = tokenize(pair.target_model, "The quick brown fox jumps over the lazy dog. The quick")
    n = len(prompt)
    tree = tree_of([prompt[-1], 1000, 1001, 1002, 2000, 2001, 2002], [-1, 0, 1, 2, 0, 2, 4], chain=3)
    seqs, n_branch = tree.sequences()
    batch = Batch(64, n_seq_max=8)

    def decode_tree() -> None:
        target.clear()
        batch.set(prompt[:-1], 0, logits="none")
        target.decode(batch)
        for s in range(1, n_branch + 1):
            target.seq_cp(0, s)
        batch.set_tree(tree.tokens, [n - 1 + d for d in tree.depths], seqs)
        target.decode(batch)

    decode_tree()
    want = target.logits(len(tree.tokens)).copy()  # [N + 1, n_vocab]
    assert target.set_greedy_sampling(True)
    try:
        decode_tree()
        argmax = np.argmax(want, 1).tolist()
        chosen = [target.chosen_token(i) for i in range(len(tree.tokens))]
        assert chosen[3] == argmax[3] and chosen[4:] == [None] * 3, seqs  # rows of [0] and of branches alone
        for i, c in enumerate(chosen):  # a row of several sequences: as llama.cpp lists them
            if c is None:
                assert np.array_equal(target.logits_ith(i), want[i]), i
            else:
                assert c == argmax[i], i
                with pytest.raises(Eagle3Error, match="no logits: this context chooses tokens in the graph"):
                    target.logits_ith(i)
    finally:
        target.set_greedy_sampling(False)
        target.clear()


class SecondChoice(Eagle3Session):
    """A head whose first draft is always wrong and whose runner-up there is the target's token (what a tree
    exists for): a chain drafts the target's future shifted by one token id; a tree's first depth holds that
    wrong token and the true one, equally likely (the deeper nodes are the head's own)."""

    truth: list[int] = []

    def _next_true(self, depth: int) -> int:
        i = self.pending_pos + self.shift + 1 + depth  # id_last sits at pending_pos + shift + 1
        # past the end-of-generation token (where the target ends its text within n_predict) no draft is kept
        return self.truth[i] if i < len(self.truth) else 0

    def draft(self, id_last, n_max, judge=None, p_min=0.0, sampler=None, n_alt=0, native=None) -> Draft:
        real = super().draft(id_last, n_max, judge, p_min, sampler, n_alt, native)
        wrong = [(self._next_true(1 + i) + 1) % 49152 for i in range(len(real.tokens))]
        return dataclasses.replace(real, tokens=wrong)

    def draft_tree(self, id_last, depth, topk, n_nodes):
        self._seeded = False
        return super().draft_tree(id_last, depth, topk, n_nodes)

    def _top(self, logits, k):
        if self._seeded:
            return super()._top(logits, k)
        self._seeded = True  # the seed step: the first depth
        true = self._next_true(1)
        return [(true + 1) % 49152, true], [0.5, 0.5]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", ["shipped", "whole vocab"])
def test_a_steps_likeliest_tokens_are_those_a_full_sort_gives(pair, tiny_target, tiny_head, heads, k):
    """_top (a tree's children, a chain step's runner-ups) on a row of a head's own logits shuffled: the k likeliest
    tokens, likeliest first, with their softmax probabilities, the row itself untouched; over the shipped head's
    draft vocab (-inf elsewhere) and over the whole vocab of a head without one (the row is llama.cpp's buffer)."""
    shipped = heads == "shipped"
    with contextlib.ExitStack() as stack:
        p = pair if shipped else stack.enter_context(load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256)))
        s = stack.enter_context(Eagle3Session(p.target, p.head))
        d = stack.enter_context(Runner(p.target, s))
        d.generate(chat_tokens(p.target_model, PROMPT), GenerateConfig(n_predict=8, draft_max=2, draft_policy="fixed"))
        real = s.draft_ctx.logits_ith(0).copy()  # [n_vocab], -inf outside a draft vocab
        ids = np.flatnonzero(np.isfinite(real))  # [n_draft_vocab]
        assert (0 < ids.size < real.size) if shipped else ids.size == real.size
        rng = np.random.default_rng(k)
        for _ in range(3):
            row = np.full_like(real, -np.inf)
            row[ids] = rng.permutation(real[ids])
            given = row.copy()
            tokens, probs = s._top(row, k)
            assert np.array_equal(row, given)
            z = row[ids]
            e = np.exp(z - z.max())  # float32, as _top ranks them
            order = np.argsort(-e, kind="stable")[:k]
            p64 = np.exp(z.astype(np.float64) - z.max()) / np.exp(z.astype(np.float64) - z.max()).sum()
            assert tokens == ids[order].tolist()
            assert np.allclose(probs, p64[order], rtol=1e-5, atol=0)


def test_a_runner_up_is_kept_through_a_tree_and_never_through_a_chain(pair):
    prompt = chat_tokens(pair.target_model, PROMPT)
    # (the probe covers a tree after a kept branch, which its cycle decodes again first: 1 + 3 + 5 rows)
    chain = GenerateConfig(n_predict=60, draft_max=3, draft_policy="fixed")
    tree = dataclasses.replace(chain, draft_topk=2, draft_nodes=5)
    with Runner(pair.target) as plain:
        base = plain.generate(prompt, chain, speculative=False)
    with SecondChoice(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        s.truth = prompt + base.tokens
        by_chain = d.generate(prompt, chain)
        by_tree = d.generate(prompt, tree)
    assert by_chain.tokens == base.tokens == by_tree.tokens
    assert by_chain.stats.n_accepted == 0 and by_chain.stats.tree_cycles == 0
    st = by_tree.stats
    # every tree cycle keeps the depth-1 branch (and the head's tokens under it, now and then)
    assert st.tree_cycles > 10 and st.tree_branch_kept == st.tree_cycles <= st.n_accepted
    # a tree cycle decodes id_last and its nodes, after the branch the cycle before kept (at most 3 deep) again
    rows = st.verify_rows
    assert sum(rows) == st.n_target_forwards - 1 and len(rows) <= 1 + 3 + 1 + 5
    assert sum(n * c for n, c in enumerate(rows)) >= st.tree_nodes + st.tree_cycles + st.tree_branch_kept - 1
    assert 4 * st.tree_cycles < st.tree_nodes <= 5 * st.tree_cycles  # (the last cycles draft what n_predict leaves)
    assert st.n_accepted + st.n_target_forwards == st.n_generated


def test_a_tree_where_the_targets_graph_picks_reads_the_rows_it_chose_nothing_for_from_the_logits(pair, monkeypatch):
    """Where the target's graph picks greedy tokens (forced here: the GPU's path), a tree cycle reads the graph's
    choice where it made one (rows of sequence 0) and the logits llama.cpp hands back elsewhere (the branches'):
    every tree cycle keeps its branch, and the text is target-only's."""
    from eagle3_gguf import decode

    monkeypatch.setattr(decode, "greedy_in_graph", lambda target: True)
    prompt = chat_tokens(pair.target_model, PROMPT)
    tree = GenerateConfig(n_predict=60, draft_max=3, draft_policy="fixed", draft_topk=2, draft_nodes=5)
    try:
        with Runner(pair.target) as plain:
            base = plain.generate(prompt, tree, speculative=False)
        with SecondChoice(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            s.truth = prompt + base.tokens
            got = d.generate(prompt, tree)
            assert pair.target.greedy_sampling
    finally:
        pair.target.set_greedy_sampling(False)
    assert got.tokens == base.tokens
    assert got.stats.tree_branch_kept == got.stats.tree_cycles > 10


@pytest.mark.parametrize("cfg, rows", [
    (GenerateConfig(draft_max=3, draft_policy="fixed", draft_topk=2, draft_nodes=5), 1 + 3 + 5),  # a branch 3 deep
    (GenerateConfig(draft_max=4, draft_topk=4, draft_nodes=8, draft_lookup=False), 1 + 1 + 8),  # a leaf
    (GenerateConfig(draft_max=4, draft_policy="fixed"), 1 + 4),  # a chain: nothing decoded again
])
def test_the_probe_covers_a_tree_after_a_kept_branch(pair, monkeypatch, tmp_path, cfg, rows):
    """A tree cycle after one that kept a branch decodes that branch again before its tree: the exactness probe
    covers that batch too, so such a cycle keeps its whole tree (SmolLM2 on this CPU is exact at every width)."""
    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))  # probed now, not answered by a wider run's probe
    with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        found = d.spec.prepare(cfg)
    assert (found.source, found.probed, found.rows_max) == ("probed", rows, rows)


def test_the_head_drafts_a_chain_as_a_tree_of_one_token_a_depth(pair):
    """draft_tree at top-1 runs each depth's node over its own sequence of the head's cache: it drafts what
    draft() drafts, and leaves the head's cache as draft() does."""
    prompt = tokenize(pair.target_model, "The quick brown fox jumps over the lazy dog. The quick")
    got = {}
    with Batch(64) as batch:
        for how in ("chain", "tree"):
            with Eagle3Session(pair.target, pair.head) as s:  # (it asks the target for the head's layers)
                pair.target.clear()
                batch.set(prompt, 0, logits="last")
                pair.target.decode(batch)
                s.reset()
                s.process(prompt, 0)
                if how == "chain":
                    draft = s.draft(prompt[2], 5, p_min=0.0)
                else:
                    tree = s.draft_tree(prompt[2], 5, 1, 5)
                    draft = tree.chain_draft
                    assert tree.chain == tree.n_nodes == 5 and tree.tokens[1:] == draft.tokens
                got[how] = (draft, pair.head.pos_max(), pair.head.pos_max(1))
    (chain, end_c, _), (tree, end_t, branch) = got["chain"], got["tree"]
    assert tree.tokens == chain.tokens and tree.confs == pytest.approx(chain.confs[:5], rel=1e-4)
    assert end_t == end_c - 4 and branch == -1  # the chain's steps stay until accept(); the tree's go at once


@pytest.mark.parametrize("k, topk, nodes", [(3, 2, 4), (4, 2, 8), (2, 4, 8)])
def test_fixed_trees_give_target_only_text(pair, k, topk, nodes):
    """The shipped head drafting trees: identical text, and branches kept now and then; a generation after one
    that ended on a kept branch (decoded again at the next cycle's head) starts from the right cache."""
    prompt = chat_tokens(pair.target_model, PROMPT)
    config = GenerateConfig(n_predict=96, draft_max=k, draft_policy="fixed", draft_topk=topk, draft_nodes=nodes)
    with Runner(pair.target) as plain:
        base = plain.generate(prompt, config, speculative=False)
    with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        got = d.generate(prompt, config)
        again = d.generate(prompt + got.tokens[:7], dataclasses.replace(config, n_predict=20))
        with Runner(pair.target) as plain2:
            want = plain2.generate(prompt + got.tokens[:7], dataclasses.replace(config, n_predict=20),
                                   speculative=False)
    assert got.tokens == base.tokens and again.tokens == want.tokens
    st = got.stats
    assert st.tree_cycles > 0 and st.tree_branch_kept > 0 and st.n_accepted > 0


def test_the_adaptive_policy_adds_a_branch_where_its_row_pays():
    """Where rows are nearly free (a GPU) the likely runner-ups join the tree, up to the node cap; where they
    are dear (2 CPU cores) none does; a runner-up the target never takes stops being verified."""
    from eagle3_gguf.costs import CostCurve
    from eagle3_gguf.policy import AdaptivePolicy

    def policy(curve):
        return AdaptivePolicy(CostCurve([0.01 * c for c in curve], 0.002, 0.002, "given"), 3, topk=2, nodes=5)

    cheap, dear = policy([1.0 + 0.02 * n for n in range(6)]), policy([1.0, 2.0, 2.5, 3.0, 3.6, 4.1])
    draft = Draft([11, 12, 13], [0.5, 0.5, 0.5], [], [[21], [22], [23]], [[0.4], [0.3], [0.2]])
    tree = cheap.tree(10, draft, 8)
    assert tree is not None and tree.n_nodes == 5 and tree.tokens[4:] == [21, 22]  # the two likeliest, by depth
    assert dear.tree(10, draft, 8) is None
    for _ in range(30):  # the target never takes the depth-1 runner-up when it is reached
        cheap.observe_tree(tree, [])
    assert 21 not in cheap.tree(10, draft, 8).tokens
    assert cheap.tree(10, draft, 4).n_nodes == 4  # where only 4 rows fit after id_last (the context's end)


def test_a_tree_at_temperature_keeps_the_targets_samples(pair):
    """At T > 0 a tree keeps a node only where it is the target's own sample there (the sampler draws once per
    emitted token, in order): every seed gives target-only's text, with the shipped head and with one whose
    first draft is always wrong (under spec_sampling rejection a tree keeps the target's samples too, drawn
    from the rejection sampler's stream: tests/test_spec_sampling.py)."""
    prompt = chat_tokens(pair.target_model, PROMPT)
    config = GenerateConfig(n_predict=48, draft_max=3, draft_policy="fixed", draft_topk=2, draft_nodes=6,
                            spec_sampling="match")
    kept = 0
    for head in (Eagle3Session, SecondChoice):
        for seed in (1, 2, 3):
            with Runner(pair.target) as plain:
                base = plain.generate(prompt, config, Sampler(temperature=0.9, seed=seed), speculative=False)
            with head(pair.target, pair.head) as s, Runner(pair.target, s) as d:
                s.truth = prompt + base.tokens  # SecondChoice's oracle: the sampled text is the truth here
                got = d.generate(prompt, config, Sampler(temperature=0.9, seed=seed))
            assert got.tokens == base.tokens, (head.__name__, seed)
            kept += got.stats.tree_branch_kept
            if head is SecondChoice:
                assert got.stats.tree_branch_kept == got.stats.tree_cycles > 0
    assert kept > 0
