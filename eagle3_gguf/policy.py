"""Cost-aware drafting: how many tokens to draft, decided before and during every cycle.

A cycle that verifies j drafts costs the target c(j+1) (one batch of j+1 rows), plus, when it drafts,
e (the head catching up on the rows kept last cycle, and the graph calls' fixed cost) and j draft
steps of d each, and emits 1 + P_1 + ... + P_j tokens on average, where P_m is the chance that the first m
drafts are all accepted. Decoding maximises tokens per second, a ratio; the policy maximises the
equivalent difference E - R·T per cycle, where R is the rate to beat (Dinkelbach's rule for ratio
objectives): the best of target-only speed 1/c(1) and the rate the run has realised so far. So a draft
token is worth its cost only when its chance of being emitted beats R times what it adds to the cycle.

- `CostCurve` (costs.py): c(1..K_max+1), d and e, measured at load, cached and refined online.
- `Acceptance` (acceptance.py): P(draft accepted | earlier drafts accepted, the head's top probability) by
  draft position, and the expected acceptance of a step not yet drafted.
- `AdaptivePolicy.plan()` picks the draft budget before the cycle from the expected acceptances:
  0 when no length can pay, and then the cycle is plain decoding (the head is not run; the session
  keeps the rows and catches up on the next draft). While it plans 0 it probes now and then (one
  draft step, whose confidence may start drafting again), backing off while probes find nothing that
  makes drafting pay. While it drafts, it decodes one cycle plainly now and then (backing off while
  the timing confirms the scale), so that plain decoding's price stays measured. On a frozen curve
  (costs as given: a test's) nothing is learnt from timings: a cycle's time is the curve's price of it,
  and no plain cycle is timed.
- `AdaptivePolicy.judge(confs)` runs after every draft step with the confidences so far: keep
  drafting, or stop and verify the first j drafts (a confident prefix; it generalises p_min).

`FixedPolicy` is the old behaviour (always K, stop under p_min) for benchmarks and `--draft-policy fixed`.
"""


from __future__ import annotations

import math
from dataclasses import dataclass, field

from .acceptance import Acceptance, BranchAcceptance
from .costs import CostCurve
from .draft import CATCH_UP_WINDOW, Draft, NativeJudge, judge_p_min
from .lookup import N_MAX, Lookup, LookupAcceptance
from .tree import DraftTree, branch_candidates, chain_tree, with_branches

RATE_EMA = 0.1  # weight of one cycle in the realised rate
PROBE_MIN, PROBE_MAX = 4, 64  # plain cycles between probes: reset on success, doubled on failure
LOOKUP_PROBE_MIN = 16  # long matches declined before one is verified anyway (AdaptivePolicy.lookup), doubled to
# PROBE_MAX while such probes miss
CHECK_MIN, CHECK_MAX = 8, 256  # drafting cycles between plain ones that time one row: doubled while it holds
CHECK_TOL = 0.1  # a plain cycle within 10% of its predicted time confirms the scale


@dataclass
class PolicyStats:
    """What the policy chose, for the run's statistics."""

    name: str = "fixed"
    chosen: list[int] = field(default_factory=list)  # [M + 1]: cycles that verified 0..M drafts (M: max(K, L))
    trace: list[int] = field(default_factory=list)  # [n_cycles]: drafts verified, cycle by cycle
    probes: int = 0
    lookup_probes: int = 0  # long matches verified though not expected to pay (AdaptivePolicy.lookup)
    plain_cycles: int = 0  # cycles that ran no draft step at all
    predicted_tokens: float = 0.0  # the policy's expectation of the emitted tokens, summed over cycles
    predicted_s: float = 0.0  # ... and of the cycles' time
    cost_curve: list[float] = field(default_factory=list)  # [M + 1] verify cost in single-row units
    draft_step_cost: float = 0.0  # a draft step in single-row units
    draft_fixed_cost: float = 0.0  # a drafting cycle's fixed cost (the head's catch-up), likewise
    switch_cost: float = 0.0  # what the first two verifies of a new row count cost on top, likewise
    capture_cost: float = 0.0  # the second one's share of it, likewise
    cost_source: str = ""
    head_k: int = 0  # the tokens the head's graph chose a draft step in the run (0: its logits read)

    @property
    def head_reads(self) -> str:
        """How the run's drafts read the head, in words."""
        if not self.head_k:
            return "the head's logits read"
        return "the head's tokens chosen in its graph" + (f", {self.head_k - 1} runner-ups a step" if self.head_k > 1
                                                          else "")

    @property
    def predicted_tok_s(self) -> float:
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else 0.0


class FixedPolicy:
    """Always draft up to k; stop when the head's top probability falls under p_min (upstream's rule)."""

    name = "fixed"

    keep_rows = True  # the head reads every cycle's rows

    def __init__(self, k: int, p_min: float = 0.0, topk: int = 1, nodes: int = 0):
        """topk > 1: a draft tree of depth k, EAGLE-2's dynamic expansion of topk tokens per depth, its nodes
        likeliest candidates verified (Eagle3Session.draft_tree; p_min does not cut it)."""
        self.k = self.k_max = k
        self.lookup_max = 0  # verifies no lookup drafts
        self.p_min = p_min
        self._native = NativeJudge(p_min=p_min)  # judge() as chain.c runs it
        self.n_alt = 0  # runner-up tokens the head reports per chain step (the adaptive policy's branches)
        self.expand = topk if topk > 1 else 0  # a tree's tokens per depth (0: chains)
        self.nodes = nodes
        self.stats = PolicyStats("fixed", [0] * (k + 1))

    def begin(self) -> None:
        self.stats = PolicyStats("fixed", [0] * (self.k + 1))

    def finish_stats(self) -> PolicyStats:
        return self.stats

    def plan(self, k_cap: int) -> int:
        return min(self.k, k_cap)

    def wants_prompt(self) -> bool:
        return True

    def lookup(self, found: Lookup, k_cap: int) -> int:
        """The fixed policy always drafts with the head: lookup drafts are the adaptive policy's choice."""
        return 0

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        pass

    def judge(self, confs: list[float], n_max: int) -> int:
        """-1: draft another step; j >= 0: stop and verify the first j drafts."""
        return judge_p_min(confs, n_max, self.p_min)

    def native_judge(self) -> NativeJudge:
        """judge() as chain.c runs it (one for every draft: it does not change)."""
        return self._native

    def observe(self, confs: list[float], n_verified: int, n_accepted: int, n_drafted: int,
                t_verify: float, t_draft: float, n_emitted: int, n_rows: int | None = None,
                t_steps: float | None = None) -> None:
        self.stats.chosen[n_verified] += 1
        self.stats.trace.append(n_verified)
        if n_drafted == 0:
            self.stats.plain_cycles += 1

    def observe_plain(self, t_verify: float) -> None:
        """observe() of a plain cycle (one row, no draft step)."""
        self.observe([], 0, 0, 0, t_verify, 0.0, 1)


class AdaptivePolicy:
    """Draft the length that maximises expected tokens per second (module doc)."""

    name = "adaptive"

    def __init__(self, costs: CostCurve, k_max: int, window: int = CATCH_UP_WINDOW, lookup_max: int = 0,
                 topk: int = 1, nodes: int = 0):
        """k_max: the head's drafts per cycle at most; lookup_max: a lookup draft's (0: none); topk, nodes: a
        draft tree's caps (topk 1: chains). window: how many of the latest rows the head catches up on after
        plain cycles (the session's)."""
        rows = max(k_max, lookup_max, nodes)
        if costs.k_max < rows:
            raise ValueError(f"the cost curve covers {costs.k_max} drafts, the policy needs {rows}")
        self.costs = costs
        self.k_max = k_max
        self.lookup_max = lookup_max
        self.n_alt = topk - 1  # runner-up tokens the head reports per chain step (tree branches)
        self.expand = 0  # no dynamic trees: a branch costs this policy a verify row, never a head row
        self.branches = max(nodes - k_max, 0)  # a tree's branches at most
        self.shape = (k_max, lookup_max, topk, nodes)
        self.branch_acc = BranchAcceptance()
        self.window = window
        # whether the head should keep this cycle's rows (set by plan()): it drafts, or a probe comes
        # before they would fall out of its catch-up window anyway (copying them costs a plain cycle ~1%)
        self.keep_rows = True
        self.acc = Acceptance(k_max)
        self._native = self.acc.native_judge(done=self._judged, changed=self._changed)  # chain.c's, over acc's
        self.lookup_acc = LookupAcceptance(max(lookup_max, 1))
        self.rate = 1.0 / costs.verify(1)  # realised tokens/s, a running mean
        self.probe_wait = PROBE_MIN  # plain cycles until the next probe
        self.probe_gap = PROBE_MIN
        self.lookup_wait = LOOKUP_PROBE_MIN  # long matches to decline until the next lookup probe
        self.lookup_gap = LOOKUP_PROBE_MIN
        self.lookup_probing = False
        self.probing = False
        self.drafting = False
        self.checking = False  # a plain cycle while drafting pays, to time one row
        self.since_plain = 0  # drafting cycles since the last plain one
        self.check_gap = CHECK_MIN
        self._pred: tuple[float, float] = (1.0, costs.now_s[0])  # expected tokens, calibrated seconds
        # _pays(): the break-even rate, for the curve (now_s), draft costs, expectations and cap it was
        # computed from (plan() runs it every cycle; between drafts none of these move but the scale)
        self._star_now: list[float] | None = None
        self._star_cap = 0
        self._r_star = 0.0
        # the target's last decode's rows (0: none yet in this text, its prompt's) and how many decodes in a row had
        # them: a verify of another count pays the curve's switch, the second of a count its capture; _prices() is the
        # curve as this cycle pays it, for those
        self.last_rows = 0
        self.run = 0
        # the cycle after a check prices every width warm: returning to any width pays the switch alike (priced as a
        # change, the return never paid where a switch outweighs a cycle's gain: bench/NOTES.md, scale-gpu, 9th)
        self._after_check = False
        self._prices_of: tuple[list[float] | None, int, float] = (None, -1, 0.0)
        self._prices_now: list[float] = costs.now_s
        # A plain streak (plan()): plain cycles left that plan() need not weigh, and the timings of the
        # streak's cycles, learnt at its end
        self._streak = 0
        self._deferring = False
        self._pending: list[tuple[float, int]] = []  # (seconds, its place in a run of one row count: _decoded)
        self.stats = PolicyStats("adaptive", [0] * (max(k_max, lookup_max) + 1), cost_source=costs.source)

    def begin(self) -> None:
        """A new generation: fresh statistics; what was learnt (costs, acceptance, how long probes have
        been finding nothing) stays. A new text may read differently: its first cycle probes, and what lookup drafts
        earned on earlier texts counts half (LookupAcceptance.forget)."""
        self._learn_streak()
        self.stats = PolicyStats("adaptive", [0] * (max(self.k_max, self.lookup_max) + 1), cost_source=self.costs.source)
        self.probe_wait = 1
        self.last_rows = self.run = 0
        self._after_check = False
        self.lookup_acc.forget()

    # -- the rate to beat -----------------------------------------------------------------------------
    def _r(self) -> float:
        """Tokens per calibrated second that a cycle must beat (costs are in calibrated seconds)."""
        return max(self.rate * self.costs.scale, 1.0 / self.costs.now_s[0])

    def _prices(self) -> list[float]:
        """What verifying 1..K_max+1 rows costs this cycle, calibrated seconds: the curve, plus the whole switch for
        every row count but the last decode's, and the capture for that one where it ran once so far. So a policy
        that drafts keeps its width unless another pays for the change, and one that decodes plainly starts drafting
        only where a draft pays for it. The cycle after a check: every width warm.  # [K_max + 1]"""
        costs = self.costs
        if self._after_check:
            return costs.now_s
        last = self.last_rows
        cap = costs.capture_s if self.run == 1 else 0.0
        if self._prices_of[0] is not costs.now_s or self._prices_of[1:] != (last, cap):
            s = costs.switch_s
            self._prices_now = ([t + (s if n != last else cap) for n, t in enumerate(costs.now_s, 1)] if s
                                else costs.now_s)
            self._prices_of = (costs.now_s, last, cap)
        return self._prices_now

    # -- before the cycle ------------------------------------------------------------------------------
    def plan(self, k_cap: int) -> int:
        """The draft budget for this cycle: 0 (plain decoding) unless some length is expected to pay,
        or a probe is due. Sets keep_rows for the end of the cycle.

        A plain streak: where no length can pay even against plain decoding's own rate (the break-even rate
        is at most 1 / c(1), which the rate to beat never falls under), only a move of the curve could
        change that, and the curve moves only with the timings. So the plain cycles up to the next probe's
        catch-up window run as one streak: plan() and observe_plain() only count and keep the timing, and
        the policy learns the timings at the streak's end, in order, ending where learning them cycle by
        cycle would have; the streak decides with the curve as it was at its start. A cycle's Python runs
        cache-cold after the target's graph: this took plan + observe of a plain cycle from ~17 us to ~3.5
        (SmolLM2 + the shipped head, 2-core Intel, measured)."""
        if self._streak > 0:
            self._streak -= 1
            return 0
        if self._deferring:
            self._learn_streak()
        k_cap = min(k_cap, self.k_max)
        self.probing = self.checking = False
        if k_cap <= 0:
            self.keep_rows = self.drafting or self.probe_wait <= self.window
            return 0
        if self._pays(k_cap):
            self.probe_wait = self.probe_gap = PROBE_MIN
            self.drafting = self.keep_rows = True
            # time one row again: its cost is learnt from plain cycles only (a frozen curve learns nothing)
            if self.since_plain >= self.check_gap and not self.costs.frozen:
                self.checking = True
                return 0
            return k_cap
        self.drafting = False
        self.probe_wait -= 1
        self.keep_rows = self.probe_wait <= self.window
        if self.probe_wait > 0:
            if not self.keep_rows:
                self._streak = self._streak_length()
                self.probe_wait -= self._streak
                self._deferring = self._streak > 0
            return 0
        self.probing = True
        self.stats.probes += 1
        return k_cap

    def _pays(self, k_cap: int) -> bool:
        """Whether some draft length j <= k_cap is expected to beat plain decoding: E_j - R·T_j > 1 - R·c(1)
        for the expected acceptances, i.e. R under the break-even rate max_j (E_j - 1) / (T_j - c(1)).
        That rate moves only with the curve, the draft costs, the expectations and the cap (cached: a plain
        cycle then costs two multiplications here); R moves every cycle."""
        prices = self._prices()
        if self._star_now is not prices or self._star_cap != k_cap:
            self._r_star = self._break_even(k_cap)
            self._star_now, self._star_cap = prices, k_cap
        return self._r() < self._r_star

    def _streak_length(self) -> int:
        """How many more cycles are surely plain without weighing them: those before the next probe's
        catch-up window opens, where no length pays even at plain decoding's rate; else none."""
        if self._r_star * self.costs.now_s[0] > 1.0:
            return 0
        return self.probe_wait - self.window - 1

    def _break_even(self, k_cap: int) -> float:
        """The rate R under which some draft length j <= k_cap pays (math.inf: one pays at any rate)."""
        star = 0.0
        for gain, extra in self._head_drafts(k_cap):
            if extra <= 0.0:
                if gain > 0.0 or extra < 0.0:
                    return math.inf
            else:
                star = max(star, gain / extra)
        return star

    def _changed(self) -> None:
        """The expectations or the draft costs moved: the break-even rate is computed again."""
        self._star_now = None

    def wants_prompt(self) -> bool:
        """Whether the head should read the whole prompt: only when drafting is expected to pay. Otherwise
        it takes the prompt's last `window` rows, enough for a probe (reading a prompt of a few hundred
        rows costs the head one or two target steps)."""
        return self._pays(self.k_max)

    def lookup(self, found: Lookup, k_cap: int) -> int:
        """How many of a lookup draft's tokens to verify this cycle (0: none): the length whose expected
        tokens beat, at the rate to beat, both plain decoding and the head's best planned draft. A lookup
        draft costs its verify rows only (no draft step).

        A lookup probe: the LOOKUP_PROBE_MIN-th long match declined in a row is verified anyway, at its least losing
        length. Nothing is learnt of matches that are never verified, and one early miss at the first position (a
        copy not yet in step) could price every later match of a text under the rows where they are dear: the README
        demo then ran at 0.96x in place of 1.2x, every copy declined (2 cores; bench/NOTES.md, lookup-probe)."""
        k = min(len(found.tokens), k_cap, self.lookup_max)
        if k <= 0:
            return 0
        r, c = self._r(), self._prices()
        head = max((gain - r * extra for gain, extra in self._head_drafts(min(k_cap, self.k_max))), default=-math.inf)
        floor = 1.0 - r * c[0] + max(0.0, head)  # plain decoding, or the head's best planned draft
        best_j, best_v, best_gain, reach, gain = 0, -math.inf, 0.0, 1.0, 0.0  # the best length, paying or not
        for j in range(1, k + 1):
            reach *= self.lookup_acc.prob(found.n, j - 1)
            gain += reach
            v = 1.0 + gain - r * c[j]
            if v > best_v:
                best_j, best_v, best_gain = j, v, gain
        pays = best_v > floor
        if found.n >= N_MAX:
            self.lookup_wait = self.lookup_gap if pays else self.lookup_wait - 1
            if self.lookup_wait <= 0:
                pays = self.lookup_probing = True
                self.stats.lookup_probes += 1
        if not pays:
            return 0
        self._pred = (1.0 + best_gain, c[best_j])
        return best_j

    def tree(self, id_last: int, draft: Draft, room: int) -> DraftTree | None:
        """The draft as a tree: each runner-up, the likeliest to be kept first, while the tokens it is expected
        to add (reaching its parent, at the chain's calibrated acceptances, times the chance the target takes
        it there) beat what its verify row costs at the rate to beat, now and, if kept, again next cycle (a
        kept branch is decoded again); at most `nodes` tokens, and `room` (the rows that fit). None: the chain
        alone."""
        if not self.n_alt or not draft.tokens:
            return None
        acc, branch = self.acc, self.branch_acc
        chain = chain_tree(id_last, draft, acc.prob)
        r, c = self._r(), self._prices()
        n, chosen = len(draft.tokens), []
        for b in branch_candidates(chain, draft, lambda _d, reach, p: reach * branch.prob(p)):
            if len(chosen) >= self.branches or n >= room:
                break
            row = r * (c[n + 1] - c[n])  # one more verify row, in tokens at the rate to beat
            if b.weight * (1.0 - row) <= row:
                break
            chosen.append(b)
            n += 1
        if not chosen:
            return None
        self._pred = (self._pred[0] + sum(b.weight for b in chosen), self._pred[1] + c[n] - c[len(draft.tokens)])
        return with_branches(chain, chosen)

    def observe_tree(self, tree: DraftTree, path: list[int]) -> None:
        self.branch_acc.observe(tree, path)

    def _head_drafts(self, k_cap: int) -> list[tuple[float, float]]:
        """For a head draft of j = 1..k_cap at the expected acceptances: (E_j - 1, T_j - c(1)), the drafts
        expected to be emitted and what the cycle costs beyond a plain one (draft steps and catch-up included)."""
        c, d, e = self._prices(), self.costs.step_s, self.costs.draft_fixed_s
        out, reach, gain = [], 1.0, 0.0
        for j in range(1, k_cap + 1):
            reach *= self.acc.lookahead[j - 1]
            gain += reach
            out.append((gain, c[j] + e + j * d - c[0]))
        return out

    # -- during the draft ------------------------------------------------------------------------------
    def judge(self, confs: list[float], n_max: int) -> int:
        """After draft step i = len(confs) (confidences so far): -1 to draft another step, or j >= 0 to
        stop and verify the first j drafts. Steps not drafted yet are expected to go as the last one did
        (acceptance runs in stretches), which is also what the plan of the next cycle learns."""
        i = len(confs)
        acc, r, c, d = self.acc, self._r(), self._prices(), self.costs.step_s
        # stopping now: the best prefix j <= i of what was drafted (the draft steps are spent either way)
        reach, gain = 1.0, 0.0
        best_j, best_v, best_gain = 0, -r * c[0], 0.0
        for j in range(1, i + 1):
            reach *= acc.prob(j - 1, confs[j - 1])
            gain += reach
            v = gain - r * c[j]
            if v > best_v:
                best_j, best_v, best_gain = j, v, gain
        acc.saw_step(i - 1, acc.prob(i - 1, confs[-1]))
        ahead = [acc.prob(j, confs[-1]) for j in range(i, self.k_max)]  # [K_max - i]
        for j, p in enumerate(ahead):
            acc.saw_step(i + j, p)
        self._changed()
        # drafting on to j > i, each further step at the last step's acceptance
        for j in range(i + 1, n_max + 1):
            reach *= ahead[j - i - 1]
            gain += reach
            if gain - r * (c[j] + (j - i) * d) > best_v:
                return -1
        self._pred = (1.0 + best_gain, c[best_j] + self.costs.draft_fixed_s + i * d)
        return best_j

    def native_judge(self) -> NativeJudge:
        """judge() as chain.c runs it, at this cycle's prices; _judged() takes what its last call decided."""
        j = self._native
        j.r, j.prices, j.step_s = self._r(), self._prices(), self.costs.step_s
        return j

    def _judged(self, steps: int, keep: int, best_gain: float) -> None:
        """What judge() leaves behind after its last call (steps drafted, keep verified), from chain.c's judge."""
        self._changed()
        self._pred = (1.0 + best_gain, self._prices()[keep] + self.costs.draft_fixed_s + steps * self.costs.step_s)

    # -- after the cycle ------------------------------------------------------------------------------
    def observe(self, confs: list[float], n_verified: int, n_accepted: int, n_drafted: int,
                t_verify: float, t_draft: float, n_emitted: int, n_rows: int | None = None,
                t_steps: float | None = None) -> None:
        """The cycle's outcome: drafts verified and accepted, and its timings (seconds; t_steps: the draft's steps
        after the first, where timed apart). n_rows: the rows its verify decoded, where that is not n_verified + 1
        (a tree's branches, a kept branch decoded again)."""
        rows = n_verified + 1 if n_rows is None else n_rows
        if n_drafted == 0 and rows == 1:
            self.observe_plain(t_verify)
            return
        st, costs = self.stats, self.costs
        run = self._decoded(rows)
        st.chosen[n_verified] += 1
        st.trace.append(n_verified)
        # judge() set the prediction of a drafting cycle (to the one-row reset at the end when it did not run)
        st.predicted_tokens += self._pred[0]
        st.predicted_s += self._pred[1] * costs.scale
        if n_verified:
            self.acc.observe(confs, n_verified, n_accepted)
        self.since_plain += 1
        if rows > 1:
            self._observe_rows(rows, t_verify, run)
        costs.observe_draft(n_drafted, t_draft, t_steps)
        self._changed()
        t = self._priced(rows, n_drafted, run) if costs.frozen else t_verify + t_draft
        if t > 0:
            self.rate += RATE_EMA * (n_emitted / t - self.rate)
        if self.probing:
            # A probe that makes drafting pay (the next plan drafts) resets the back-off; one that does not
            # backs off, even where it got a draft accepted: a weak head often gets the first one, and a probe
            # costs most of a target step (the head catches up on its window, and the target's verify
            # graph changes shape twice), so probing every few cycles on such acceptances lost 3-6% of
            # target-only speed (measured, SmolLM2 + the shipped head, 2-core Intel).
            if self._pays(self.k_max):
                self.probe_gap = PROBE_MIN
            else:
                self.probe_gap = min(2 * self.probe_gap, PROBE_MAX)
            self.probe_wait = self.probe_gap
        self._pred = (1.0, self.costs.now_s[0])

    def observe_lookup(self, n: int, n_verified: int, n_accepted: int, t_verify: float, n_emitted: int,
                       n_rows: int | None = None) -> None:
        """A lookup cycle's outcome (a match of n tokens proposed n_verified drafts; no draft step; n_rows as
        for observe)."""
        st, costs = self.stats, self.costs
        st.chosen[n_verified] += 1
        st.trace.append(n_verified)
        st.predicted_tokens += self._pred[0]
        st.predicted_s += self._pred[1] * costs.scale
        self.lookup_acc.observe(n, n_verified, n_accepted)
        if self.lookup_probing:
            self.lookup_probing = False
            whole = n_accepted == n_verified
            self.lookup_gap = LOOKUP_PROBE_MIN if whole else min(2 * self.lookup_gap, PROBE_MAX)
            self.lookup_wait = self.lookup_gap
        rows = n_verified + 1 if n_rows is None else n_rows
        run = self._decoded(rows)
        self._observe_rows(rows, t_verify, run)
        self._changed()
        if costs.frozen:
            t_verify = self._priced(rows, 0, run)
        if t_verify > 0:
            self.rate += RATE_EMA * (n_emitted / t_verify - self.rate)
        self._pred = (1.0, costs.now_s[0])

    def _decoded(self, rows: int) -> int:
        """The target's verify decoded `rows` rows: its place in a run of decodes of that many (1: the width changed,
        2: the second in a row, ggml-cuda's capture)."""
        self.run = self.run + 1 if rows == self.last_rows else 1
        self.last_rows = rows
        self._after_check = False  # the cycle after a check has been priced warm (set by _learn_plain)
        return self.run

    def _observe_rows(self, rows: int, t_verify: float, run: int) -> None:
        """A verify of `rows` rows took t_verify, the run-th of that count in a row (the curve learns the sizes it
        covers, each at its warm cost: the switch and its capture are the curve's apart)."""
        if rows <= self.costs.k_max + 1:
            self.costs.observe_verify(rows, self._warm(t_verify, run))

    def _warm(self, t_verify: float, run: int) -> float:
        """A verify's seconds less the share of the switch it paid (at least a quarter of them: a switch priced above
        what one costs now must not make verifies look free; a CUDA capture alone can outcost the rows)."""
        return max(t_verify - self.costs.paid(run), 0.25 * t_verify) if run <= 2 else t_verify

    def _priced(self, rows: int, n_drafted: int, run: int) -> float:
        """A cycle's seconds by the curve (a frozen curve's stand-in for its timing): `rows` verify rows (more
        than the curve covers, a kept branch decoded again, at its last price), the share of the switch the run-th
        verify of that count in a row pays, and n_drafted draft steps."""
        c = self.costs
        t = c.verify(min(rows, c.k_max + 1)) + c.paid(run)
        return t + c.scale * (c.draft_fixed_s + n_drafted * c.step_s) if n_drafted else t

    def observe_plain(self, t_verify: float) -> None:
        """A plain cycle's outcome (one row emitted, no draft step): the common case, kept short (it runs
        cache-cold after the target's graph); in a plain streak only its timing is kept (plan())."""
        run = self._decoded(1)
        if self._deferring:
            self._pending.append((t_verify, run))
            return
        self._learn_plain(t_verify, run)

    def _learn_streak(self) -> None:
        """The plain streak is over: learn its cycles' timings, in order."""
        pending, self._pending = self._pending, []
        self._deferring, self._streak = False, 0
        for t, run in pending:
            self._learn_plain(t, run)

    def _learn_plain(self, t_verify: float, run: int) -> None:
        st, costs = self.stats, self.costs
        st.chosen[0] += 1
        st.trace.append(0)
        st.plain_cycles += 1
        one = costs.verify(1)
        st.predicted_tokens += 1.0
        st.predicted_s += one + costs.paid(run)
        warm = self._warm(t_verify, run)
        if self.checking:
            ok = abs(warm / one - 1.0) < CHECK_TOL
            self.check_gap = min(2 * self.check_gap, CHECK_MAX) if ok else CHECK_MIN
            self.checking, self._after_check = False, True  # one cycle, whether plan() or a lookup decides it
        self.since_plain = 0
        costs.observe_verify(1, warm)
        if costs.frozen:
            t_verify = self._priced(1, 0, run)
        if t_verify > 0:
            self.rate += RATE_EMA * (1.0 / t_verify - self.rate)

    def finish_stats(self) -> PolicyStats:
        self._learn_streak()
        st = self.stats
        st.cost_curve = self.costs.relative()
        st.draft_step_cost = self.costs.step_s / self.costs.now_s[0]
        st.draft_fixed_cost = self.costs.draft_fixed_s / self.costs.now_s[0]
        st.switch_cost = self.costs.switch_s / self.costs.now_s[0]
        st.capture_cost = self.costs.capture_s / self.costs.now_s[0]
        return st


DraftPolicy = FixedPolicy | AdaptivePolicy
POLICIES = ("adaptive", "fixed")
