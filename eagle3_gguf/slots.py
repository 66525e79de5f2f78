"""Several generations at once on one target (`serve --parallel N`): their target decodes share one batch.

A `SlotPool` turns one Eagle3Llama into N slot objects. Each slot IS an Eagle3Llama (llama-cpp-python's
completion, chat, streaming, stop strings and sampler chains, unchanged) on its own KV sequence of one
shared target context, with its own head context and session, prompt state and statistics; its cycle is
the one run every surface drives (speculator.Speculator, on sequence `seq`, reading its rows from `row0`). Only the
target's decode is shared: `JointTarget.decode` puts the rows of the slots that are generating into one
batch. A batch goes when every slot that is generating and not away with a token for its caller has handed
in its rows (one that is away is waited for up to a quarter of a decode); the slot that completes the set
decodes for all.

One thread computes every graph (`Engine`): the Eagle3Llama is built on it and the pool's contexts, the
target's and the heads', hand their decodes to it. ggml's OpenMP team belongs to the calling thread, and
once two threads have teams, libgomp (more threads than cores) stops spinning at barriers: every decode of
SmolLM2 on 2 cores ran ~2x slower while a second computing thread merely existed (bench/NOTES.md).

What exactness takes (tests/test_slots.py): one KV stream per sequence (kv_unified=False). In a unified
cache a sequence's cells interleave with the others' after a rejected draft is cut, flash attention sums
them in another order, and greedy text drifted on 2 of 4 sequences within 60 steps. With streams, llama.cpp
cuts a batch into ubatches with equally many rows per sequence and consecutive sequence ids, and the layer
inputs come back in ubatch order: so a batch takes the slots handing in as many rows as the longest-waiting
one, sorted by sequence, and each reads its rows back at its offset.

Limits: a slot's context is as large as the Eagle3Llama's own (serve makes that -c / N, as llama-server
splits its context; llama.cpp pads it to a multiple of 256 either way, as a lone Llama's); the adaptive
policy uses the single-sequence cost curve the Eagle3Llama calibrated; a slot never falls back to plain
Llama decoding (sequence 0 of the shared context), so draft_max 0, an empty prompt and
generate(reset=False) are errors there; logits_all and a prompt cache are refused at setup.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from . import rpc
from .batch import Batch
from .context import Context
from .errors import Eagle3Error
from .llama import Eagle3Llama
from .costs import DENSE_ROWS
from .session import Eagle3Session
from .speculator import Speculator
from .stats import SpecStats

GRACE = 0.25  # how long a batch waits for slots away with a token, in decodes (the last one's time)


@dataclass(eq=False)
class _Rows:
    """One slot's rows waiting for the shared batch."""

    seq: int
    batch: Batch
    since: float = 0.0  # when they were handed in
    row0: int = -1  # where they went in the shared batch
    seconds: float = 0.0  # how long the shared decode took
    error: BaseException | None = None
    done: bool = False
    alone: bool = False  # a shared decode with it failed: it goes again by itself


@dataclass
class JointStats:
    """What the shared batches held."""

    decodes: int = 0
    seconds: float = 0.0
    rows: int = 0
    sequences: int = 0  # summed over decodes: sequences per decode = sequences / decodes
    most_sequences: int = 0
    by_sequences: dict[int, int] = field(default_factory=dict)  # sequences in a decode -> decodes


class Engine:
    """The one thread that computes every graph of a served model and its slots (see the module's doc): `call`
    runs a function there and returns its result or raises its error; `adopt` routes a context's graphs there."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._watchdog: rpc.Watchdog | None = None  # armed while a graph call runs (watch())
        self._thread = threading.Thread(target=self._serve, name="eagle3-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:  # the caller's
                job.error = e
            job.done.release()
            del job  # nothing of the last job (its result may be a model) outlives it here

    def call(self, fn, *args):
        if threading.current_thread() is self._thread:  # already here (a graph call inside a called function)
            return fn(*args)
        if not self._thread.is_alive() or self._closed:
            raise Eagle3Error("the engine thread is closed")
        job = _Job(fn, args)
        self._jobs.put(job)
        try:
            job.done.acquire()
        except BaseException:  # interrupted: the engine still runs it, on memory the caller may free next
            job.done.acquire()
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def graph(self, fn, *args):
        """call() for one of llama.cpp's graph calls, timed for watch()."""
        return self.call(self._timed, fn, *args)

    def _timed(self, fn, *args):
        watchdog = self._watchdog
        if watchdog is None:
            return fn(*args)
        watchdog.tick()
        try:
            return fn(*args)
        finally:
            watchdog.pause()

    def watch(self, limit: float, on_stall: Callable[[float], None]) -> None:
        """Call on_stall(seconds) (once, from rpc.Watchdog's thread) when one graph call has run for more than
        `limit` seconds (an rpc-server that stopped answering)."""
        self._watchdog = rpc.Watchdog(limit, on_stall)

    def adopt(self, ctx: Context) -> Context:
        """Run ctx's graphs (decode, encode, process) on this thread (its `runner`)."""
        ctx.runner = self.graph
        return ctx

    def adopt_llama(self, llm: Eagle3Llama) -> Eagle3Llama:
        """Run all of an Eagle3Llama's graphs on this thread: its target's and head's, and llama-cpp-python's
        own decodes on its context (plain decoding, where it falls back)."""
        self.adopt(llm._e3_pair.target)
        self.adopt(llm._e3_pair.head)
        llm.run_graphs_with(self.graph)
        return llm

    def close(self) -> None:
        """Stop the thread once the jobs handed in so far have run."""
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


@dataclass(eq=False)
class _Job:
    fn: Callable
    args: tuple
    result: object = None
    error: BaseException | None = None
    done: threading.Lock = field(default_factory=lambda: _locked())


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


class JointTarget:
    """A target context with one KV sequence per slot, and the one batch their decodes share."""

    def __init__(self, target: Context, capacity: int):
        self.target = target
        self.batch = Batch(capacity)
        self.stats = JointStats()
        self._cond = threading.Condition()
        self._present = 0  # slots generating and not away with a token
        self._away: dict[int, float] = {}  # slots generating but away with a token: sequence -> since when
        self._waiting: list[_Rows] = []
        self._busy = False  # a decode runs (outside the lock)
        self._seconds: dict[int, float] = {}  # the last decode's time by rows per slot: how long to wait

    def close(self) -> None:
        self.batch.close()

    def enter(self, seq: int) -> None:
        """A slot starts or resumes generating: batches wait for its rows."""
        with self._cond:
            while self._busy:  # its work would compete with the decode for the cores
                self._cond.wait()
            self._away.pop(seq, None)
            self._present += 1

    def leave(self, seq: int) -> None:
        """A slot yields a token to its caller (it is away), or ends (end() follows)."""
        with self._cond:
            self._present -= 1
            self._away[seq] = time.perf_counter()
            self._cond.notify_all()

    def end(self, seq: int) -> None:
        """A slot's generation is over: batches no longer wait for it."""
        with self._cond:
            self._away.pop(seq, None)
            self._cond.notify_all()

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Cut a slot's sequence, never while a decode runs (a slot starting, or ending while the others
        decode, would change the cache under them)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            return self.target.seq_rm(seq, p0, p1)

    def decode(self, seq: int, batch: Batch) -> tuple[int, float]:
        """Decode `batch` (one slot's rows, sequence `seq`) with the other present slots' rows. Returns
        where its rows start in the shared batch and the seconds the decode took."""
        rows = _Rows(seq, batch, since=time.perf_counter())
        with self._cond:
            self._waiting.append(rows)
            try:
                while not rows.done:
                    if self._busy or len(self._waiting) < self._present:
                        self._cond.wait()
                        continue
                    late = self._late()
                    if late > 0:
                        self._cond.wait(late)
                        continue
                    self._lead()
            except BaseException:  # interrupted while waiting: its rows must not go in a later batch
                if rows in self._waiting:
                    self._waiting.remove(rows)
                    self._cond.notify_all()
                raise
        if rows.error is not None:
            raise rows.error
        return rows.row0, rows.seconds

    def _late(self) -> float:
        """How much longer the batch of the longest-waiting rows waits for slots that are away with a token
        (0: go). A slot's caller usually hands it back within a fraction of a decode, and its rows are worth
        a quarter of one; one that has been away longer than a decode (a slow client) is not waited for."""
        first = self._waiting[0]
        decode = self._seconds.get(first.batch.n_rows, 0.0)
        now = time.perf_counter()
        if not any(now - since < decode for since in self._away.values()):
            return 0.0
        return first.since + GRACE * decode - now

    def _lead(self) -> None:
        """Decode the waiting slots that hand in as many rows as the longest-waiting one, in order of
        sequence (called holding the lock; decodes without). Each sequence has its own KV stream, and
        llama.cpp splits such a batch into ubatches of equally many rows per sequence and of consecutive
        sequence ids: with equal counts, sorted, the batch is one ubatch (or one per run of consecutive
        ids), and the layer inputs come back in batch order, where each slot reads them. (So llama.cpp has
        no outputs to reorder either: the slots read their logits concurrently, and a reorder would move
        them in place.) Rows whose shared decode failed go again one slot at a time (`alone`), so an error
        reaches only the slot it belongs to."""
        first = self._waiting[0]
        m = first.batch.n_rows
        if first.alone:
            take = [first]
        else:
            take = [rows for rows in self._waiting if rows.batch.n_rows == m and not rows.alone]
            take = take[:self.batch.capacity // m]
        take.sort(key=lambda rows: rows.seq)
        for i, rows in enumerate(take):
            rows.row0 = i * m
        n = len(take) * m
        self._waiting = [rows for rows in self._waiting if rows.row0 < 0]
        self._busy = True
        self._cond.release()
        error, seconds = None, 0.0
        try:
            for rows in take:
                self.batch.put_rows(rows.batch, rows.row0, rows.seq)
            self.batch.finish_rows(n)
            t = time.perf_counter()
            self.target.decode(self.batch)
            seconds = self._seconds[m] = time.perf_counter() - t
        except BaseException as e:
            error = e
        finally:
            self._cond.acquire()
        self._busy = False
        if error is not None and len(take) > 1:  # whose rows failed: each goes again alone, first in line
            for rows in take:
                rows.row0, rows.alone = -1, True
            self._waiting[:0] = take
            self._cond.notify_all()
            return
        for rows in take:
            rows.seconds, rows.error, rows.done = seconds, error, True
        st = self.stats
        st.decodes += 1
        st.seconds += seconds
        st.rows += n
        st.sequences += len(take)
        st.most_sequences = max(st.most_sequences, len(take))
        st.by_sequences[len(take)] = st.by_sequences.get(len(take), 0) + 1
        self._cond.notify_all()


class _SlotTurn:
    """A slot's generation lock (Eagle3Llama's `_e3_running`): holding it is being present in the joint
    batch, so _Turn's take/release around every yield are also the slot's enter/leave."""

    def __init__(self, joint: JointTarget, seq: int):
        self.joint = joint
        self.seq = seq
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True) -> bool:
        if not self._lock.acquire(blocking):
            return False
        self.joint.enter(self.seq)
        return True

    def release(self) -> None:
        self.joint.leave(self.seq)
        self._lock.release()


class SlotSpeculator(Speculator):
    """The speculative cycle on sequence `seq` of the joint target."""

    def __init__(self, joint: JointTarget, seq: int, session: Eagle3Session, base: Speculator):
        super().__init__(joint.target, session, joint.batch.capacity)
        self.joint = joint
        self.seq = seq
        self.trees = False  # the joint target's sequences are the slots
        self.head_choice = "off"  # its costs are the Eagle3Llama's, calibrated once (a slot cannot time its own)
        self.costs = copy.deepcopy(base.costs)  # each slot's policy refines its own
        self.exact = base.exact  # the verify widths the Eagle3Llama's probe found exact (a slot's rows are its own)
        self.t_target = 0.0  # seconds of the shared decodes this slot's rows were in

    def decode(self, batch: Batch) -> None:
        row0, seconds = self.joint.decode(self.seq, batch)
        self.row0 = self.session.extract.row0 = row0
        self.t_target += seconds

    def native_time(self) -> float:
        return self.t_target + self.session.draft_ctx.t_native

    def clear_target(self) -> None:
        self.seq_rm(0)

    def seq_rm(self, p0: int, p1: int = -1) -> bool:
        return self.joint.seq_rm(self.seq, p0, p1)

    def probe_exact(self, rows: int):
        raise Eagle3Error(f"a parallel slot verifies at most {self.exact.probed if self.exact else 0} rows (the "
                          f"exactness probe at setup): set draft_max before making the SlotPool")

    def calibrate(self, k_max: int, dense_rows: int = DENSE_ROWS):
        raise Eagle3Error(f"a parallel slot drafts at most {self.costs.k_max if self.costs else 0} tokens (the "
                          f"cost curve measured at setup): set draft_max before making the SlotPool")


class _CtxView:
    """What llama-cpp-python's sampler reads of a context: its pointer (the joint target's)."""

    def __init__(self, ptr):
        self.ctx = ptr


class SlotLlama(Eagle3Llama):
    """One slot of a SlotPool (made by it): an Eagle3Llama on its own sequence of the shared target. What
    llama-cpp-python keeps per generation (context view, input_ids, n_tokens, sampler) and the head's state
    are the slot's own; everything else (settings, model, tokenizer, chat handler, the drafting config until
    the slot is given its own) is read from the pool's Eagle3Llama, never written there. Closing a slot does
    nothing; the pool and the Eagle3Llama it came from own what it uses."""

    def __init__(self, llm: Eagle3Llama, spec: SlotSpeculator, n_ctx: int):
        self._e3_parent = llm
        self._ctx = _CtxView(spec.target.ptr)
        self._n_ctx = n_ctx
        self.verbose = False  # llama-cpp-python's timings are per context: not a slot's
        self.input_ids = np.zeros(n_ctx, dtype=np.intc)  # [n_ctx]
        self.n_tokens = 0
        self._sampler = None
        self._e3_spec = spec
        self._e3_pair = None
        self._e3_head_tokens: list[int] = []
        self._e3_running = _SlotTurn(spec.joint, spec.seq)
        self._e3_generation = 0
        self._e3_unfinished = False
        self._e3_budget = None
        self.spec_stats = SpecStats()
        self.spec_fallback = None

    def __getattr__(self, name: str):  # only for names the slot does not hold: the pool's Eagle3Llama's
        parent = self.__dict__.get("_e3_parent")
        if parent is None:
            raise AttributeError(name)
        return getattr(parent, name)

    __setattr__ = object.__setattr__  # a slot's writes stay the slot's

    def close(self) -> None:
        pass

    def __del__(self) -> None:
        pass

    def n_ctx(self) -> int:
        return self._n_ctx

    def generate(self, *args, **kwargs):
        """Eagle3Llama.generate; when it is over, batches stop waiting for this slot."""
        try:
            return (yield from super().generate(*args, **kwargs))
        finally:
            self._e3_spec.joint.end(self._e3_spec.seq)

    def _plain_generate(self, tokens, reset, stopping_criteria, sampling) -> Iterator[int]:
        raise Eagle3Error(f"a parallel slot cannot decode plainly ({self.spec_fallback}): give it a prompt, "
                          "reset=True and draft_max >= 1")


class SlotPool:
    """N slots over one Eagle3Llama's model and head: `acquire()` a free one, use it as an Eagle3Llama,
    `release()` it. The target context (a KV stream per slot as large as the Eagle3Llama's context) and the N
    head contexts are made here; the Eagle3Llama keeps its own context (its cost calibration ran there).
    `engine` is the thread the Eagle3Llama was built on (`Engine.call`): every graph of the pool and of the
    Eagle3Llama's contexts runs there from now on.

        engine = Engine()
        llm = engine.call(lambda: Eagle3Llama(model_path=..., draft_model_path=..., n_ctx=1024))
        pool = SlotPool(llm, 4, engine)   # 4 slots of 1024
    """

    def __init__(self, llm: Eagle3Llama, n: int, engine: Engine):
        if not isinstance(llm, Eagle3Llama) or isinstance(llm, SlotLlama):
            raise Eagle3Error("SlotPool needs an Eagle3Llama")
        if n < 1:
            raise Eagle3Error(f"a slot pool needs at least one slot (got {n})")
        n_slot = llm._n_ctx  # the cells llama.cpp gave its context: every slot answers as it would alone
        if llm._logits_all:
            raise Eagle3Error("parallel slots do not keep every row's logits: create the Llama with logits_all=False")
        if llm.cache is not None:
            raise Eagle3Error("parallel slots cannot share a prompt cache: create the Llama without set_cache()")
        if llm.draft_config.draft_max < 1:
            raise Eagle3Error("parallel slots speculate: draft_max must be at least 1")
        if llm.draft_config.draft_topk > 1:
            raise Eagle3Error("parallel slots draft chains: set draft_topk 1")
        self.llm = llm
        self.n_slot_ctx = n_slot
        spec = llm._e3_spec
        if spec.costs is None and llm.draft_config.draft_policy == "adaptive":  # pragma: no cover - setup calibrates
            raise Eagle3Error("the Eagle3Llama has no cost curve yet")
        self.engine = engine
        engine.adopt_llama(llm)
        cp = llm.context_params
        # llama-cpp-python's class for the slots: a subclass of Llama stays one
        self._slot_class = (SlotLlama if type(llm) is Eagle3Llama
                            else type(f"Slot{type(llm).__name__}", (SlotLlama, type(llm)), {}))
        self._owned: list = []
        self.slots: list[SlotLlama] = []
        try:
            target = Context(spec.target.model, n_ctx=n_slot * n, n_batch=llm.n_batch, n_ubatch=llm.n_batch,
                             n_threads=cp.n_threads, n_seq_max=n, kv_unified=False, type_k=cp.type_k,
                             type_v=cp.type_v)
            self._owned.append(target)
            engine.adopt(target)
            self.joint = JointTarget(target, llm.n_batch)
            self._owned.append(self.joint)
            for seq in range(n):
                draft = Context(llm._e3_pair.head.model, n_ctx=n_slot, n_batch=llm.n_batch, n_threads=cp.n_threads,
                                ctx_other=target)
                self._owned.append(draft)
                engine.adopt(draft)
                slot_spec = SlotSpeculator(self.joint, seq, Eagle3Session(target, draft), spec)  # closes the session
                self._owned.append(slot_spec)
                self.slots.append(self._slot_class(llm, slot_spec, n_slot))
        except BaseException:
            self.close()
            raise
        self._free = list(self.slots)
        self._cond = threading.Condition()
        llm._stack.callback(self.close)  # before the Llama frees the model the contexts use

    def close(self) -> None:
        for owner in reversed(self._owned):
            owner.close()
        self._owned.clear()

    # -- handing slots out -------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None) -> SlotLlama:
        """A free slot (waiting for one, first come first served up to `timeout` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise Eagle3Error(f"no slot was free within {timeout} s")
            return self._free.pop(0)

    def try_acquire(self) -> SlotLlama | None:
        with self._cond:
            return self._free.pop(0) if self._free else None

    def release(self, slot: SlotLlama) -> None:
        with self._cond:
            if slot in self._free or slot not in self.slots:
                raise Eagle3Error("this slot is not out of this pool")
            self._free.append(slot)
            self._cond.notify()
