"""A benchmark's report: bench.py's runs summarised per workload and contender, as a table, JSON, a plot, and
one line of advice drawn from the figures."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench import TARGET, PromptRun, Setup, fastest, per_prompt_ratio
from .decode import CONTEXT_FULL
from .errors import Eagle3Error


@dataclass
class Spread:
    """Per-prompt ratios: the smallest, the quartiles, the largest."""

    min: float
    q1: float
    median: float
    q3: float
    max: float

    @classmethod
    def of(cls, xs: list[float]) -> "Spread":
        xs = sorted(xs)
        q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
        return cls(xs[0], q1, q2, q3, xs[-1])


@dataclass
class Row:
    """One contender on one workload. Target-only's `ratio` is its run-to-run noise: per prompt its slower run
    against its faster one."""

    workload: str
    contender: str
    prompts: int
    ratio: Spread  # per-prompt speed against target-only's
    tok_s: float  # median over prompts of the fastest run's tokens per second
    tau: float  # tokens per target forward, all runs pooled
    acceptance_by_pos: list[float]  # [M]: drafts kept at draft position i, all runs pooled (speculative rows)
    drafted: int  # drafts verified, all runs
    identical: int  # greedy runs whose text was target-only's
    compared: int  # greedy runs compared
    lookup_share: float = 0.0  # of the drafts kept, those a lookup proposed
    tree_cycles: int = 0
    context_full: int = 0  # runs that ended at the context's end, short of -n


def summarize(runs: list[PromptRun], contenders: list[str]) -> list[Row]:
    """A row per workload (in the order first measured) and contender (in `contenders`' order)."""
    workloads = list(dict.fromkeys(r.workload for r in runs))
    rows = []
    for w in workloads:
        base = [r for r in runs if r.workload == w and r.contender == TARGET.name]
        for name in contenders:
            rs = [r for r in runs if r.workload == w and r.contender == name]
            if not rs:
                continue
            if name == TARGET.name:
                ratios = list(_noise(rs).values())
            else:
                ratios = list(per_prompt_ratio(rs, base).values())
            speed = fastest(rs)
            same = [r.identical for r in rs if r.identical is not None]
            kept = sum(r.accepted for r in rs)
            rows.append(Row(w, name, len(speed), Spread.of(ratios), statistics.median(speed.values()),
                            sum(r.tokens for r in rs) / max(sum(r.forwards for r in rs), 1), acceptance_by_pos(rs),
                            sum(r.drafted for r in rs), sum(same), len(same),
                            sum(r.lookup_accepted for r in rs) / kept if kept else 0.0,
                            sum(r.tree_cycles for r in rs), sum(r.stopped == CONTEXT_FULL for r in rs)))
    return rows


def _noise(rs: list[PromptRun]) -> dict[str, float]:
    """Per prompt, target-only's slower run against its faster one in each round, the median over rounds."""
    by: dict[tuple[str, int], list[float]] = {}
    for r in rs:
        by.setdefault((r.prompt_id, r.round), []).append(r.tok_s)
    rounds: dict[str, list[float]] = {}
    for (pid, _), v in by.items():
        rounds.setdefault(pid, []).append(min(v) / max(v) if max(v) > 0 else 1.0)
    return {pid: statistics.median(v) for pid, v in rounds.items()}


def acceptance_by_pos(runs: list[PromptRun]) -> list[float]:
    """Drafts kept at each draft position, all runs pooled, up to the last position anything was drafted at."""
    drafted = _pooled(r.drafted_by_pos for r in runs)
    accepted = _pooled(r.accepted_by_pos for r in runs)
    n = max((i + 1 for i, d in enumerate(drafted) if d), default=0)
    return [a / d if d else 0.0 for a, d in zip(accepted[:n], drafted[:n])]


def _pooled(lists) -> list[int]:
    """Element-wise sums of lists of different lengths."""
    out: list[int] = []
    for xs in lists:
        out += [0] * (len(xs) - len(out))
        for i, x in enumerate(xs):
            out[i] += x
    return out


# -- the advice ------------------------------------------------------------------------------------------

def pays(row: Row, noise: float = 1.0) -> bool:
    """A contender beats target-only on a workload beyond the spread: its median prompt is faster by more than
    target-only's own runs differ (`noise`: the median of its slower run against its faster one), and three
    quarters of its prompts are faster."""
    return row.ratio.median > 2.0 - noise and row.ratio.q1 > 1.0


def advice(rows: list[Row], setup: Setup, flags: dict[str, str]) -> str:
    """One line: which contender to use here and why, from the figures (the per-prompt ratios, the cost of
    verify rows, the head's acceptance)."""
    spec = [r for r in rows if r.contender != TARGET.name]
    if not spec:
        return "only target-only was measured: name contenders to compare (--contenders default,k2,lookup,head)"
    workloads = list(dict.fromkeys(r.workload for r in rows))
    by: dict[str, dict[str, Row]] = {}
    for r in spec:
        by.setdefault(r.contender, {})[r.workload] = r
    # a contender's standing: the geometric mean of its median ratios over every workload measured
    score = {c: math.exp(statistics.fmean(math.log(max(r.ratio.median, 1e-9)) for r in ws.values()))
             for c, ws in by.items() if len(ws) == len(workloads)}
    best = max(score, key=score.get) if score else max(spec, key=lambda r: r.ratio.median).contender
    figures = ", ".join(f"{r.ratio.median:.2f}x on {w}" for w, r in sorted(by[best].items(),
                                                                             key=lambda wr: -wr[1].ratio.median))
    why = _why(rows, setup) + _caveats(rows)
    noise = {r.workload: r.ratio.median for r in rows if r.contender == TARGET.name}
    winners = [r for r in spec if pays(r, noise.get(r.workload, 1.0))]
    if score.get(best, 0.0) > 1.0 and any(r.contender == best for r in winners):
        return f"use {best} ({flags.get(best, best)}): {figures}; {why}"
    if winners:
        top = max(winners, key=lambda r: r.ratio.median)
        rest = [w for w in workloads if not any(r.workload == w for r in winners)]
        tail = f"; on {', '.join(rest)} nothing beats target-only beyond its spread" if rest else ""
        return (f"speculate on {top.workload} text only: {top.contender} ({flags.get(top.contender, top.contender)}) "
                f"gains {top.ratio.median:.2f}x there (quartiles {top.ratio.q1:.2f}-{top.ratio.q3:.2f}){tail}; "
                f"elsewhere use --draft-max 0; {why}")
    return (f"speculation does not pay here for this pair: the best, {best}, runs at {figures}, none beyond the "
            f"prompts' spread; target-only (--draft-max 0) is fastest; {why}")


def _caveats(rows: list[Row]) -> str:
    """What makes the figures weak: a busy machine (target-only's own runs far apart), a contender whose text was
    not target-only's, runs the context cut short, or few prompts."""
    text = ""
    noise = min((r.ratio.median for r in rows if r.contender == TARGET.name), default=1.0)
    if noise < 0.9:
        text += (f"; caution: target-only's two runs of a prompt differed by {1 - noise:.0%} (a busy machine): "
                 "measure again when it is quiet")
    parted = sorted({r.contender for r in rows if r.identical < r.compared and r.contender != TARGET.name})
    if parted:  # faster, but not target-only's text: a speed that cannot be bought losslessly here
        text += (f"; caution: {', '.join(parted)} parted from target-only's text on some prompts (verify widths that "
                 "are not exact on this set-up: keep --exact auto, which keeps to the exact ones)")
    short = sum(r.context_full for r in rows)
    if short:  # the header's tokens a prompt overstate them (llama.cpp pads -c up to 256 cells)
        text += f"; {short} run(s) ended at the end of the context, short of -n tokens: raise -c"
    n = min(r.prompts for r in rows)
    if n < 3:
        text += f"; {n} prompt(s) a workload: raise --limit and --time-limit for firmer figures"
    return text


def head_break_even(verify_2: float, draft_step: float) -> float:
    """How often a one-draft cycle's draft must be kept to pay, from what 2 verify rows and a draft step cost in
    one-row units: it pays where 1 + p > c(2) + d."""
    return max(verify_2 + draft_step - 1.0, 0.0)


def head_verdict(need: float, where: str = "") -> str:
    """What a head draft with break-even `need` (head_break_even) can do, `where` ("here") in the sentence."""
    return (f"pays{where} only where it is kept over {need:.0%} of the time" if need < 1.0 else
            f"cannot pay{where} even when always kept")


def _why(rows: list[Row], setup: Setup) -> str:
    """The costs and acceptance that decide it: a head draft pays where 1 + p1 > c(2) + d."""
    c = setup.verify_cost
    c2 = c[1] if len(c) > 1 else float("nan")
    verdict = head_verdict(head_break_even(c2, setup.draft_step))
    text = (f"here 2 verify rows cost {c2:.2f}x one row and a draft step {setup.draft_step:.2f}x, so a head draft "
            f"{verdict}")
    # the head's first drafts as drafted: a fixed policy's (every cycle drafts) before an adaptive one's
    head = [r for r in rows if r.drafted and r.lookup_share < 1.0 and r.contender not in (TARGET.name, "lookup")]
    head.sort(key=lambda r: not r.contender.startswith("k"))
    if head:
        r = head[0]
        text += f" ({r.contender} kept {r.acceptance_by_pos[0]:.0%} at position 1 on {r.workload}, tau {r.tau:.2f})"
    lookups = [r for r in rows if r.contender == "lookup" and r.tau > 1.0]
    if lookups:
        r = max(lookups, key=lambda r: r.tau)
        text += f"; lookup drafts need no draft step and made {r.tau:.2f} tokens a forward on {r.workload}"
    return text


# -- rendering -------------------------------------------------------------------------------------------

@dataclass
class Report:
    setup: Setup
    runs: list[PromptRun]
    rows: list[Row]
    advice: str
    stopped: str = ""  # "interrupted", "time limit: ...", or "" (every prompt measured)

    def to_json(self) -> str:
        return json.dumps({"setup": asdict(self.setup), "rows": [asdict(r) for r in self.rows],
                           "runs": [asdict(r) | {"tok_s": r.tok_s, "tau": r.tau} for r in self.runs],
                           "advice": self.advice, "stopped": self.stopped}, indent=1)

    def header(self) -> list[str]:
        s = self.setup
        counts: dict[str, set] = {}
        for r in self.runs:
            counts.setdefault(r.workload, set()).add(r.prompt_id)
        prompts = ", ".join(f"{w} {len(ids)}" for w, ids in counts.items()) or "none"
        rounds = max((r.round for r in self.runs), default=0) + 1
        c = s.verify_cost
        base = [r.tok_s for r in self.rows if r.contender == TARGET.name and r.tok_s > 0]
        step = f"; target-only's runs: {1e3 / statistics.median(base):.2f} ms a token" if base else ""
        curve = " ".join(f"{x:.2f}" for x in c[:5])
        lines = [("target", f"{s.target} on {s.target_on}, {s.threads} threads; head {s.head} on {s.head_on}"),
                 ("machine", s.machine),
                 ("prompts", f"{prompts} ({'chat template' if s.chat_template else 'raw text: no chat template'}), "
                             f"{s.n_predict} tokens each, greedy; per prompt, {rounds} round(s) of: target-only, each "
                             "contender, target-only again"),
                 ("verify cost", f"1..{min(len(c), 5)} rows {curve}x one row" + (f", {len(c)} rows {c[-1]:.2f}x"
                                                                               if len(c) > 5 else "")
                  + f"; draft step {s.draft_step:.2f}x, catch-up {s.draft_fixed:.2f}x (calibrated at load: one row "
                  f"{s.row_ms:.2f} ms{step})")]
        lines += _exact_lines(s)
        if self.stopped:
            lines.append(("stopped", self.stopped))
        width = max(len(k) for k, _ in lines)
        return [f"{k:<{width}}  {v}" for k, v in lines]

    def table(self) -> str:
        head = ["workload", "contender", "prompts", "vs target", "min  q1-q3  max", "tok/s", "tau",
                "accepted by position", "identical"]
        body = []
        for r in self.rows:
            sp = r.ratio
            ratio = f"{sp.median:.2f}x" if r.contender != TARGET.name else f"1 (runs {sp.median:.2f})"
            body.append([r.workload, r.contender, str(r.prompts), ratio,
                         f"{sp.min:.2f} {sp.q1:.2f}-{sp.q3:.2f} {sp.max:.2f}", f"{r.tok_s:.1f}", f"{r.tau:.2f}",
                         " ".join(f"{a:.2f}" for a in r.acceptance_by_pos[:6]), f"{r.identical}/{r.compared}"])
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        legend = ("vs target: the median prompt's speed against target-only's (each prompt: its fastest run against "
                  "target-only's fastest of the round); target's row: its slower run against its faster")
        return "\n".join([*self.header(), "", fmt(head), *map(fmt, body), legend, "", f"advice: {self.advice}"]) + "\n"


def _exact_lines(s: Setup) -> list[tuple[str, str]]:
    """The exactness probe's finding once (the same for every contender), and which contenders kept to it."""
    if not s.exact:
        return []
    found = next(iter(s.exact.values())).rows()
    lines = [row for row in found if row[0] != "kept to them"]
    if len(lines) < len(found):
        kept = [c for c, e in s.exact.items() if e.kept]
        loose = [c for c, e in s.exact.items() if not e.kept]
        lines.append(("kept to them", f"{', '.join(kept) or 'none'}" + (
            f"; not: {', '.join(loose)} (their text may part from target-only's at near-ties)" if loose else "")))
    return lines


def plot(report: Report, path: Path) -> None:
    """Two panels: the median ratio to target-only by workload and contender (quartiles as error bars), and
    acceptance by draft position per contender (all workloads pooled)."""
    try:
        import matplotlib
    except ImportError:
        raise Eagle3Error("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.contender != TARGET.name]
    workloads = list(dict.fromkeys(r.workload for r in report.rows))
    names = list(dict.fromkeys(r.contender for r in rows))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for i, w in enumerate(workloads):
            r = next((r for r in rows if (r.workload, r.contender) == (w, name)), None)
            if r is not None:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                ys.append(r.ratio.median)
                lo.append(r.ratio.median - r.ratio.q1)
                hi.append(r.ratio.q3 - r.ratio.median)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("speed vs target-only (median prompt; quartiles)")
    if names:
        ax.legend(fontsize=8)
    drew = False
    for name in names:
        by_pos = acceptance_by_pos([r for r in report.runs if r.contender == name])
        if by_pos:
            ax2.plot(range(1, len(by_pos) + 1), by_pos, "o-", label=name)
            drew = True
    if not drew:  # a legend of nothing is matplotlib's warning on stderr
        ax2.text(0.5, 0.5, "no drafts were verified", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("draft position")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel("drafts kept (all workloads)")
    ax2.set_ylim(0, 1)
    if drew:
        ax2.legend(fontsize=8)
    fig.suptitle(f"{report.setup.target} + {report.setup.head}: {report.setup.machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
