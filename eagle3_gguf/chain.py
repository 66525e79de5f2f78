"""The head's greedy draft chain in one C call (chain.c), for Eagle3Session.draft where the head's graph chooses.

Between two draft steps the Python loop reads the graph's choice, asks the policy's judge and feeds the step's hidden
state back: ~35 us a step with runner-ups on a 2-core EPYC (cache-cold, right after the step's graph), where the
step's graph takes ~0.35 ms at 8B's head on a GPU (bench/NOTES.md "chain"). chain.c runs
the same steps and both judges (draft.py's judge_p_min and AdaptivePolicy.judge, over the policy's arrays) without
coming back to Python until the judge stops. Where it cannot be built (no C compiler) the Python loop drafts.
"""

from __future__ import annotations

import ctypes
from array import array
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as C

from .batch import Batch
from .cbuild import library
from .context import Context, decode_failure, llama_get_embeddings_nextn, llama_get_embeddings_nextn_ith
from .draft import Draft, NativeJudge
from .errors import DecodeError, Eagle3Error
from .native import require_ext

_SOURCE = Path(__file__).with_name("chain.c")
CHOICE_MAX = 64  # the most tokens the graph may choose a step for chain.c (its CHOICE_MAX); more draft in Python
_LLAMA = ("decode", "synchronize", "get_sampled_token_ith", "get_sampled_probs_ith", "get_sampled_probs_count_ith",
          "get_sampled_candidates_ith", "get_sampled_candidates_count_ith", "encode", "get_memory", "memory_seq_rm",
          "memory_seq_pos_max")
_p = ctypes.c_void_p


class _Chain(ctypes.Structure):
    """chain.c's `struct chain`: llama.cpp's entry points and the head's width."""

    _fields_ = [*((name, _p) for name in _LLAMA), ("nextn_ith", _p), ("nextn", _p), ("n_embd", ctypes.c_int32),
                ("n_feat", ctypes.c_int32)]


class _Judge(ctypes.Structure):
    """chain.c's `struct judge`."""

    _fields_ = [("kind", ctypes.c_int32), ("k_max", ctypes.c_int32), ("n_bins", ctypes.c_int32),
                ("p_min", ctypes.c_double), ("prior", ctypes.c_double), ("ema", ctypes.c_double),
                ("r", ctypes.c_double), ("step_s", ctypes.c_double), ("prices", _p), ("hits", _p), ("seen", _p),
                ("pool_hits", _p), ("pool_seen", _p), ("lookahead", _p), ("confs_seen", _p),
                ("best_gain", ctypes.c_double)]


class _Run(ctypes.Structure):
    """chain.c's `struct chain_run`."""

    _fields_ = [("k", ctypes.c_int32), ("n_alt", ctypes.c_int32), ("tokens", _p), ("confs", _p), ("alt_tokens", _p),
                ("alt_probs", _p), ("steps", ctypes.c_int32), ("decoded", ctypes.c_int32), ("seeded", ctypes.c_int32),
                ("keep", ctypes.c_int32),
                ("t_native", ctypes.c_double), ("t_steps", ctypes.c_double)]


class _Seed(ctypes.Structure):
    """chain.c's `struct chain_seed`."""

    _fields_ = [("feats", _p), ("tokens", _p), ("pending_g", _p), ("seed_g", _p), ("n", ctypes.c_int32),
                ("o", ctypes.c_int32), ("pos0", ctypes.c_int32)]


_unavailable: str | None = None  # why chain.c cannot be built or loaded in this process, once found


def available() -> bool:
    """Whether drafts can run in one C call here: chain.c builds (a C compiler, once) and libllama has the staging
    API's pre-norm rows."""
    global _unavailable
    if _unavailable is None:
        try:
            require_ext()
            _compiled()
            _unavailable = ""
        except Eagle3Error as e:
            _unavailable = str(e)
    return not _unavailable


def _compiled() -> ctypes.CDLL:
    lib = library(_SOURCE, "drafting in one call", _Chain, (("judge", _Judge), ("run", _Run), ("seed", _Seed)))
    # int32_t eagle3_chain_draft(const struct chain *, struct llama_context *, llama_batch *, struct chain_run *,
    #                            struct judge *, int32_t row, int32_t pos, int32_t n_max, int32_t k, int32_t n_alt)
    i32 = ctypes.c_int32
    lib.eagle3_chain_draft.argtypes = [ctypes.POINTER(_Chain), _p, ctypes.POINTER(C.llama_batch), ctypes.POINTER(_Run),
                                       ctypes.POINTER(_Judge), i32, i32, i32, i32, i32]
    lib.eagle3_chain_draft.restype = ctypes.c_int32
    # int32_t eagle3_chain_seed_draft(const struct chain *, struct llama_context *, llama_batch * enc, llama_batch *,
    #                                 const struct chain_seed *, struct chain_run *, struct judge *, int32_t n_max,
    #                                 int32_t k, int32_t n_alt)
    lib.eagle3_chain_seed_draft.argtypes = [ctypes.POINTER(_Chain), _p, ctypes.POINTER(C.llama_batch),
                                            ctypes.POINTER(C.llama_batch), ctypes.POINTER(_Seed), ctypes.POINTER(_Run),
                                            ctypes.POINTER(_Judge), i32, i32, i32]
    lib.eagle3_chain_seed_draft.restype = ctypes.c_int32
    return lib


class Chain:
    """Drafts of one head context in chain.c, through its decoder batch: the entry points, the run's buffers (grown to
    the longest draft) and the call's arguments, made once. A draft's Python around the call runs cache-cold after the
    graphs, ~1 us an attribute, so the judge's struct is set only where its judge, tables or settings changed."""

    def __init__(self, ctx: Context, batch: Batch, enc_batch: Batch):
        """ctx: the head's context; batch: its decoder batch; enc_batch: its encoder batch (seed_draft)."""
        if not available():
            raise Eagle3Error(f"drafts cannot run in one call here: {_unavailable}")
        lib = _compiled()
        self._fn, self._seed_fn = lib.eagle3_chain_draft, lib.eagle3_chain_seed_draft
        self._ctx = ctx
        self._batch, self._enc_batch = batch, enc_batch
        self._api = _Chain(n_embd=ctx.model.n_embd, n_feat=enc_batch.n_embd,
                           nextn_ith=ctypes.cast(llama_get_embeddings_nextn_ith, _p),
                           nextn=ctypes.cast(llama_get_embeddings_nextn, _p))
        for name in _LLAMA:
            setattr(self._api, name, ctypes.cast(getattr(C._lib, f"llama_{name}"), _p))
        self._run = _Run()
        self._judge = _Judge()
        self._seed = _Seed()
        self._args = (ctypes.byref(self._api), ctypes.c_void_p(ctx.ptr), ctypes.byref(batch.struct),
                      ctypes.byref(self._run), ctypes.byref(self._judge))
        self._seed_args = (ctypes.byref(self._api), ctypes.c_void_p(ctx.ptr), ctypes.byref(enc_batch.struct),
                           ctypes.byref(batch.struct), ctypes.byref(self._seed), ctypes.byref(self._run),
                           ctypes.byref(self._judge))
        self._size = (0, 0)
        self._grow(8, 0)
        self._judged: tuple = ()  # what the judge struct was set from: (judge, n_max, seen, its tables)
        self._pins: list[memoryview] = []  # the buffers the struct points at, held (an array cannot be resized then)

    def _grow(self, n_max: int, n_alt: int) -> None:
        self._tokens = np.zeros(n_max, np.int32)  # [n_max]
        self._confs = np.zeros(n_max, np.float64)  # [n_max]
        self._alt_tokens = np.zeros(n_max * max(n_alt, 1), np.int32)  # [n_max, n_alt]
        self._alt_probs = np.zeros(n_max * max(n_alt, 1), np.float64)  # [n_max, n_alt]
        r = self._run
        r.tokens, r.confs = self._tokens.ctypes.data, self._confs.ctypes.data
        r.alt_tokens, r.alt_probs = self._alt_tokens.ctypes.data, self._alt_probs.ctypes.data
        self._size = (n_max, n_alt)

    def prepare(self, n_max: int, k: int, n_alt: int, judge: NativeJudge, seen: list[float] | None = None) -> None:
        """Check and set what a draft of up to n_max steps needs, the graph choosing k tokens a step, before the head's
        state is touched (draft() follows): every refusal is here. The judge sees `seen` where given instead of the
        head's confidences (a stand-in head's: Eagle3Session.judge_sees)."""
        if not 0 <= n_alt < k <= CHOICE_MAX:
            raise Eagle3Error(f"a draft in chain.c of {n_alt} runner-ups a step, the graph choosing {k} tokens: "
                              f"at most {CHOICE_MAX}, more than the runner-ups")
        if n_max > self._size[0] or n_alt > self._size[1]:
            self._grow(max(n_max, self._size[0]), max(n_alt, self._size[1]))
        seen = tuple(seen) if seen is not None else None
        tables = (judge.hits, judge.seen, judge.pool_hits, judge.pool_seen, judge.lookahead)
        last = self._judged
        if not last or last[0] is not judge or last[1] < n_max or last[2] != seen or \
                any(a is not b for a, b in zip(last[3], tables)):  # a policy's judge and tables stay
            self._set_judge(judge, n_max, seen, tables)
        if judge.hits is not None:  # the adaptive judge's prices move cycle by cycle
            if len(judge.prices) <= n_max:
                raise Eagle3Error(f"a draft of up to {n_max} judged at {len(judge.prices)} prices")
            j = self._judge
            self._prices = prices = array("d", judge.prices)  # [k_max + 1]
            j.r, j.step_s, j.prices = judge.r, judge.step_s, prices.buffer_info()[0]

    def _set_judge(self, judge: NativeJudge, n_max: int, seen: tuple[float, ...] | None, tables: tuple) -> None:
        j = self._judge
        if seen is not None and (len(seen) < n_max or not all(0.0 <= c <= 1.0 for c in seen)):
            raise Eagle3Error(f"the judge is to see {len(seen)} confidences in a draft of up to {n_max}, each a "
                              "probability")
        pins = []
        if judge.hits is None:
            j.kind, j.p_min = 0, judge.p_min
        else:
            hits, counts, pool_hits, pool_seen, lookahead = tables
            k_max, n_bins = len(lookahead), len(pool_hits)
            if len(hits) != k_max * n_bins or len(counts) != len(hits) or len(pool_seen) != n_bins:
                raise Eagle3Error(f"an adaptive judge's tables of {len(hits)} and {len(pool_hits)} counts over "
                                  f"{k_max} positions")
            if n_max > k_max:
                raise Eagle3Error(f"a draft of up to {n_max} judged over {k_max} positions")
            if any(not isinstance(a, array) or a.typecode != "d" for a in tables):
                raise Eagle3Error("an adaptive judge's tables are arrays of doubles (array('d'))")
            pins = [memoryview(a) for a in tables]
            j.hits, j.seen = hits.buffer_info()[0], counts.buffer_info()[0]
            j.pool_hits, j.pool_seen = pool_hits.buffer_info()[0], pool_seen.buffer_info()[0]
            j.lookahead = lookahead.buffer_info()[0]
            j.kind, j.k_max, j.n_bins, j.prior, j.ema = 1, k_max, n_bins, judge.prior, judge.ema
        self._seen = array("d", seen) if seen is not None else None  # [n_max]: kept while the struct points at it
        j.confs_seen = self._seen.buffer_info()[0] if seen is not None else None
        for pin in self._pins:
            pin.release()
        self._pins = pins
        self._judged = (judge, n_max, seen, tables)

    def draft(self, row: int, pos: int, n_max: int, k: int, n_alt: int, judge: NativeJudge) -> tuple[Draft, float]:
        """Eagle3Session.draft's loop from the seed's decode on (the batch holds it at `row`, head position `pos`), as
        prepare() set it: the Draft and the seconds of its steps after the first. The judge's arrays (the adaptive
        policy's) are updated in place; judge.done is told what it decided (judge.changed, where a draft failed after
        some steps had moved them)."""
        self._ctx._live()  # raises where the context was closed (the struct holds its raw pointer)
        return self._outcome(self._fn(*self._args, row, pos, n_max, k, n_alt), n_max, k, n_alt, judge)

    def seed_draft(self, feats: int, n: int, tokens: int, pending_g: int, seed_g: int, o: int, pos0: int, n_max: int,
                   k: int, n_alt: int, judge: NativeJudge) -> tuple[Draft, float]:
        """draft() after the seed's batch is made in C as Eagle3Session._seed_aside makes it: the head's encoder on the n
        rows at `feats` (the rows set aside), their g behind pending_g's (o = 1) in the decoder batch from head position
        pos0, with the o + n `tokens`, the head's cache cut after the seed's position; `seed_g` receives the seed step's
        g. `seeded` says afterwards, failed or not, whether the seed's batch was made (the session's state then moves).
        Addresses, not arrays: the session holds the buffers.
        # feats: [n, 3 * n_embd_tgt] float32; tokens: [o + n] int32; pending_g, seed_g: [n_embd] float32"""
        self._run.seeded = 0  # (not the last draft's, where this raises before the call)
        self._ctx._live()
        self._enc_batch.point_embd(n)
        self._batch.point_both(o + n)
        sd = self._seed
        sd.feats, sd.tokens, sd.pending_g, sd.seed_g, sd.n, sd.o, sd.pos0 = feats, tokens, pending_g, seed_g, n, o, pos0
        rc = self._seed_fn(*self._seed_args, n_max, k, n_alt)
        if rc > -100000 and rc != 0 and not self._run.decoded:  # the encoder's own failure, before any step
            self._ctx.ran(self._run.t_native, False)
            raise Eagle3Error(f"llama_encode failed (rc={rc})")
        return self._outcome(rc, n_max, k, n_alt, judge)

    @property
    def seeded(self) -> bool:
        """Whether the last seed_draft made the seed's batch (and cut the head's cache)."""
        return bool(self._run.seeded)

    def _outcome(self, rc: int, n_max: int, k: int, n_alt: int, judge: NativeJudge) -> tuple[Draft, float]:
        run = self._run
        steps, keep = run.steps, run.keep
        self._ctx.ran(run.t_native, bool(run.decoded))
        if rc != 0:
            if steps and judge.changed is not None:
                judge.changed()
            raise _failure(rc, k, n_alt, n_max)
        draft = Draft(self._tokens[:keep].tolist(), self._confs[:steps].tolist())
        if n_alt:
            a = n_alt
            alt_t, alt_p = self._alt_tokens[:steps * a].tolist(), self._alt_probs[:steps * a].tolist()
            draft.alt_tokens = [alt_t[i * a:(i + 1) * a] for i in range(steps)]
            draft.alt_probs = [alt_p[i * a:(i + 1) * a] for i in range(steps)]
        if judge.done is not None:
            judge.done(steps, keep, self._judge.best_gain)
        return draft, run.t_steps


def _failure(rc: int, k: int, n_alt: int, n_max: int) -> Eagle3Error:
    """What eagle3_chain_draft's nonzero rc means: its own codes, else llama_decode's."""
    if rc <= -400000:
        return Eagle3Error(f"draft step {-400000 - rc}'s confidence is not a probability (NaN or out of [0, 1])")
    if rc <= -300000:
        return Eagle3Error(f"no pre-norm hidden state for batch row {-300000 - rc}")
    if rc <= -200000:
        return Eagle3Error(f"chain.c refused a draft of up to {n_max} steps, {k} tokens chosen a step, {n_alt} "
                           "runner-ups")
    if rc <= -100000:
        return Eagle3Error(f"no tokens chosen in the graph for batch row {-100000 - rc}")
    return DecodeError(decode_failure(rc))
