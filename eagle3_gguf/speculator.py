"""The one speculative run: prefill, then draft → verify in one target batch → keep the longest agreeing prefix.

`Speculator.run(prompt, hooks, config)` owns a generation from the prompt to its end and yields its cycles;
every surface drives this one run (`decode.Runner` for the CLI and the benchmarks, `llama.Eagle3Llama` for the
drop-in and through it the parallel slots of slots.py). What differs between them is small, and it is all in
`RunHooks`: how a row's token is chosen (the graph's argmax, a numpy sampler, llama-cpp-python's sampler
chain), how far a run may go, and what a surface mirrors of each cycle (llama-cpp-python's `input_ids`).

A cycle: the policy sets the draft budget, the head drafts (the policy judging each step), the target decodes
[id_last, d1..dk] in one batch with logits on every row. Row i holds the target's own choice after d1..di:
drafts are accepted while they equal that choice (or, with rejection sampling, by the rule of
spec_sampling.py), and the choice at the first disagreement (or after the last draft) is the cycle's own
token. Rejected rows leave the target's cache; only the kept rows reach the head. Each emitted token is the
target's own choice, so greedy text is the target's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .batch import Batch
from .config import DraftConfig
from .context import Context
from .errors import Eagle3Error
from .exactness import ExactWidths, load_exact, probe, save_exact
from .costs import DENSE_ROWS, CostCurve, CostKey, load_costs, measure, save_costs
from .policy import AdaptivePolicy, DraftPolicy, FixedPolicy
from .lookup import Lookup, LookupIndex
from .draft import Draft, NativeJudge
from .session import Eagle3Session
from .spec_sampling import RejectionSampler, one_hot, verify_match
from .stats import ExactReport, SpecStats, StageClock
from .tokens import eog_check
from .tree import DraftTree, TreeWalk, walk

# what is measured at load where the cache has no answer (seconds at 135M on 2 cores, a minute or more at 8B): the CLI
# shows these INFO lines, so that a first run's wait says what it is
log = logging.getLogger(__name__)
MEASURING_EXACT = "measuring which verify batch widths compute exactly as lone rows here (cached for later runs)"
MEASURING_COSTS = "measuring what verify rows and draft steps cost here (cached for later runs)"
HEAD_STEPS = 4  # the draft auto's timings compare the head's two readings on (generate's --draft-max)


@dataclass(frozen=True)
class HeadAsk:
    """What a speculator's runs ask of the head's graph (Speculator._choose_head)."""

    k: int  # the tokens it may choose a draft step (0: numpy reads the head's logits)
    auto: bool  # whether it chooses only where that drafted faster as the cost curve was measured


@dataclass(slots=True)
class Cycle:
    """One draft → verify cycle (or a run's first token: no rows of its own)."""

    pos: int  # target position of rows[0] (id_last)
    rows: list[int]  # [id_last, d1..dk]: what the target decoded (a tree cycle: id_last and the kept nodes)
    out: list[int]  # the target's choices: the accepted drafts, then the cycle's own token
    n_acc: int  # accepted drafts


class RunHooks:
    """What a surface adds to the one run. Subclasses choose tokens (first_token, pick) and say how far a
    run may go (budget); the mirror hooks are optional."""

    prefill_logits = "last"  # the prefill batch's output rows: "last" or "all"

    def first_token(self, row: int) -> int:
        """The token after the prompt, from row `row` of the prefill's last chunk."""
        raise NotImplementedError

    def pick(self, rows: list[int], pos: int, i: int) -> int:
        """The target's choice at verify row i of `rows` (decoded at pos..)."""
        raise NotImplementedError

    def pick_tree(self, rows: list[int], pos: int, i: int) -> int:
        """pick, at a draft tree's row (where the target's graph chooses sequence 0's tokens, a row carrying other
        sequences may have none chosen: llama.cpp then hands its logits back)."""
        return self.pick(rows, pos, i)

    def budget(self, pos: int, st: SpecStats) -> int | None:
        """Tokens a cycle at `pos` may draft (a cap; the policy chooses), or None to end the run (setting
        st.stop_reason)."""
        raise NotImplementedError

    def on_rewind(self, pos0: int) -> None:
        """The caches now hold the prompt's first pos0 positions; the prefill starts there."""

    def on_prefill(self, chunk: list[int], pos0: int) -> None:
        """Right after each prefill chunk's decode."""

    def on_cycle(self, cyc: Cycle) -> None:
        """Right after a cycle's verification, before it is yielded."""


class Speculator:
    """A target context and (for speculation) a head session: the one run, its cycle and its cost curve.
    Without a session every cycle is plain decoding of one row."""

    def __init__(self, target: Context, session: Eagle3Session | None, n_batch: int | None = None,
                 owns_session: bool = True):
        """The speculator closes the session with itself unless owns_session is False."""
        self.target = target
        self.session = session
        self._owns_session = owns_session
        self.batch = Batch(n_batch or target.n_batch, n_seq_max=target.n_seq_max)
        self.seq = 0  # the target sequence this speculator decodes (slots.py runs one per sequence)
        self.trees = True  # may verify draft trees (a sequence per branch of its own unified cache)
        self.row0 = 0  # where its rows start in the target's last batch (0 unless sequences share it)
        self.k_fit = self.batch.capacity - 1  # drafts that fit in one verify batch
        self.k_limit = self.k_fit  # drafts a cycle may verify: k_fit, or fewer to keep to exact widths (policy_for)
        self.exact: ExactWidths | None = None  # what the exactness probe found (exactness.py)
        self.is_end = eog_check(target.model)  # remembers per token across generations
        self.costs: CostCurve | None = None
        self._adaptive: AdaptivePolicy | None = None
        self.index = LookupIndex()  # prompt + generated tokens of the last run, for lookup drafts
        # whether the head's graph chooses its drafts' tokens where a run allows (choice.py, Eagle3Session.
        # choose_in_graph) or numpy reads its logits: "auto", whichever drafted faster when the cost curve was
        # measured; "on" / "off" (a benchmark's contenders, to time the two apart)
        self.head_choice = "auto"
        self._head_ask = HeadAsk(0, False)  # what this speculator's runs ask of the head's graph (_choose_head)
        self._costs_ask = HeadAsk(0, False)  # the ask `costs` was calibrated for (its draft steps timed so)
        self._costs_graph_picks = False  # whether the target's graph chose the verify rows' tokens as `costs` was timed
        # a draft tree's kept branch nodes, decoded again at the head of the next cycle's batch (tree.py), and
        # the position of the first: the target's cache holds the positions before it
        self._redo: list[int] = []
        self._redo_at = 0

    def close(self) -> None:
        self.batch.close()
        if self.session is not None and self._owns_session:
            self.session.close()

    def __enter__(self) -> "Speculator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the target sequence (slots.SlotSpeculator decodes in a batch shared with other sequences) --------
    def decode(self, batch: Batch) -> None:
        self.target.decode(batch)

    def batch_row(self, i: int) -> int:
        """Where row i of this speculator's rows sits in the target's last batch."""
        return self.row0 + i

    def logits_ith(self, i: int) -> np.ndarray:
        """The logits of row i of this speculator's rows in the last decode.  # [n_vocab]"""
        return self.target.logits_ith(self.row0 + i)

    def clear_target(self) -> None:
        """Empty the target's cache of this speculator's sequence."""
        self.target.clear()

    def seq_rm(self, p0: int, p1: int = -1) -> bool:
        """Drop positions p0..p1 of this speculator's sequence from the target's cache."""
        return self.target.seq_rm(self.seq, p0, p1)

    def native_time(self) -> float:
        """Seconds spent in llama.cpp so far: the target's decodes and the head's."""
        draft = self.session.draft_ctx.t_native if self.session is not None else 0.0
        return self.target.t_native + draft

    # -- the policy ----------------------------------------------------------------------------------
    def _lookup_max(self, config: DraftConfig, limit: int | None = None) -> int:
        """A lookup draft's cap for config (0: no lookup drafts; the fixed policy verifies none), at most `limit`
        drafts (default: k_limit)."""
        lookup = config.draft_lookup and config.draft_policy == "adaptive"
        return min(config.draft_lookup_max, self.k_limit if limit is None else limit) if lookup else 0

    def _drafts_max(self, config: DraftConfig, limit: int | None = None) -> int:
        """The most rows after id_last a cycle may verify with config (head, lookup or tree), at most `limit`
        (default: k_limit): the cost curve's length and the probe's widest width less one. A tree cycle after one
        that kept a branch decodes that branch again first, then a whole tree: a fixed tree's branch reaches as deep
        as the tree, the adaptive policy's are leaves beside its chain (tree.py)."""
        limit = self.k_limit if limit is None else limit
        redo = 0 if config.draft_topk == 1 else \
            min(config.draft_max, config.tree_nodes) if config.draft_policy == "fixed" else 1
        tree = config.tree_nodes + redo
        head = max(min(config.draft_max, limit), min(tree, limit)) if config.draft_head else 0
        return max(head, self._lookup_max(config, limit))

    def _needs_probe(self, config: DraftConfig) -> bool:
        rows = self._drafts_max(config, self.k_fit) + 1
        return config.exact != "off" and (self.exact is None or not self.exact.covers(rows))

    def needs_calibration(self, config: DraftConfig) -> bool:
        """Whether policy_for(config) measures something first (the exactness probe or the cost curve), which
        clears the target's and the head's caches."""
        if self._needs_probe(config):
            return True
        k = self._drafts_max(config, self._exact_limit(config))
        costs = self.costs
        # a run whose head may choose in its graph needs a curve timed for that ask (auto: its comparison made); one
        # that reads the logits (sampled, a fixed tree) takes the curve as it is, its step price refined online, so
        # that greedy and sampled requests in turn do not time it again at each change
        head = self._head_ask.k > 0 and self._costs_ask != self._head_ask
        timed_otherwise = head or self._costs_graph_picks != self.target.greedy_sampling
        return config.draft_policy == "adaptive" and k > 0 and (
            costs is None or costs.k_max < k or (timed_otherwise and costs.source != "given"))  # a given curve stays

    def _exact_limit(self, config: DraftConfig) -> int:
        """The drafts a cycle may verify under config's exactness mode (the probe has run where it must): widths
        up to the exact ones; all where none above 1 is exact and the mode is auto (as upstream; the run says so)."""
        found = self.exact
        if config.exact == "off" or found is None:
            return self.k_fit
        if found.exact >= 2 or config.exact == "strict":
            return min(self.k_fit, max(found.exact - 1, 0))
        return self.k_fit

    def exact_report(self, config: DraftConfig) -> ExactReport:
        """The statistics' account of exactness for a run with config (after policy_for)."""
        found, rows_max = self.exact, self.k_limit + 1
        if config.exact == "off" or found is None:
            return ExactReport(config.exact, rows_max=rows_max)
        kept = rows_max <= max(found.exact, 1)  # one row: plain decoding, extraction off (target-only itself)
        return ExactReport(config.exact, found.probed, found.exact, found.depths, found.source, found.seconds, kept,
                           rows_max, found.parts_at)

    def prepare(self, config: DraftConfig) -> ExactReport:
        """Probe and calibrate for config now, as the next (greedy) run would first: what it found about exactness."""
        self._choose_head(config, None)
        self.policy_for(config)
        return self.exact_report(config)

    def probe_exact(self, rows: int) -> ExactWidths:
        """Which verify widths up to `rows` this set-up computes exactly (exactness.py), from the cache or probed
        now and cached. CLEARS the target's cache (and the head's)."""
        session = self.session
        key = CostKey.for_contexts(self.target, session.draft_ctx, self.batch.capacity)
        found = load_exact(key, rows)
        if found is None:
            log.info(MEASURING_EXACT)
            session.reset()
            found = probe(self.target, session.extract.enable, rows, self.batch)
            save_exact(key, found)
        return found

    def policy_for(self, config: DraftConfig) -> DraftPolicy | None:
        """The policy for a generation (None: no verify width above one row may be used, --exact strict). The
        adaptive one persists (what it learnt carries over); its cost curve comes from the cache or a
        calibration, and the verify widths it may use from the exactness probe; both CLEAR the target's and the
        head's caches: callers check needs_calibration() while the caches hold nothing they need."""
        if self._needs_probe(config):
            self.exact = self.probe_exact(self._drafts_max(config, self.k_fit) + 1)
        limit = self._exact_limit(config)
        if limit != self.k_limit:
            self.k_limit, self._adaptive = limit, None
        if limit == 0:
            return None
        k, n_lookup = min(config.draft_max, self.k_limit), self._lookup_max(config)
        nodes, topk = min(config.tree_nodes, self.k_limit), config.draft_topk
        if not config.draft_head:  # lookup drafts only: the head never drafts, in chains or trees
            k, nodes, topk = 0, 0, 1
        if topk > 1:
            self._check_tree(config)
        if config.draft_policy == "fixed":
            policy: DraftPolicy = FixedPolicy(k, config.draft_p_min, topk, nodes)
        else:
            if self.needs_calibration(config):
                self.costs = self.calibrate(self._drafts_max(config))
                self._adaptive = None
            shape = (k, n_lookup, topk, nodes)
            if self._adaptive is None or self._adaptive.shape != shape:
                self._adaptive = AdaptivePolicy(self.costs, k, self.session.window, lookup_max=n_lookup,
                                                topk=topk, nodes=nodes)
            policy = self._adaptive
        policy.begin()
        return policy

    def _check_tree(self, config: DraftConfig) -> None:
        """A draft tree needs sequences in the target's and the head's unified caches (tree.py)."""
        n = config.tree_sequences
        if not self.trees:
            raise Eagle3Error("parallel slots draft chains: set draft_topk 1")
        have = min(self.target.n_seq_max, self.session.draft_ctx.n_seq_max)
        if have < n:
            raise Eagle3Error(f"a draft tree of top-{config.draft_topk}, {config.tree_nodes} tokens needs contexts "
                              f"with {n} sequences (these have {have}): PairConfig(n_seq_max={n}), as "
                              "`generate --draft-topk` opens them; Eagle3Llama and serve draft chains (draft_topk=1)")

    def calibrate(self, k_max: int, dense_rows: int = DENSE_ROWS) -> CostCurve:
        """The cost curve from the cache, or measured now (a fraction of a second) and cached; every verify
        size up to `dense_rows` rows timed (costs.measure)."""
        target, session, ask = self.target, self.session, self._head_ask
        session.extract.enable(True)  # verify rows as a cycle decodes them
        key = CostKey.for_contexts(target, session.draft_ctx, self.batch.capacity,
                                   reads=("graph" if target.greedy_sampling else "logits")
                                   + (f", head graph {ask.k}" if ask.k else "") + (" or logits" if ask.auto else ""))
        cached = load_costs(key, k_max)
        if cached is not None and cached.head_k in (0, ask.k):
            session.choose_in_graph(cached.head_k)
            self._costs_ask, self._costs_graph_picks = ask, target.greedy_sampling
            return cached
        log.info(MEASURING_COSTS)
        tok = 0  # any token: the cost of a row does not depend on which
        feats = np.zeros((2, session.extract.width), np.float32)  # [2, 3 * n_embd_tgt]

        def run_verify(n: int) -> float:
            self.batch.set([tok] * n, 0, logits="all")
            t = time.perf_counter()
            target.decode(self.batch)
            if target.greedy_sampling:  # what a cycle then reads: the graph's choices
                for i in range(n):
                    target.sampled_token(i)
            else:
                logits = target.logits(n)  # [n, n_vocab]
                for i in range(n):
                    int(np.argmax(logits[i]))
            t = time.perf_counter() - t
            self.seq_rm(0)
            return t

        def run_draft(steps: int) -> float:
            """A draft as a cycle runs it: the head first catches up on two kept rows."""
            session.reset()
            session.process([tok] * 3, 0, np.zeros((3, session.extract.width), np.float32))
            session.draft(tok, 1, lambda confs, n_max: len(confs), native=NativeJudge)
            session.accept(0)
            session.keep([tok, tok], 3, feats)
            t = time.perf_counter()
            session.draft(tok, steps, lambda confs, n_max: len(confs) if len(confs) >= n_max else -1,
                          native=NativeJudge)  # p_min 0: all steps, as the loop pays them
            return time.perf_counter() - t

        target.clear()
        try:
            session.choose_in_graph(self._cheaper_head(ask.k, run_draft) if ask.auto else ask.k)
            curve = measure(run_verify, run_draft, k_max, dense_rows=dense_rows)
        finally:
            target.clear()
            session.reset()
        curve.head_k = session.chooses_in_graph
        self._costs_ask, self._costs_graph_picks = ask, target.greedy_sampling  # only once it is timed
        save_costs(key, curve)
        return curve

    def _cheaper_head(self, k: int, run_draft: Callable[[int], float], reps: int = 4) -> int:
        """k where the head's graph choosing k tokens a step drafts faster than numpy reading its logits, else 0
        (where the graph cannot choose, 0): a draft of HEAD_STEPS timed each way, in two blocks of `reps` each way,
        each after an untimed one (a change of output rebuilds the head's graph), the least of each."""
        times: dict[int, list[float]] = {0: [], k: []}
        for _ in range(2):
            for mode in (0, k):
                if self.session.choose_in_graph(mode) != (mode > 0):
                    return 0
                run_draft(HEAD_STEPS)
                times[mode] += [run_draft(HEAD_STEPS) for _ in range(reps)]
        return k if min(times[k]) < min(times[0]) else 0

    # -- the run -----------------------------------------------------------------------------------------
    def run(self, prompt: list[int], hooks: RunHooks, config: DraftConfig | None,
            rejection: RejectionSampler | None = None, spec_sampling: str = "", keep: int = 0) -> "Run":
        """A generation after `prompt`: speculative with `config` (and a session), else plain decoding.
        `keep`: how many prompt positions the caches already hold (they stay where both can keep them).
        `rejection`: verify drafts drawn from the head's q by rejection sampling instead of hooks.pick.
        `spec_sampling`: how drafts are verified, for the statistics. May calibrate (see policy_for)."""
        speculative = config is not None and config.draft_max > 0 and self.session is not None
        if speculative:
            self._choose_head(config, rejection)  # before calibrate() times draft steps
        if speculative and self.needs_calibration(config):
            keep = 0  # calibrating clears both caches
        policy = self.policy_for(config) if speculative else None
        exact = self.exact_report(config) if speculative else None
        speculative = policy is not None  # --exact strict where no width above 1 is exact: plain decoding
        if self.session is not None:
            self.session.extract.enable(speculative)  # a plain run needs no features: target-only's cost
        index = self.index if speculative and config.draft_lookup else None
        return Run(self, prompt, hooks, policy, rejection if speculative else None, spec_sampling if speculative else "",
                   keep, index, exact)

    def _choose_head(self, config: DraftConfig, rejection: RejectionSampler | None) -> None:
        """Set the tokens the head's graph chooses a draft step in this run (0: numpy reads its logits), on the
        session now (a head context may serve several speculators: a benchmark's contenders). The graph may choose
        for greedy chains of sequence 0 (rejection sampling draws from the logits; a fixed tree's depths run on
        several sequences): the argmax and the adaptive policy's runner-ups (draft_topk - 1). Where head_choice is
        auto, as the cost curve was measured for this ask (the cheaper), else by the logits until it is."""
        k = 0
        if self.head_choice != "off" and config.draft_max and rejection is None and self.seq == 0:
            k = config.draft_topk if config.draft_policy == "adaptive" else int(config.draft_topk == 1)
        ask = HeadAsk(k, self.head_choice == "auto" and k > 0)
        self._head_ask = ask
        if ask.auto:
            calibrated = self.costs is not None and self._costs_ask == ask and self.costs.source != "given"
            k = self.costs.head_k if calibrated else 0
        self.session.choose_in_graph(k)

    def rewind(self, keep: int, speculative: bool) -> int:
        """Keep the first `keep` positions in the target's cache (and the head's, speculative), or clear
        both where they cannot cut there: the positions kept."""
        if self._redo:  # the cache ends before the last tree cycle's kept branch
            keep = min(keep, self._redo_at)
            self._redo = []
        if keep > 0 and self.seq_rm(keep) and (not speculative or self.session.truncate(keep)):
            return keep
        self.clear_target()
        if self.session is not None:
            self.session.reset()
        return 0

    def prefill(self, tokens: list[int], pos0: int, feed_head: bool, whole: bool = True, logits: str = "last",
                on_chunk: Callable[[list[int], int], None] | None = None) -> int:
        """Decode tokens at pos0.. in n_batch chunks (each chunk's rows go to the head when feed_head:
        all of them when `whole`, else only the last `window` rows, set aside for the first draft).
        `logits` is the batch's output rows ("last" or "all"); `on_chunk(chunk, pos)` runs right after each
        chunk's decode. Returns the size of the last chunk (its last row holds the next token's logits)."""
        n_batch = self.batch.capacity
        m = 0
        for i in range(0, len(tokens), n_batch):
            chunk = tokens[i:i + n_batch]
            m = len(chunk)
            self.batch.set(chunk, pos0 + i, logits=logits)
            self.decode(self.batch)
            if on_chunk is not None:
                on_chunk(chunk, pos0 + i)
            if feed_head and whole:
                self.session.process(chunk, pos0 + i)
            elif feed_head:
                self.session.keep(chunk, pos0 + i)
        return m

    def cycle(self, policy: "DraftPolicy | None", id_last: int, pos: int, k_cap: int,
              pick: Callable[[list[int], int, int], int], st: SpecStats,
              rejection: RejectionSampler | None = None, index: LookupIndex | None = None,
              pick_tree: Callable[[list[int], int, int], int] | None = None) -> Cycle:
        """One cycle at `pos`. The drafts come from the lookup `index` where the policy prefers its proposal,
        else from the head as the policy plans. With `rejection`, head drafts are drawn from q (a lookup
        draft's q is one-hot) and the rows are verified by rejection sampling (`pick` is not called);
        otherwise drafts are kept while `pick(rows, pos, i)` equals them (`pick_tree` at a tree's rows; default:
        pick). An end-of-generation token ends the cycle as its own token."""
        session = self.session if policy is not None else None
        found, k, seedless = None, 0, False
        redo = self._redo
        if session is not None:
            k_cap = min(k_cap, self.k_limit - len(redo))  # the rows to redo come first in the batch
            if index is not None and k_cap > 0:
                t = time.perf_counter()
                found = index.propose(k_cap)
                j = policy.lookup(found, k_cap) if found is not None else 0
                found = Lookup(found.tokens[:j], found.n) if j else None
                st.t_lookup += time.perf_counter() - t
            if found is None:
                k = policy.plan(k_cap)
                # every row skipped since a reset or a cut (a new prompt sharing a prefix) leaves the head nothing to
                # seed a draft from: the cycle is plain, and its row is kept for the next
                if k and not session.can_seed:
                    k, seedless = 0, True
        if k == 0 and found is None and rejection is None and not redo:
            # A plain cycle, the common one: it runs right after the target's graph has pushed everything
            # out of the caches, so it touches as little as it can (each step here costs microseconds).
            rows = [id_last]
            self.batch.set_one(id_last, pos)
            native0 = self.native_time()  # a slot's: its share of the joint decodes (slots.py)
            t = time.perf_counter()
            self.decode(self.batch)
            out = [pick(rows, pos, 0)]
            t_verify = time.perf_counter() - t
            st.t_target += t_verify
            st.t_target_native += self.native_time() - native0
            st.n_target_forwards += 1
            st.record_rows(1)
            if session is not None:
                st.accept_hist[0] += 1  # st.record_cycle(0, 0)
                native0 = self.native_time()
                t = time.perf_counter()
                if policy.keep_rows or seedless:
                    session.keep(rows, pos)
                else:
                    session.skip(rows, pos)
                st.t_process += time.perf_counter() - t
                st.t_process_native += self.native_time() - native0
                policy.observe_plain(t_verify)
            return Cycle(pos, rows, out, 0)
        draft, tree = None, None
        t_draft, t_steps = 0.0, None
        if found is not None:  # a deterministic proposal: q is one-hot at each draft
            draft = Draft(found.tokens, [], [one_hot(tok) for tok in found.tokens] if rejection is not None else [])
        elif k > 0:
            t, native0 = time.perf_counter(), session.draft_ctx.t_native
            aside0, steps0 = session.t_aside, session.t_steps
            if policy.expand:
                tree = session.draft_tree(id_last, k, policy.expand, min(policy.nodes, k_cap))
                draft = tree.chain_draft
                if rejection is not None:  # the head's likeliest tokens, not draws from q: one-hot proposals
                    draft.qs = [one_hot(tok) for tok in draft.tokens]
                tree = tree if tree.n_nodes > tree.chain else None  # a chain alone: verified as one
            else:
                draft = session.draft(id_last, k, policy.judge, sampler=rejection,
                                      n_alt=policy.n_alt if rejection is None else 0,
                                      native=policy.native_judge if rejection is None else None)
                tree = policy.tree(id_last, draft, k_cap) if draft.alt_tokens else None
                t_steps = session.t_steps - steps0
            t_draft = time.perf_counter() - t
            st.t_draft += t_draft
            st.t_draft_native += session.draft_ctx.t_native - native0
            t_draft -= session.t_aside - aside0  # what the policy learns from: the head's time alone
        drafts = draft.tokens if draft is not None else []
        native0 = self.native_time()
        t = time.perf_counter()
        o = len(redo)  # rows before id_last: the last tree cycle's kept branch
        pos0 = pos - o
        if tree is None:
            rows = [*redo, id_last, *drafts]
            self.batch.set(rows, pos0, logits="all")
            self.decode(self.batch)
            if rejection is not None:
                out = rejection.verify(drafts, draft.qs if drafts else [], lambda i: self.logits_ith(o + i),
                                       self.is_end)
            else:
                out = verify_match(drafts, lambda i: pick(rows, pos0, o + i), self.is_end)
            n_acc = on_chain = len(out) - 1
            if n_acc < len(drafts):
                self.seq_rm(pos + n_acc + 1)
            kept = rows[o:o + n_acc + 1]
            feat_rows = range(o, o + n_acc + 1) if o else None  # None: rows 0..n_acc, the session's default
            self._redo = []
        else:
            node_pick = (pick_tree or pick) if rejection is None else \
                (lambda _rows, _pos0, i: rejection.pick(self.logits_ith(i)))  # from this generation's stream
            w = self._verify_tree(tree, redo, pos, node_pick)
            out, n_acc, on_chain = w.out, w.n_acc, w.on_chain
            rows = kept = [id_last, *(tree.tokens[node] for node in w.path)]
            feat_rows = [o, *(o + node for node in w.path)] if o or on_chain < n_acc else None
            policy.observe_tree(tree, w.path)
        t_verify = time.perf_counter() - t
        st.t_target += t_verify
        st.t_target_native += self.native_time() - native0
        st.n_target_forwards += 1
        n_rows = o + 1 + (tree.n_nodes if tree is not None else len(drafts))
        st.record_rows(n_rows)
        if session is not None:
            st.record_cycle(len(drafts) if tree is None else max(tree.depths), n_acc)  # a tree: the depths drafted
            if tree is not None:
                st.record_tree(tree.n_nodes, on_chain < n_acc)
            native0 = self.native_time()
            t = time.perf_counter()
            if draft is not None and found is None:  # the head ran: its speculative entries go
                session.accept(n_acc)
            feats = None if feat_rows is None else session.features(feat_rows[-1] + 1, rows=np.asarray(feat_rows))
            if policy.keep_rows or seedless:
                session.keep(kept, pos, feats)
            else:
                session.skip(kept, pos)
            st.t_process += time.perf_counter() - t
            st.t_process_native += self.native_time() - native0
            if found is not None:
                st.record_lookup(len(drafts), n_acc)
                policy.observe_lookup(found.n, len(drafts), n_acc, t_verify, len(out), n_rows)
            else:
                confs = draft.confs if draft is not None else []
                policy.observe(confs, len(drafts), on_chain, len(confs), t_verify, t_draft, len(out), n_rows,
                               t_steps)
        return Cycle(pos, rows, out, n_acc)

    def _verify_tree(self, tree: DraftTree, redo: list[int], pos: int,
                     pick: Callable[[list[int], int, int], int]) -> TreeWalk:
        """Decode the tree (after the rows to redo) in one batch, walk it, and leave the cache holding the
        prefix and the kept part of the chain; a kept branch is decoded again next cycle (tree.py)."""
        o, pos0 = len(redo), pos - len(redo)
        rows = [*redo, *tree.tokens]
        seqs, n_branch = tree.sequences()
        redo_seqs = [[0, *range(1, n_branch + 1)]] * o  # every node's path starts with them
        self.batch.set_tree(rows, [*range(pos0, pos), *(pos + d for d in tree.depths)], redo_seqs + seqs)
        try:
            for s in range(1, n_branch + 1):  # the prefix's cells join every branch's sequence
                self.target.seq_cp(0, s)
            self.decode(self.batch)
            w = walk(tree, lambda node: pick(rows, pos0, o + node), self.is_end)
        finally:
            for s in range(1, n_branch + 1):
                self.target.seq_rm(s, -1, -1)
        self.seq_rm(pos + w.on_chain + 1)
        self._redo, self._redo_at = [tree.tokens[node] for node in w.path[w.on_chain:]], pos + w.on_chain + 1
        return w


class Run:
    """One generation (Speculator.run): iterate it for its cycles, the first holding the prompt's next token
    (no rows of its own); `stats` is up to date at each. It ends when hooks.budget says so or its consumer
    stops; close() (or the end of the loop) writes the last statistics."""

    def __init__(self, spec: Speculator, prompt: list[int], hooks: RunHooks, policy: DraftPolicy | None,
                 rejection: RejectionSampler | None, spec_sampling: str, keep: int, index: LookupIndex | None,
                 exact: ExactReport | None = None):
        if not prompt:
            raise Eagle3Error("the prompt is empty")
        self.stats = SpecStats(draft_max=policy.k_max if policy is not None else 0,
                               lookup_max=policy.lookup_max if index is not None else 0, n_prompt=len(prompt),
                               spec_sampling=spec_sampling, target_on=str(spec.target.model.placement),
                               head_on=str(spec.session.draft_ctx.model.placement) if policy is not None else "",
                               exact=exact)
        self._cycles = self._run(spec, prompt, hooks, policy, rejection, min(keep, len(prompt) - 1), index)

    def __iter__(self) -> Iterator[Cycle]:
        return self._cycles

    def close(self) -> None:
        self._cycles.close()

    def _run(self, spec: Speculator, prompt: list[int], hooks: RunHooks, policy: DraftPolicy | None,
             rejection: RejectionSampler | None, keep: int, index: LookupIndex | None) -> Iterator[Cycle]:
        st = self.stats
        clock = StageClock(st, spec.native_time)
        try:
            speculative = policy is not None
            pos0 = spec.rewind(keep, speculative)
            hooks.on_rewind(pos0)
            spec.index.truncate(pos0 if index is not None else 0)  # it holds what the caches hold
            m = spec.prefill(prompt[pos0:], pos0, feed_head=speculative,
                             whole=speculative and policy.wants_prompt(), logits=hooks.prefill_logits,
                             on_chunk=hooks.on_prefill)
            pos = len(prompt)  # position of id_last
            id_last = hooks.first_token(m - 1)
            if index is not None:
                index.extend(prompt[pos0:] + [id_last])
            st.n_target_forwards = 1
            st.n_generated = 1  # an end-of-generation token counts as generated
            clock.prefilled()  # the head's work on the prompt included
            yield Cycle(pos - 1, prompt[-1:], [id_last], 0)  # chosen at the prompt's last row
            while (k := hooks.budget(pos, st)) is not None:
                cyc = spec.cycle(policy, id_last, pos, k, hooks.pick, st, rejection, index, hooks.pick_tree)
                if index is not None:
                    index.extend(cyc.out)
                hooks.on_cycle(cyc)
                st.n_generated += len(cyc.out)
                yield cyc
                pos += cyc.n_acc + 1
                id_last = cyc.out[-1]
        finally:
            clock.finished()
            if policy is not None:
                st.policy = policy.finish_stats()
                st.policy.head_k = spec.session.chooses_in_graph  # how this run's drafts read the head
