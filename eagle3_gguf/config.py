"""The drafting knobs: one dataclass, one set of library defaults, one validation, one help text per knob.

`DraftConfig` is what every surface runs with: `generate` and `serve` build it from their flags (whose
definitions, `KNOBS`, live here too), `Eagle3Llama` holds one, and `Speculator.run` reads it.

Where the command line's default differs from the library's, `COMMAND_LINE` holds it; why, once:
- draft_p_min: 0.0 in the library, 0.5 on the command line. It only matters with `draft_policy="fixed"`; on
  2 CPU cores (SmolLM2 + the embedded head, 128 tokens, scripts/bench_defaults.py, medians) K=4 with p_min 0
  ran at 0.47x target-only, p_min 0.5 at 0.85x. The library keeps 0.0, upstream llama.cpp's draft p_min.
- spec_sampling: "match" in the library, "rejection" on the command line. The drop-in keeps plain Llama's
  text for every seed (what a one-line change must not break); the CLI draws the target's distribution with
  more drafts kept (docs/drafting-policy.md, sampling above temperature 0).
- draft_topk / draft_nodes: `generate` with the adaptive policy caps trees at ADAPTIVE_TREE (4 / 8): the policy
  adds a head runner-up beside its chain only where the row is expected to pay, so on 2 CPU cores it verifies
  no tree and runs as fast as chains (bench/NOTES.md, tree-default), and where rows are nearly free (a GPU) it
  takes them. The library, `serve` and the fixed policy draft chains (1 / 0): llama-cpp-python opens its context
  with one sequence (Eagle3Llama, serve) and a tree needs several; a fixed shape is one a user names.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Callable

from .errors import Eagle3Error
from .policy import POLICIES
from .spec_sampling import SPEC_SAMPLING
from .tree import head_sequences

# verify widths (exactness.py): auto keeps to the widths probed exact, or speculates as upstream where none above 1
# is; strict keeps to them always (plain decoding where none is); off probes nothing
EXACT_MODES = ("auto", "strict", "off")
MAX_DRAFT_MAX = 32  # the most drafts one cycle may verify (head or lookup)
MAX_THREADS = 512  # ggml.h's GGML_MAX_N_THREADS: more crash ggml's thread pool
MAX_TOPK = 8  # a draft tree's tokens per depth at most


def check_threads(n: int | None, flag: str = "-t") -> None:
    """A thread count llama.cpp can run (None: its default), else one line naming `flag`."""
    if n is not None and not 1 <= n <= MAX_THREADS:
        raise Eagle3Error(f"{flag} must be between 1 and {MAX_THREADS} (got {n})")


@dataclass(frozen=True)
class Knob:
    """One drafting knob as the command line shows it."""

    flag: str
    help: str


KNOBS: dict[str, Knob] = {
    "draft_max": Knob("--draft-max", "Tokens drafted per cycle at most (K); 0 = target only."),
    "draft_p_min": Knob("--draft-p-min", "With --draft-policy fixed: stop drafting when the draft's top probability "
                        "falls below this."),
    "draft_policy": Knob("--draft-policy", "adaptive: draft 0..K tokens per cycle, whatever is expected to pay "
                         "(measured costs, online acceptance); fixed: always K, cut at --draft-p-min."),
    "spec_sampling": Knob("--spec-sampling", "At temperature > 0: rejection: drafts drawn from the head's "
                          "distribution q, kept with probability min(1, p/q) (the target's distribution, more drafts "
                          "kept); match: greedy drafts kept where the target's own sample equals them (the same "
                          "seed gives target-only's text)."),
    "draft_temp_scale": Knob("--draft-temp-scale", "With --spec-sampling rejection: q's temperature is the target's "
                             "times this (< 1 sharpens, 0 drafts the head's argmax; default 1)."),
    "draft_lookup": Knob("--draft-lookup", "on: the adaptive policy may verify a continuation copied from the text "
                         "so far (prompt lookup: no draft step) instead of the head's draft, where it is expected to "
                         "pay more; off: the head's drafts only."),
    "draft_head": Knob("--draft-head", "on: the head drafts; off: lookup drafts only (--draft-lookup on, the "
                       "adaptive policy: no draft step ever runs, as llama.cpp's n-gram drafting)."),
    "draft_topk": Knob("--draft-topk", "Draft a tree, verified in one batch (1: a chain). With --draft-policy fixed: "
                       "EAGLE-2's dynamic tree, --draft-max deep, this many tokens per depth (the head runs the "
                       "likeliest this-many at each depth); adaptive: up to this many - 1 of the head's runner-up "
                       "tokens beside each chain token, where a row pays (greedy and --spec-sampling match; under rejection "
                       "it drafts chains). Default: 4 for generate's adaptive policy, else 1 (serve runs "
                       "llama-cpp-python's one-sequence context)."),
    "draft_nodes": Knob("--draft-nodes", "With --draft-topk > 1: draft tokens a tree verifies at most (the likeliest "
                        "first; 0: --draft-max x --draft-topk). The fixed policy fills the tree; the adaptive one "
                        "adds a branch where it expects it to pay. Default: 8 with generate's adaptive policy, else 0."),
    "exact": Knob("--exact", "auto: probe at load which verify batch widths llama.cpp computes bit for bit as "
                  "one-token decoding (cached per set-up) and verify only those, so greedy output is target-only's; "
                  "where no width above 1 is exact, say so and speculate anyway, as upstream does; strict: plain "
                  "decoding there instead; off: no probe, every width."),
    "draft_lookup_max": Knob("--draft-lookup-max", "Tokens a lookup draft verifies at most (it costs no draft "
                             "step, so it may exceed --draft-max; the adaptive policy picks the length from the "
                             "measured cost of verify rows; a copy runs long)."),
}


@dataclass(frozen=True)
class DraftConfig:
    """How a run drafts and verifies. Invalid values raise one Eagle3Error line at construction."""

    draft_max: int = 4  # K: the most tokens one cycle drafts (a cap for the adaptive policy)
    draft_p_min: float = 0.0  # the fixed policy's stop rule
    draft_policy: str = "adaptive"  # "adaptive" (policy.AdaptivePolicy) or "fixed" (always K, p_min)
    # at temperature > 0: "match" (greedy drafts kept where the target's own sample equals them) or
    # "rejection" (drafts from the head's q, kept with probability min(1, p/q); spec_sampling.py)
    spec_sampling: str = "match"
    # rejection: q's temperature = the target's x this; 1 keeps q under p's transform (bench/NOTES.md: the
    # scale measured on MT-bench)
    draft_temp_scale: float = 1.0
    draft_lookup: bool = True  # lookup drafts (lookup.py), weighed by the adaptive policy against the head's
    draft_head: bool = True  # the head's drafts; False: lookup drafts only
    draft_lookup_max: int = 16  # the most tokens a lookup draft verifies (bench/NOTES.md: lookup-cpu)
    draft_topk: int = 1  # a draft tree's tokens per depth; 1: a chain (tree.py)
    draft_nodes: int = 0  # a tree's draft tokens at most; 0: draft_max * draft_topk
    exact: str = "auto"  # which verify widths to use: EXACT_MODES (exactness.py)
    # how errors name a knob: its attribute (the library) or its flag (`from_flags`); not stored
    name: InitVar[Callable[[str], str]] = str

    def __post_init__(self, name: Callable[[str], str]) -> None:
        """Raise for the first invalid knob, one line naming it by `name(attribute)`."""
        k = self.draft_max
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_MAX:
            raise Eagle3Error(f"{name('draft_max')} must be between 0 and {MAX_DRAFT_MAX} (got {k})")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise Eagle3Error(f"{name('draft_p_min')} must be in [0, 1) (got {self.draft_p_min})")
        if self.draft_policy not in POLICIES:
            raise Eagle3Error(f"{name('draft_policy')} must be {' or '.join(POLICIES)} (got {self.draft_policy})")
        if self.spec_sampling not in SPEC_SAMPLING:
            raise Eagle3Error(f"{name('spec_sampling')} must be {' or '.join(SPEC_SAMPLING)} "
                              f"(got {self.spec_sampling})")
        if not 0.0 <= self.draft_temp_scale < math.inf:
            raise Eagle3Error(f"{name('draft_temp_scale')} must be a number, 0 or more (got {self.draft_temp_scale})")
        for attr in ("draft_lookup", "draft_head"):
            if not isinstance(getattr(self, attr), bool):
                raise Eagle3Error(f"{name(attr)} must be on or off (got {getattr(self, attr)})")
        if not self.draft_head and not (self.draft_lookup and self.draft_policy == "adaptive"):
            raise Eagle3Error(f"{name('draft_head')} off drafts from lookups only: it needs {name('draft_lookup')} "
                              f"on and {name('draft_policy')} adaptive")
        if self.exact not in EXACT_MODES:
            raise Eagle3Error(f"{name('exact')} must be {', '.join(EXACT_MODES)} (got {self.exact})")
        for attr, low, high in (("draft_lookup_max", 1, MAX_DRAFT_MAX), ("draft_topk", 1, MAX_TOPK),
                                ("draft_nodes", 0, MAX_DRAFT_MAX)):
            n = getattr(self, attr)
            if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
                raise Eagle3Error(f"{name(attr)} must be between {low} and {high} (got {n})")


    @property
    def tree_nodes(self) -> int:
        """A draft tree's tokens at most (draft_max for a chain)."""
        if self.draft_topk == 1:
            return self.draft_max
        return min(self.draft_nodes or self.draft_max * self.draft_topk, MAX_DRAFT_MAX)

    @property
    def tree_sequences(self) -> int:
        """The sequences a tree needs in the target's and the head's contexts: the target one per leaf off the
        chain and one more (at most tree_nodes), the head two per token of a depth and one more."""
        return 1 if self.draft_topk == 1 else max(self.tree_nodes, head_sequences(self.draft_topk))

    @classmethod
    def from_flags(cls, **values) -> "DraftConfig":
        """A config from command-line values (None: COMMAND_LINE's default), its errors naming the flags."""
        values = {attr: getattr(COMMAND_LINE, attr) if v is None else v for attr, v in values.items()}
        return cls(**values, name=lambda attr: KNOBS[attr].flag)


LIBRARY = DraftConfig()
# The command line's defaults, where they differ from the library's (the module doc says why).
COMMAND_LINE = DraftConfig(draft_p_min=0.5, spec_sampling="rejection")
ADAPTIVE_TREE = DraftConfig(draft_topk=4, draft_nodes=8)  # generate's tree caps with the adaptive policy (above)
