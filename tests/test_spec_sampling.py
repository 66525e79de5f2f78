"""Speculative sampling at temperature > 0: rejection sampling (drafts from the head's q, kept with
probability min(1, p/q), residual on rejection) is the target's distribution, and keeps more drafts than
exact match where q is calibrated. Math-level tests run the library's own draft/verify code on synthetic
logits over many fixed-seed draws; end-to-end tests run the Runner, the CLI and the drop-in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from eagle3_gguf.decode import GenerateConfig, Runner, Sampler
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.spec_sampling import RejectionSampler, Transform, one_hot, residual, verify_match

N_DRAWS = 20_000


# -- chi-square -------------------------------------------------------------------------------------------
def chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0.0:
        return 1.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1.0:  # series for P
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1.0
            term *= z / n
            total += term
        return 1.0 - math.exp(log_front) * total
    # continued fraction for Q (modified Lentz)
    tiny = 1e-300
    b = z + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Goodness of fit of counts to probabilities; cells expecting fewer than 5 draws are pooled.
    # observed, expected_probs: [n_cells]"""
    n = observed.sum()
    expected = expected_probs * n
    assert observed[expected_probs == 0].sum() == 0, "a draw landed where the target has probability 0"
    small = expected < 5.0
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, obs.size - 1)


def test_chi2_sf_matches_known_quantiles():
    # chi-square quantiles from tables: P(X > 3.841 | 1) = 0.05, P(X > 23.209 | 10) = 0.01, median of 2 dof
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(23.209251, 10) == pytest.approx(0.01, abs=1e-5)
    assert chi2_sf(2 * math.log(2), 2) == pytest.approx(0.5, abs=1e-9)
    assert chi2_sf(150.0, 120) == pytest.approx(0.0329, abs=2e-3)


# -- the transform is llama.cpp's chain -------------------------------------------------------------------
def chain_by_definition(logits: np.ndarray, t: Transform) -> dict[int, float]:
    """top-k → top-p → min-p → temperature, written from llama.cpp's definitions over a full sort."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    if t.top_k > 0:
        order = order[:t.top_k]
    z = logits[order].astype(np.float64)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    if t.top_p < 1.0:
        cum, last = 0.0, len(order)
        for i, pi in enumerate(p):
            cum += pi
            if cum >= t.top_p:
                last = i + 1
                break
        order, z = order[:last], z[:last]
    if t.min_p > 0.0:
        keep = z >= z.max() + math.log(t.min_p)
        order, z = order[keep], z[keep]
    w = np.exp((z - z.max()) / t.temperature)
    return {int(i): float(x) for i, x in zip(order, w / w.sum())}


@pytest.mark.parametrize("t", [Transform(0.7), Transform(1.0, 0, 1.0, 0.0), Transform(1.3, 8, 0.8, 0.1),
                               Transform(0.5, 0, 0.9, 0.0)])
def test_transform_is_the_sampler_chain(t):
    rng = np.random.default_rng(5)
    for _ in range(20):
        logits = (rng.normal(size=300) * 3).astype(np.float32)  # [n_vocab]
        d = t.dist(logits)
        want = chain_by_definition(logits, t)
        assert dict(zip(d.ids.tolist(), d.probs.tolist())) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_sampler_pick_draws_from_the_transform():
    """Sampler.pick (target-only sampling) is one draw from Transform.dist with the sampler's stream."""
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=50) * 2).astype(np.float32)
    s = Sampler(0.9, seed=3)
    u = np.random.default_rng(3).random(2000)
    d = s.transform.dist(logits)
    assert [s.pick(logits) for _ in range(2000)] == [d.sample(x) for x in u]


def test_residual():
    t = Transform(1.0, 0, 1.0, 0.0)
    p = t.dist(np.log(np.array([0.5, 0.3, 0.2, 1e-30], np.float32)))
    q = t.dist(np.log(np.array([0.2, 0.6, 0.2], np.float32)), ids=np.array([0, 1, 7]))  # token 7: outside p
    r = residual(p, q)  # max(0, p - q) = [0.3, 0, 0.2, 1e-30] over tokens 0..3, normalised
    assert dict(zip(r.ids.tolist(), r.probs.tolist())) == pytest.approx({0: 0.6, 2: 0.4, 3: 2e-30}, rel=1e-5)
    assert residual(p, p) is p  # p == q: no rejection can happen


# -- a synthetic world: the target and a head as functions of the context --------------------------------
@dataclass
class World:
    """A target and a head over a small vocab, as logits per context (drawn once, from a seed). The head
    sees only its draft vocab (`draft_ids`, like a d2t head); `noise` sets how far its logits are from
    the target's (0: a calibrated head)."""

    n_vocab: int = 12
    noise: float = 1.0
    spread: float = 1.5
    draft_ids: np.ndarray | None = None  # [n_draft_vocab] target ids the head can draft; None: all
    seed: int = 0
    _target: dict = field(default_factory=dict)
    _head: dict = field(default_factory=dict)

    def _normal(self, kind: int, ctx: tuple) -> np.ndarray:
        """Noise for one context, the same whatever order contexts are asked in.  # [n_vocab]"""
        return np.random.default_rng([self.seed, kind, len(ctx), *ctx]).normal(size=self.n_vocab)

    def target(self, ctx: tuple) -> np.ndarray:  # [n_vocab]
        ctx = ctx[:3]
        if ctx not in self._target:
            self._target[ctx] = (self._normal(0, ctx) * self.spread).astype(np.float32)
        return self._target[ctx]

    def head(self, ctx: tuple) -> tuple[np.ndarray, np.ndarray | None]:  # [n_draft_vocab], ids
        ctx = ctx[:3]
        if ctx not in self._head:
            z = self.target(ctx) + (self._normal(1, ctx) * self.noise).astype(np.float32)
            self._head[ctx] = z if self.draft_ids is None else z[self.draft_ids]
        return self._head[ctx], self.draft_ids

    def exact_first_two(self, t: Transform) -> np.ndarray:
        """Target-only probabilities of the first two tokens.  # [n_vocab * n_vocab], cell x1 * n_vocab + x2"""
        joint = np.zeros((self.n_vocab, self.n_vocab))
        p1 = t.dist(self.target(()))
        for x1, a in zip(p1.ids, p1.probs):
            p2 = t.dist(self.target((int(x1),)))
            joint[x1, p2.ids] = a * p2.probs
        return joint.ravel()


@dataclass
class Run:
    first_two: np.ndarray  # [n_vocab * n_vocab]: counts of (first, second) emitted token
    drafted: int = 0
    accepted: int = 0


def run_world(world: World, t: Transform, rule: str, n_draws: int, k: int = 2, scale: float = 1.0,
              seed: int = 1234) -> Run:
    """Decode two tokens n_draws times with k-draft cycles, through the library's draft and verify code:
    RejectionSampler.draft / verify ("rejection"), greedy drafts and verify_match with Sampler.pick
    ("match"), or a deterministic proposal (the head's argmax, as a lookup draft is: q one-hot) verified by
    RejectionSampler.verify ("lookup"). One random stream for everything."""
    sampler = Sampler(t.temperature, seed, t.top_k, t.top_p, t.min_p)
    rs = RejectionSampler(t, scale, sampler.rng)
    run = Run(np.zeros(world.n_vocab ** 2, np.int64))
    for _ in range(n_draws):
        out: list[int] = []
        while len(out) < 2:
            ctx = tuple(out)
            drafts, qs = [], []
            for j in range(k):
                z, ids = world.head(ctx + tuple(drafts))
                if rule == "rejection":
                    d, q = rs.draft(z, ids)
                    qs.append(q)
                elif rule == "lookup":
                    j_top = int(np.argmax(z))
                    d = int(ids[j_top]) if ids is not None else j_top
                    qs.append(one_hot(d))
                else:
                    j_top = int(np.argmax(z))
                    d = int(ids[j_top]) if ids is not None else j_top
                drafts.append(d)
            rows = lambda i: world.target(ctx + tuple(drafts[:i]))  # noqa: E731
            if rule in ("rejection", "lookup"):
                new = rs.verify(drafts, qs, rows)
            else:
                new = verify_match(drafts, lambda i: sampler.pick(rows(i)))
            run.drafted += len(drafts)
            run.accepted += len(new) - 1
            out += new
        run.first_two[out[0] * world.n_vocab + out[1]] += 1
    return run


def marginals(counts_or_probs: np.ndarray, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    m = counts_or_probs.reshape(n_vocab, n_vocab)
    return m.sum(axis=1), m.sum(axis=0)


# The fidelity fixture: a head whose draft vocab misses a third of the target's, q neither calibrated nor
# useless, truncation by top-k / top-p / min-p so that p's and q's supports differ.
FIDELITY_T = Transform(0.8, top_k=8, top_p=0.95, min_p=0.02)


def fidelity_world() -> World:
    return World(n_vocab=12, noise=1.0, spread=1.5, draft_ids=np.array([0, 1, 2, 3, 5, 6, 8, 9]), seed=3)


@pytest.fixture(scope="module")
def fidelity_runs():
    return {(rule, scale): run_world(fidelity_world(), FIDELITY_T, rule, N_DRAWS, scale=scale)
            for rule, scale in [("rejection", 1.0), ("rejection", 0.5), ("match", 1.0), ("lookup", 1.0)]}


@pytest.mark.parametrize("rule, scale", [("rejection", 1.0), ("rejection", 0.5), ("match", 1.0), ("lookup", 1.0)])
def test_first_two_tokens_are_target_only_sampling(fidelity_runs, rule, scale):
    """20,000 fixed-seed draws: the first and second emitted tokens (each alone and jointly) follow
    target-only sampling (chi-square p > 0.01), whichever cycle emits them."""
    world = fidelity_world()
    run = fidelity_runs[(rule, scale)]
    exact = world.exact_first_two(FIDELITY_T)
    assert run.first_two.sum() == N_DRAWS
    assert run.accepted > 0.2 * N_DRAWS  # drafts really were kept: the cycles emitted both tokens
    (o1, o2), (e1, e2) = marginals(run.first_two, world.n_vocab), marginals(exact, world.n_vocab)
    assert chi_square_p(o1, e1) > 0.01
    assert chi_square_p(o2, e2) > 0.01
    assert chi_square_p(run.first_two, exact) > 0.01


def test_a_wrong_verifier_is_caught(fidelity_runs):
    """The test has power: keeping a draft whenever it is in p's support (no min(1, p/q) test) is not
    the target's distribution, and the same chi-square sees it."""
    world = fidelity_world()

    class Greedy(RejectionSampler):
        def verify(self, drafts, qs, row_logits, stop=None):
            out = []
            for i, d in enumerate(drafts):
                if self.target(row_logits(i)).prob(d) > 0:
                    out.append(d)
                    continue
                return out + [self.target(row_logits(i)).sample(self.rng.random())]
            return out + [self.target(row_logits(len(drafts))).sample(self.rng.random())]

    rs = Greedy(FIDELITY_T, 1.0, np.random.default_rng(9))
    counts = np.zeros(world.n_vocab ** 2, np.int64)
    for _ in range(5000):
        out: list[int] = []
        while len(out) < 2:
            drafts, qs = [], []
            for _j in range(2):
                d, q = rs.draft(*world.head(tuple(out) + tuple(drafts)))
                drafts.append(d)
                qs.append(q)
            ctx = tuple(out)
            out += rs.verify(drafts, qs, lambda i: world.target(ctx + tuple(drafts[:i])))
        counts[out[0] * world.n_vocab + out[1]] += 1
    assert chi_square_p(counts, world.exact_first_two(FIDELITY_T)) < 1e-6


def test_rejection_keeps_more_drafts_than_match(fidelity_runs):
    rej, match = fidelity_runs[("rejection", 1.0)], fidelity_runs[("match", 1.0)]
    assert rej.accepted / rej.drafted > match.accepted / match.drafted


def test_calibrated_head_keeps_1_3x_as_many_drafts():
    """A head whose q is close to p (its logits off by noise of sd 0.3): rejection keeps about
    1 - TV(p, q) of its drafts, match only p(argmax q); at T = 1 with llama.cpp's default cuts that is
    >= 1.3x as many."""
    t = Transform(1.0, top_k=40, top_p=0.95, min_p=0.05)
    world = lambda: World(n_vocab=64, noise=0.3, spread=3.0, seed=11)  # noqa: E731
    rej = run_world(world(), t, "rejection", 4000, k=4)
    match = run_world(world(), t, "match", 4000, k=4)
    assert rej.accepted >= 1.3 * match.accepted, (rej.accepted, match.accepted)
    assert rej.accepted / rej.drafted > 0.7


def test_greedy_draft_accepts_like_match():
    """scale 0 drafts the head's argmax: rejection then keeps a draft with probability p(d), like match."""
    t = FIDELITY_T
    rej = run_world(fidelity_world(), t, "rejection", 4000, scale=0.0)
    match = run_world(fidelity_world(), t, "match", 4000)
    a, b = rej.accepted / rej.drafted, match.accepted / match.drafted
    assert abs(a - b) < 4 * math.sqrt(a * (1 - a) / rej.drafted + b * (1 - b) / match.drafted)


def test_a_draft_outside_q_or_p_is_never_kept():
    t = Transform(1.0, 0, 1.0, 0.0)
    rs = RejectionSampler(t, 1.0, np.random.default_rng(0))
    q = t.dist(np.zeros(4, np.float32), ids=np.array([0, 1, 2, 3]))
    logits = np.array([0.0, 0.0, -np.inf, 0.0, 0.0], np.float32)  # p(2) = 0
    for _ in range(200):
        out = rs.verify([2], [q], lambda i: logits)
        assert out[0] != 2 and len(out) == 1
        out = rs.verify([4], [q], lambda i: logits)  # q(4) = 0: not drawn from q, so never kept
        assert len(out) == 1
    with pytest.raises(Eagle3Error, match="q for every draft"):
        rs.verify([1, 2], [q], lambda i: logits)


def test_stop_ends_the_cycle_at_an_accepted_draft():
    t = Transform(1.0, 0, 1.0, 0.0)
    rs = RejectionSampler(t, 1.0, np.random.default_rng(0))
    q = t.dist(np.array([5.0, 0.0], np.float32))
    logits = np.array([5.0, 0.0, 0.0], np.float32)
    outs = [rs.verify([0, 0], [q, q], lambda i: logits, stop=lambda tok: tok == 0) for _ in range(50)]
    assert [0] in outs and all(o == [0] or (len(o) == 1) for o in outs)


# -- end to end: the Runner on a fixture pair ------------------------------------------------------------
from collections import Counter  # noqa: E402

from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.tokens import is_eog, tokenize  # noqa: E402

EOG = -1  # a cell's end when the generation ended with an end-of-generation token
HOT3 = dict(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)  # really samples on the peaked tiny model


@pytest.fixture(scope="module")
def tiny_pair(tiny_target, tiny_head):
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=64, n_threads=1)) as pair:
        yield pair


@pytest.fixture(scope="module")
def mirror_ctx(tiny_target, tiny_head):
    """A second context on the tiny target, for a head that reads the target's own logits."""
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=64, n_threads=1)) as pair:
        yield pair.target


def target_logits(ctx, tokens: list[int]) -> np.ndarray:
    """The target's logits after `tokens`, decoded alone in one batch.  # [n_vocab]"""
    ctx.clear()
    with Batch(len(tokens)) as b:
        b.set(tokens, 0, logits="last")
        ctx.decode(b)
    return ctx.logits_ith(len(tokens) - 1).copy()


class MirrorSession(Eagle3Session):
    """A calibrated head: every draft step sees the target's own logits for the text so far (from a second
    context), plus fixed noise of sd `noise` per context, so q is close to p. The real head still runs,
    its KV moving as usual."""

    def __init__(self, *args, mirror, noise: float, **kw):
        super().__init__(*args, **kw)
        self.mirror, self.noise = mirror, noise
        self.history: list[int] = []  # the target's tokens by position
        self._text: list[int] = []
        self._seen: dict[tuple, np.ndarray] = {}  # text -> the noisy logits (texts recur across draws)

    def reset(self) -> None:
        self.history = []
        super().reset()

    def keep(self, tokens, pos0, feats=None, trim=True) -> None:
        self.history[pos0:] = list(tokens)
        super().keep(tokens, pos0, feats, trim)

    def skip(self, tokens, pos0) -> None:
        self.history[pos0:] = list(tokens)
        super().skip(tokens, pos0)

    def draft(self, id_last, n_max, judge=None, p_min=0.0, sampler=None, n_alt=0, native=None):
        self._text = self.history + [id_last]
        return super().draft(id_last, n_max, judge, p_min, sampler, n_alt, native)

    def _choose(self, logits, sampler, qs, alts=None, n_alt=0):
        key = tuple(self._text)
        if key not in self._seen:
            z = target_logits(self.mirror, self._text)  # [n_vocab]
            z += np.random.default_rng(self._text).normal(size=z.size).astype(np.float32) * self.noise
            self._seen[key] = z
        token, conf = super()._choose(self._seen[key], sampler, qs, alts, n_alt)
        self._text.append(token)
        return token, conf


def exact_prefixes(ctx, prompt: list[int], t: Transform, n: int, eog=None) -> dict[tuple, float]:
    """Target-only probabilities of the first n generated tokens; with `eog` (a model), a generation that
    meets an end-of-generation token ends there (the cell ends in EOG)."""
    cells = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for cell, pr in cells.items():
            if cell and cell[-1] == EOG:
                nxt[cell] = pr
                continue
            p = t.dist(target_logits(ctx, prompt + list(cell)))
            for tok, q in zip(p.ids.tolist(), p.probs.tolist()):
                key = cell + ((EOG,) if eog is not None and is_eog(eog, tok) else (tok,))
                nxt[key] = nxt.get(key, 0.0) + pr * q
        cells = nxt
    return cells


def chi_square_cells(counts: Counter, exact: dict[tuple, float]) -> float:
    assert set(counts) <= set(exact), set(counts) - set(exact)
    keys = sorted(exact)
    return chi_square_p(np.array([counts[k] for k in keys]), np.array([exact[k] for k in keys]))


@dataclass
class Draws:
    counts: Counter  # first three generated tokens -> draws
    accepted: int
    drafted: int
    tree_cycles: int = 0


def decode_many(session, decoder, prompt, n_draws: int, spec_sampling: str, sampling: dict, k: int = 2,
                n_predict: int | None = None, **tree) -> Draws:
    cfg = GenerateConfig(n_predict=n_predict or k + 2, draft_max=k, draft_policy="fixed", spec_sampling=spec_sampling,
                         **tree)
    out = Draws(Counter(), 0, 0)
    for seed in range(n_draws):
        r = decoder.generate(prompt, cfg, Sampler(seed=seed, **sampling))
        toks = tuple(r.tokens[:3]) + ((EOG,) if r.stats.stop_reason == "eos" and len(r.tokens) < 3 else ())
        out.counts[toks] += 1
        out.accepted += r.stats.n_accepted
        out.drafted += r.stats.n_drafted
        out.tree_cycles += r.stats.tree_cycles
    return out


@pytest.fixture(scope="module")
def mirror_draws(tiny_pair, mirror_ctx):
    prompt = tokenize(tiny_pair.target_model, "Once upon a time, in a small village,")
    with MirrorSession(tiny_pair.target, tiny_pair.head, mirror=mirror_ctx, noise=0.5) as s, \
            Runner(tiny_pair.target, s) as d:
        draws = {rule: decode_many(s, d, prompt, 1500, rule, HOT3) for rule in ("rejection", "match")}
    exact = exact_prefixes(mirror_ctx, prompt, Sampler(**HOT3).transform, 3, eog=tiny_pair.target_model)
    return draws, exact


def test_decoder_rejection_sampling_is_target_only_sampling(mirror_draws):
    """1,500 seeds through Runner.generate (K = 2, a head close to the target): the first three generated
    tokens (the prefill's and the first cycles') follow target-only sampling jointly (chi-square
    p > 0.01), and drafts are kept."""
    draws, exact = mirror_draws
    rej = draws["rejection"]
    assert rej.accepted > 0.3 * rej.drafted
    assert chi_square_cells(rej.counts, exact) > 0.01
    assert chi_square_cells(draws["match"].counts, exact) > 0.01


def test_decoder_rejection_keeps_more_drafts_than_match(mirror_draws):
    draws, _ = mirror_draws
    rej, match = draws["rejection"], draws["match"]
    assert rej.accepted / rej.drafted > match.accepted / match.drafted


def test_trees_under_rejection_sampling_are_target_only_sampling(tiny_target, tiny_head, mirror_ctx):
    """Draft trees (top-2, 4 nodes, 2 deep) at T > 0 with spec_sampling rejection, the random head (nearly always
    wrong): 1,500 seeds, the first three generated tokens follow target-only sampling (chi-square p > 0.01)."""
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=256, n_batch=64, n_threads=1, n_seq_max=5)) as pair:
        prompt = tokenize(pair.target_model, "Once upon a time, in a small village,")
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            draws = decode_many(s, d, prompt, 1500, "rejection", HOT3, draft_topk=2, draft_nodes=4)
        exact = exact_prefixes(mirror_ctx, prompt, Sampler(**HOT3).transform, 3, eog=pair.target_model)
    assert draws.tree_cycles >= 1500
    assert chi_square_cells(draws.counts, exact) > 0.01


@pytest.mark.slow
def test_smollm2_trees_under_rejection_sampling_are_target_only_sampling(smollm2_path):
    """The real pair with trees (top-2, 4 nodes, 2 deep), 400 seeds, spec_sampling rejection: the first three
    generated tokens follow target-only sampling (chi-square p > 0.01), and tree nodes are kept."""
    from eagle3_gguf.assets import default_head_path
    from eagle3_gguf.tokens import chat_tokens

    sampling = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=1, n_seq_max=5)) as pair:
        prompt = chat_tokens(pair.target_model, "Write a short poem about the sea.")
        exact = exact_prefixes(pair.target, prompt, Sampler(**sampling).transform, 3, eog=pair.target_model)
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            # 6 tokens: the first cycle may draft 4 (n_predict - 1 - 1), so its tree has all 4 nodes, more than
            # its chain of 2 can hold: a tree in every draw, however the head ranks its candidates (at 4 tokens
            # the budget capped the tree at 2 nodes, a tree only where the head ranked a runner-up over its chain)
            draws = decode_many(s, d, prompt, 400, "rejection", sampling, n_predict=6, draft_topk=2, draft_nodes=4)
    assert draws.tree_cycles >= 400 and draws.accepted > 0.1 * draws.drafted
    assert chi_square_cells(draws.counts, exact) > 0.01


@pytest.mark.slow
def test_smollm2_rejection_is_target_only_sampling(smollm2_path):
    """The real pair (SmolLM2 + the shipped head), 400 seeds, K = 2: the first three generated tokens
    follow target-only sampling (chi-square p > 0.01), with drafts kept."""
    from eagle3_gguf.assets import default_head_path
    from eagle3_gguf.tokens import chat_tokens

    sampling = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=1)) as pair:
        prompt = chat_tokens(pair.target_model, "Write a short poem about the sea.")
        exact = exact_prefixes(pair.target, prompt, Sampler(**sampling).transform, 3, eog=pair.target_model)
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            rej = decode_many(s, d, prompt, 400, "rejection", sampling)
    assert rej.accepted > 0.1 * rej.drafted
    assert chi_square_cells(rej.counts, exact) > 0.01


def test_greedy_is_unchanged_by_rejection(tiny_pair):
    prompt = tokenize(tiny_pair.target_model, "The capital of France is")
    with Eagle3Session(tiny_pair.target, tiny_pair.head) as s, Runner(tiny_pair.target, s) as d:
        base = d.generate(prompt, GenerateConfig(n_predict=40), speculative=False)
        for rule in ("rejection", "match"):
            cfg = GenerateConfig(n_predict=40, draft_max=4, draft_policy="fixed", spec_sampling=rule)
            spec = d.generate(prompt, cfg)
            assert spec.tokens == base.tokens and spec.stats.n_drafted > 0
            assert spec.stats.spec_sampling == "greedy"


def test_decoder_switches_between_graph_argmax_and_logits(smollm2_path, monkeypatch):
    """Greedy runs take the argmax in the target's graph where its output layer is on a GPU (forced here: this
    is the CPU) and sampled runs read the logits, on one Runner in any order: each run gives what it gives alone,
    with drafts kept; on the CPU, greedy runs read the logits too."""
    from eagle3_gguf import decode
    from eagle3_gguf.assets import default_head_path

    cfg = GenerateConfig(n_predict=40, draft_max=4, draft_policy="fixed")
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
        prompt = tokenize(pair.target_model, "Count from 1 to 50: 1, 2, 3, 4, 5,")
        on_cpu = d.generate(prompt, cfg)
        assert not decode.greedy_in_graph(pair.target) and not pair.target.greedy_sampling
        monkeypatch.setattr(decode, "greedy_in_graph", lambda target: True)
        greedy = d.generate(prompt, cfg)
        assert pair.target.greedy_sampling and greedy.stats.n_accepted > 0 and greedy.tokens == on_cpu.tokens
        sampled = d.generate(prompt, cfg, Sampler(temperature=0.8, seed=7))
        assert not pair.target.greedy_sampling and sampled.stats.n_accepted > 0
        assert d.generate(prompt, cfg).tokens == greedy.tokens
        assert d.generate(prompt, cfg, Sampler(temperature=0.8, seed=7)).tokens == sampled.tokens
        assert d.generate(prompt, cfg, speculative=False).tokens == greedy.tokens


def test_greedy_runs_take_the_graphs_argmax_where_the_output_layer_is_on_a_local_gpu():
    from types import SimpleNamespace

    from eagle3_gguf.decode import greedy_in_graph
    from eagle3_gguf.native import Placement

    def on(devices, offloaded, n_layers=31):
        placement = Placement(devices, offloaded, n_layers)
        return greedy_in_graph(SimpleNamespace(model=SimpleNamespace(placement=placement)))

    assert on(("CUDA0 (NVIDIA H200)",), 31)
    assert not on(("CUDA0 (NVIDIA H200)",), 30)  # the output layer on the CPU
    assert not on((), 0)
    assert not on(("RPC0 (127.0.0.1:50052)",), 31)  # each sampled row read back with a round trip of its own


def test_a_cost_curve_is_measured_and_cached_for_what_the_cycles_read(smollm2_path, monkeypatch, tmp_path):
    """Calibration times a verify as the run's cycles read it back: the graph's choices (forced here: the GPU's
    path) and the logits (the CPU's) each get a curve of their own, measured and cached; the exactness probe,
    which compares logits, leaves the graph's argmax on behind it."""
    import json

    from eagle3_gguf import decode
    from eagle3_gguf.assets import default_head_path

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))
    cfg = GenerateConfig(n_predict=40, draft_max=4)  # the adaptive policy, chains (draft_topk 1)
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=2)) as pair:
        prompt = tokenize(pair.target_model, "Count from 1 to 50: 1, 2, 3, 4, 5,")
        with Runner(pair.target) as plain:
            base = plain.generate(prompt, cfg, speculative=False)
        for reads, in_graph in (("graph", True), ("logits", False)):
            monkeypatch.setattr(decode, "greedy_in_graph", lambda target, g=in_graph: g)
            with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
                run = d.generate(prompt, cfg)
            assert pair.target.greedy_sampling == in_graph and run.tokens == base.tokens, reads
            assert run.stats.policy.cost_source == "measured" and run.stats.exact.source == ("probed" if in_graph
                                                                                          else "cache"), reads
    saved = [json.loads(p.read_text())["key"]["setup"] for p in (tmp_path / "costs").glob("*.json")]
    # what the target's verify rows read (the key goes on to how the head's drafts may read: its graph or logits)
    assert sorted(k.rsplit(" reads ", 1)[1].split(",")[0] for k in saved if " reads " in k) == ["graph", "logits"]


def test_a_run_prepared_beforehand_keeps_a_curve_timed_as_its_cycles_read(smollm2_path, monkeypatch, tmp_path):
    """Runner.prepare (the CLI's and the bench's, before any text) attaches the target's graph picks as the run will
    (forced here: the GPU's path), so the curve it times reads the graph; a curve timed otherwise (the Speculator's
    own prepare, which attaches nothing) is timed again for a run that reads the other way."""
    import json

    from eagle3_gguf import decode
    from eagle3_gguf.assets import default_head_path

    def reads() -> list[str]:
        keys = [json.loads(p.read_text())["key"]["setup"] for p in (tmp_path / "costs").glob("*.json")]
        return sorted(k.rsplit(" reads ", 1)[1].split(",")[0] for k in keys)  # the target's verify rows

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))
    monkeypatch.setattr(decode, "greedy_in_graph", lambda target: True)
    cfg = GenerateConfig(n_predict=24, draft_max=4, draft_topk=4, draft_nodes=8)  # generate's default
    with load_pair(smollm2_path, default_head_path(), PairConfig(n_ctx=512, n_threads=2,
                                                                 n_seq_max=cfg.tree_sequences)) as pair:
        prompt = tokenize(pair.target_model, "Count from 1 to 50: 1, 2, 3, 4, 5,")
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            d.prepare(cfg)
            assert pair.target.greedy_sampling and reads() == ["graph"]
            assert d.generate(prompt, cfg).stats.policy.cost_source == "measured" and reads() == ["graph"]
        pair.target.set_greedy_sampling(False)
        with Eagle3Session(pair.target, pair.head) as s, Runner(pair.target, s) as d:
            d.spec.prepare(cfg)  # timed reading the logits
            assert reads() == ["graph", "logits"]
            run = d.generate(prompt, cfg)
            assert pair.target.greedy_sampling and run.stats.policy.cost_source == "cache"  # the graph's again


def test_generate_config_checks():
    with pytest.raises(Eagle3Error, match="spec_sampling must be rejection or match \\(got typical\\)"):
        GenerateConfig(spec_sampling="typical")
    for bad in (-0.5, float("nan")):
        with pytest.raises(Eagle3Error, match=r"must be a number, 0 or more \(got"):
            GenerateConfig(draft_temp_scale=bad)


# -- the CLI --------------------------------------------------------------------------------------------------
def invoke(*args: str):
    from typer.testing import CliRunner

    from eagle3_gguf.cli.main import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("flags, expected", [
    (["--spec-sampling", "typical"], "--spec-sampling must be rejection or match (got typical)"),
    (["--temp", "0.8", "--spec-sampling", "match", "--draft-temp-scale", "0.5"],
     "--draft-temp-scale shapes the rejection rule's draft distribution: it has no effect with --spec-sampling match"),
    (["--draft-temp-scale", "0.5"], "--draft-temp-scale needs --temp > 0 (at --temp 0 drafts and tokens are greedy)"),
    (["--temp", "0.8", "--draft-temp-scale", "-1"], "--draft-temp-scale must be a number, 0 or more (got -1.0)"),
])
def test_cli_bad_spec_sampling_flags(tiny_target, tiny_head, flags, expected):
    r = invoke("generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "hi", *flags)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [f"error: {expected}"]


def test_cli_samples_by_rejection_by_default(tiny_target, tiny_head):
    import json

    base = ["generate", "-m", str(tiny_target), "--draft", str(tiny_head), "-p", "Once upon a time", "-n", "24",
            "--temp", "1.5", "--seed", "3", "-t", "1", "--draft-p-min", "0",
            "--baseline", "--json", "--draft-policy", "fixed"]
    r = invoke(*base)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["stats"]["spec_sampling"].startswith("rejection") and d["stats"]["n_drafted"] > 0
    assert d["identical"] is None  # the target's distribution, not target-only's draws
    r = invoke(*base, "--spec-sampling", "match")
    d = json.loads(r.stdout)
    assert d["stats"]["spec_sampling"] == "match" and d["identical"] is True
    r = invoke(*base[:-3], "--draft-policy", "fixed")  # streamed: the table names the rule
    assert r.exit_code == 0 and "verification" in r.stderr and "identical output   n/a" in r.stderr


# -- the drop-in ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(tiny_target, tiny_head):
    import llama_cpp

    from eagle3_gguf.llama import Eagle3Llama
    from eagle3_gguf.native import CACHE_TYPES

    kw = dict(n_ctx=512, n_batch=64, n_threads=1, n_threads_batch=1, seed=1234, verbose=False, flash_attn=True,
              type_v=CACHE_TYPES["bf16"])
    plain = llama_cpp.Llama(model_path=str(tiny_target), **kw)
    rej = Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed", draft_max=4,
                      spec_sampling="rejection", **kw)
    yield plain, rej
    rej.close()
    plain.close()


HOT = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)


def text_of(r) -> str:
    return r["choices"][0]["text"]


def test_dropin_greedy_is_plain_llama(llms):
    plain, rej = llms
    for prompt in ("The capital of France is", "def fibonacci(n):\n    "):
        assert text_of(plain(prompt, max_tokens=24, temperature=0.0)) == text_of(rej(prompt, max_tokens=24,
                                                                                     temperature=0.0))
        assert rej.spec_stats.spec_sampling == "greedy" and rej.spec_stats.n_drafted > 0


def test_dropin_rejection_is_seeded(llms):
    _, rej = llms
    prompt = "Once upon a time, in a small village,"
    a = text_of(rej(prompt, max_tokens=30, seed=7, **HOT))
    assert rej.spec_stats.spec_sampling.startswith("rejection") and rej.spec_stats.n_drafted > 0
    assert text_of(rej(prompt, max_tokens=30, seed=7, **HOT)) == a
    assert text_of(rej(prompt, max_tokens=30, seed=8, **HOT)) != a


def test_dropin_falls_back_to_match_where_the_chain_is_not_closed_form(llms):
    """A grammar, logit_bias (a logits processor), penalties: exact match, the same text as plain Llama
    for the same seed, and the statistics say why."""
    import llama_cpp

    plain, rej = llms
    prompt = "The capital of France is"
    grammar = 'root ::= [a-z ]+ "." [a-z ]*'
    cases = [(dict(grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False)), "a grammar"),
             (dict(logit_bias={100: 2.0}), "logits processors"),
             (dict(repeat_penalty=1.3), "repetition penalties")]
    for extra, why in cases:
        a = plain(prompt, max_tokens=20, seed=5, **HOT, **extra)
        if "grammar" in extra:
            extra = dict(grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False))
        b = rej(prompt, max_tokens=20, seed=5, **HOT, **extra)
        assert text_of(a) == text_of(b)
        assert rej.spec_stats.spec_sampling.startswith("match (rejection needs a closed-form sampler") \
            and why in rej.spec_stats.spec_sampling


def test_dropin_rejection_is_target_only_sampling(tiny_target, tiny_head, mirror_ctx):
    """1,500 seeds through Eagle3Llama.generate with a head close to the target: the first three tokens
    follow target-only sampling, and drafts are kept."""
    from contextlib import closing

    from eagle3_gguf.llama import Eagle3Llama
    from eagle3_gguf.native import CACHE_TYPES

    kw = dict(n_ctx=512, n_batch=64, n_threads=1, n_threads_batch=1, verbose=False, flash_attn=True,
              type_v=CACHE_TYPES["bf16"])
    with closing(Eagle3Llama(model_path=str(tiny_target), draft_model_path=tiny_head, draft_policy="fixed",
                             draft_max=2, spec_sampling="rejection", **kw)) as llm:
        llm._e3_session.close()
        llm._e3_session = MirrorSession(llm._e3_pair.target, llm._e3_pair.head, mirror=mirror_ctx, noise=0.5)
        llm._e3_head_tokens.clear()
        tokens = llm.tokenize(b"Once upon a time, in a small village,")
        counts, accepted = Counter(), 0
        for seed in range(1500):
            llm.set_seed(seed)
            with closing(llm.generate(tokens, temp=1.5, top_k=3, top_p=1.0, min_p=0.0)) as gen:
                counts[(next(gen), next(gen), next(gen))] += 1
            accepted += llm.spec_stats.n_accepted
    exact = exact_prefixes(mirror_ctx, tokens, Transform(1.5, 3, 1.0, 0.0), 3)
    assert accepted > 300
    assert chi_square_cells(counts, exact) > 0.01
