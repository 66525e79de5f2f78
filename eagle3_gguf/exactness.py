"""The exactness probe: which verify widths this set-up computes bit for bit as target-only decoding does.

Greedy speculative output is the target's own text only where llama.cpp computes each row of a verify batch
of w rows exactly as it computes that row decoded alone. Whether it does depends on kernels that switch
paths with the batch's rows, the KV length, the weight types, the backend and the thread count (bench/NOTES.md,
exactness), so no list written in advance is right everywhere: like the cost curve, it is measured where the run
happens, at load, once per set-up (cached under the cost curve's key, in `~/.cache/eagle3-gguf/exact/`).

A seeded token sequence is decoded once one token at a time (the reference: what target-only decoding computes)
and again as one batch of w rows for w = 2, 3, ..., and compared bit for bit, in two parts:
- the logits, on the run's own target context, at a shallow depth: the whole graph as the run computes it, with
  feature extraction off for the reference and on for the batches (and for one more lone row: width 1, a plain
  cycle of a speculative run);
- every row of every matrix product (MUL_MAT, MUL_MAT_ID: where ggml's kernels switch paths; any difference
  upstream reaches the next one), on a context of the same set-up made with an eval callback (cb_eval can only
  be given when a context is made), at each depth where a kernel may switch: shallow, just past 256 tokens (where
  ggml-cpu's flash attention starts splitting a lone row's KV across threads) and past the sliding window of a
  target that has one (its cells are then reused). Logits alone can look equal where a kernel is not: an F32 MoE
  router multiplied by another kernel for one row than for two differs in its last bits on nearly every row, yet
  the logits part only where two experts nearly tie (1 row in 200 on our tiny qwen3moe). Each decode there stops
  once the graph has shown every kind of product and of attention it holds (the first layers, mostly): the
  layers after repeat them, so the products part costs a few percent of the logits part.
Widths are probed upwards and the first that parts ends the probe: a run keeps to the widths below it, one cap on
a verify batch's rows (`Speculator.policy_for`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGMLQuantizationType
from llama_cpp import llama_cpp as C

from . import keys
from .batch import Batch
from .context import Context
from .native import node_bytes, node_head, node_name, op_name
from .costs import CostKey

CACHE_VERSION = 2  # 2: where a width parts
SEED = 52  # the probe's token sequence
SHALLOW = 8  # tokens before the shallow probe
SPLIT_KV = 256  # past this many tokens a lone row's KV view reaches 512 cells (ggml-cpu's split-KV threshold)


@dataclass(frozen=True)
class ExactWidths:
    """What the probe found: verify batches of 1..exact rows compute every row bit for bit as target-only
    decoding does; widths 1..probed were examined, so exact < probed means width exact + 1 parted (0: even a
    plain cycle, one row with feature extraction on, parted)."""

    probed: int
    exact: int
    depths: tuple[int, ...]  # the KV depths probed
    seconds: float  # what the probe cost when it ran
    source: str = "probed"  # "probed", or "cache"
    parts_at: str = ""  # where width exact + 1 first parted, node by node (where_parts); "" where none did

    def covers(self, rows: int) -> bool:
        """Whether it answers for verify batches of up to `rows` rows (a parting width answers for all above)."""
        return self.probed >= rows or self.exact < self.probed


def probe_depths(target: Context, rows: int) -> list[int]:
    """The depths to probe a batch of up to `rows` rows at: shallow, past 256 tokens, past the sliding window
    where the target has one; those the context holds."""
    window = target.model.meta(keys.arch_key(keys.KEY_SLIDING_WINDOW, target.model.arch))
    depths = {SHALLOW, SPLIT_KV + 1}
    if window and window.isdigit() and int(window) > 0:
        depths.add(int(window) + 1)
    return sorted(d for d in depths if d + rows <= target.n_ctx)


def probe(target: Context, extract: Callable[[bool], None], rows: int, batch: Batch) -> ExactWidths:
    """Probe verify widths 1..rows on `target` (its cache is cleared before and after; feature extraction is
    left on, as a speculative run has it). `extract(on)` turns the head's feature extraction on or off."""
    t0 = time.perf_counter()
    depths = probe_depths(target, rows)
    if not depths:  # a context too small to hold a probe holds no verify batch worth speculating on either
        return ExactWidths(rows, 1, (), 0.0)
    tokens = np.random.default_rng(SEED).integers(0, target.model.n_vocab, depths[-1] + rows)  # [depth + rows]
    logits_exact = exact = _logits_exact(target, extract, batch, tokens, rows)
    parts_at = "a lone row, once the head's features are extracted" if exact == 0 else ""
    if exact >= 2:
        exact, parts_at = _products_exact(target, tokens, depths, exact)
    if exact == logits_exact < rows and exact >= 1:  # the logits parted first, at the shallow depth
        if exact < target.n_ubatch:
            parts_at = _naming(lambda: where_parts(target, tokens, SHALLOW, exact + 1))
        else:
            parts_at = f"a batch of {exact + 1} rows, computed as ubatches of {target.n_ubatch}"
    return ExactWidths(rows, exact, tuple(depths), time.perf_counter() - t0, parts_at=parts_at)


def _logits_exact(target: Context, extract: Callable[[bool], None], batch: Batch, tokens: np.ndarray,
                  rows: int) -> int:
    """How many widths from 1 up (at most rows) give every row the reference's logits on the run's own context,
    at the shallow depth."""
    greedy = target.greedy_sampling
    target.set_greedy_sampling(False)  # logits are compared, not the graph's argmax
    target.clear()
    try:
        extract(False)
        _prefix(target, batch, tokens, 0, SHALLOW)  # in batches of what it holds (a drop-in's n_batch may be 4)
        ref = np.empty((rows, target.model.n_vocab), np.float32)  # [rows, n_vocab]
        for i in range(rows):
            batch.set([int(tokens[SHALLOW + i])], SHALLOW + i, logits="all")
            target.decode(batch)
            ref[i] = target.logits_ith(0)
        extract(True)
        target.seq_rm(0, SHALLOW)
        batch.set([int(tokens[SHALLOW])], SHALLOW, logits="all")  # width 1: a lone row, extraction on
        target.decode(batch)
        if not np.array_equal(target.logits_ith(0), ref[0]):
            return 0
        for w in range(2, rows + 1):
            target.seq_rm(0, SHALLOW)
            batch.set(tokens[SHALLOW:SHALLOW + w].tolist(), SHALLOW, logits="all")
            target.decode(batch)
            if not np.array_equal(target.logits(w), ref[:w]):
                return w - 1
        return rows
    finally:
        target.clear()
        extract(True)
        target.set_greedy_sampling(greedy)


# ------------------------------------------------------------------------------------------------
# the cache (beside the cost curves, under the same key)
# ------------------------------------------------------------------------------------------------

def _path(key: CostKey) -> Path:
    costs = key.path()
    return costs.parent.with_name("exact") / costs.name


def load_exact(key: CostKey, rows: int) -> ExactWidths | None:
    """The cached probe for `key` when it answers for `rows` rows; None when there is none, or it is corrupt."""
    try:
        data = json.loads(_path(key).read_text())
        if data.get("version") != CACHE_VERSION or data.get("key") != asdict(key):
            return None
        found = ExactWidths(int(data["probed"]), int(data["exact"]), tuple(int(d) for d in data["depths"]),
                            float(data["seconds"]), "cache", str(data["parts_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 <= found.exact <= found.probed or not found.covers(rows):
        return None
    return found


def save_exact(key: CostKey, found: ExactWidths) -> None:
    """Write atomically; a cache that cannot be written is only a missed shortcut."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": asdict(key), "probed": found.probed,
                                   "exact": found.exact, "depths": list(found.depths), "seconds": found.seconds,
                                   "parts_at": found.parts_at}))
        os.replace(tmp, path)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------
# every matrix product's rows (a context of the target's set-up with an eval callback)
# ------------------------------------------------------------------------------------------------

# op -> the dimension that runs over a batch's tokens: a weight's product [n_out, n_tokens], attention's K·Q and V·KQ
# [.., n_tokens, n_head] (flash attention off), an expert's [n_out, n_used, n_tokens]
PRODUCTS = {"MUL_MAT": 1, "MUL_MAT_ID": 2}
# where a row meets the KV cache (its type and length pick kernels) -> the source holding it: K, or K·Q
ATTENTION = {"FLASH_ATTN_EXT": 1, "SOFT_MAX": 0}


@dataclass(frozen=True)
class _Product:
    name: str
    ne: tuple[int, int, int, int]  # its shape, ggml's order
    dim: int  # the dimension that runs over the batch's tokens
    data: bytes

    @property
    def n_tokens(self) -> int:
        return self.ne[self.dim]

    def token(self, i: int) -> bytes:
        """Token i's part of it (a slice across the other dimensions)."""
        a = np.frombuffer(self.data, np.float32).reshape(self.ne[::-1])  # [ne3, ne2, ne1, ne0]
        return np.ascontiguousarray(np.take(a, i, axis=3 - self.dim)).tobytes()


class ProbeCallback:
    """An eval callback (cb_eval, given to a Context as its `capture`: reset before each decode, check after)
    that keeps the output of every matrix product of a decode. With `stop` set, the graph stops computing after
    that many products. `stop_point()` says where, from a whole decode: once every kind of product (weights' type
    and shape) and of attention (KV type and length) the graph holds has been seen, and the product after it, the
    last product (the output layer, checked by the logits) aside."""

    def __init__(self):
        self.callback = C.ggml_backend_sched_eval_callback(self._eval)
        self.user_data = None
        self.stop: int | None = None
        self.products: list[_Product] = []
        self._kinds: list[tuple[bool, tuple]] = []  # (is a product, its kind), in computing order
        self.nodes: NodeRecorder | None = None  # set: every node is seen, by it, instead of the products

        self._error: BaseException | None = None  # raised in the callback, where ctypes would only print it

    def reset(self) -> None:
        self.products, self._kinds, self._error = [], [], None
        if self.nodes is not None:
            self.nodes.reset()

    @contextlib.contextmanager
    def keeping_escapes(self) -> Iterator[None]:
        """While in it, an exception raised as the callback is entered, before its first line (Python runs a pending
        signal's handler there: Ctrl-C, SIGTERM during a decode), is kept for check(), where ctypes would print and drop
        it and the graph would stop short unseen (a probe cut so once cached widths it had not measured)."""
        previous = sys.unraisablehook

        def hook(unraisable) -> None:
            if unraisable.object == self._eval and unraisable.exc_value is not None:
                self._error = self._error or unraisable.exc_value
            else:
                previous(unraisable)

        sys.unraisablehook = hook
        try:
            yield
        finally:
            sys.unraisablehook = previous

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def _eval(self, t: int, ask: bool, _user_data) -> bool:
        try:
            return self._see(t, ask)
        except BaseException as e:  # stop the graph: nothing it computes now is compared
            self._error = e
            return False

    def _see(self, t: int, ask: bool) -> bool:
        if self.nodes is not None:
            return self.nodes.see(t, ask)
        head = node_head(t)
        op = op_name(head.op)
        dim = PRODUCTS.get(op)
        if dim is None or head.type != 0 or head.ne[3] != 1:  # F32 results, no 4th dimension
            src = ATTENTION.get(op)
            if ask and src is not None and head.src[src]:  # noted, not kept: no split of the graph there
                kv = node_head(head.src[src])
                self._kinds.append((False, (op, kv.type, kv.ne[src])))
            return not ask  # asked: not wanted; told: go on computing
        if ask:
            w = node_head(head.src[0])
            self._kinds.append((True, (op, w.type, w.ne[0], w.ne[1])))
            return True
        self.products.append(_Product(node_name(t), tuple(head.ne), dim, node_bytes(t)))
        return self.stop is None or len(self.products) < self.stop

    def stop_point(self) -> int:
        """After how many products the last decode (a whole one) had shown every kind it holds."""
        kinds = self._kinds[:max(i for i, (product, _) in enumerate(self._kinds) if product)]  # the output aside
        seen: set[tuple] = set()
        last_new = 0
        for i, (_, kind) in enumerate(kinds):
            if kind not in seen:
                seen.add(kind)
                last_new = i
        # the first product at or after the last new kind (after an attention kind: its output projection)
        return sum(product for product, _ in self._kinds[:last_new]) + 1

    def row(self, i: int, n_tokens: int) -> list[tuple[str, bytes]]:
        """Digests of token i's rows in the last decode's products that span its n_tokens tokens, of its first `stop`
        products where one is set (a stopped decode's: counted among all products, before the span is asked, since
        some products span heads and tokens together: a q8_0 cache's graph holds [64, n_head * n_tokens] ones)."""
        kept = self.products if self.stop is None else self.products[:self.stop]
        return [(p.name, _digest(p.token(i))) for p in kept if p.n_tokens == n_tokens]


def _probe_context(target: Context, rec: ProbeCallback, n_ctx: int, n_ubatch: int | None = None) -> Context:
    """A context of the target's set-up (its LoRA adapters too; n_ubatch: the target's unless given), n_ctx cells,
    with rec as its eval callback."""
    return Context(target.model, n_ctx=n_ctx, n_batch=target.n_batch, n_ubatch=n_ubatch or target.n_ubatch,
                   n_threads=target.n_threads, type_k=target.kv_types[0], type_v=target.kv_types[1],
                   flash_attn=target.flash_attn, n_seq_max=target.n_seq_max, capture=rec, adapters=target.adapters)


def _prefix(ctx: Context, batch: Batch, tokens: np.ndarray, pos: int, depth: int) -> None:
    """Decode tokens[pos:depth] at their positions, in batches as a prompt is decoded."""
    while pos < depth:
        pos += batch.set(tokens[pos:min(depth, pos + batch.capacity)].tolist(), pos, logits="none")
        ctx.decode(batch)


def _products_exact(target: Context, tokens: np.ndarray, depths: list[int], rows: int) -> tuple[int, str]:
    """How many widths from 1 up (at most rows) compute every row of every matrix product as lone decodes do, at
    every depth, on a context of the target's set-up with a ProbeCallback, and where the next width parted
    (_parting_node; "" where none did). Each depth's first lone decode is whole and says where the others stop; the
    layers past a stop hold no KV for the rows decoded so, which changes their values but not their kernels, and
    nothing past the stop is compared. A batch wider than n_ubatch is computed as ubatches of widths compared
    before it, so the products are compared up to n_ubatch rows (the logits part compares every width whole)."""
    rec = ProbeCallback()
    with rec.keeping_escapes(), _probe_context(target, rec, depths[-1] + rows) as ctx, Batch(target.n_batch) as batch:
        pos = 0
        for depth in depths:
            _prefix(ctx, batch, tokens, pos, depth)
            pos = depth
            rec.stop = None
            ref = []  # [rows]: each lone row's product digests
            for i in range(rows):
                batch.set([int(tokens[depth + i])], depth + i, logits="all")
                ctx.decode(batch)
                if i == 0:
                    rec.stop = rec.stop_point()
                ref.append(rec.row(0, 1))
            for w in range(2, min(rows, ctx.n_ubatch) + 1):
                ctx.seq_rm(0, depth)
                batch.set(tokens[depth:depth + w].tolist(), depth, logits="all")
                ctx.decode(batch)
                if any(rec.row(i, w) != ref[i] for i in range(w)):
                    ctx.seq_rm(0, depth)
                    return w - 1, _naming(lambda: _parting_node(ctx, rec, batch, tokens, depth, w))
            ctx.seq_rm(0, depth)
    return rows, ""


def _naming(name: Callable[[], str]) -> str:
    """Where a width parts, or why it could not be named: the widths found stand without it (a context the
    diagnosis cannot make, on a GPU near full, fails it, not the load)."""
    try:
        return name()
    except Exception as e:  # an interrupt still ends the probe
        return f"not named ({e})"


# ------------------------------------------------------------------------------------------------
# where a width parts: every node, in computing order
# ------------------------------------------------------------------------------------------------

# where a width parts when no node computed apart does (ggml's graph whole takes a path its nodes alone do not)
WHOLE_ONLY = "no node computed apart: the whole graph only"
# where the batch's graph stops pairing with a lone row's, node for node, before any node parted
UNPAIRED = "the batch's graph differs from a lone row's from {name} on"
# ops whose result is a view of another node's data, or of the KV cache they write into: nothing of their own
VIEWS = {"NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "CPY", "SET_ROWS"}


@dataclass(frozen=True)
class _Node:
    name: str  # llama.cpp's ("ffn_gate-0"), or "layer 0, node_21" where it gave none
    ne: tuple[int, int, int, int]
    digest: bytes  # of its data: a lone decode's, one token's (a batch's: not kept)


class NodeRecorder:
    """A ProbeCallback's other mode (its `nodes`): it asks for every computed F32 node, so that each is computed apart
    from the next (nothing fused across it) and its data seen. A lone decode's nodes are kept as digests (`nodes`);
    once `ref` holds lone decodes' nodes, a batch's are compared with them as they are computed, token by token, and
    the graph stops at the first that differs (`parted`)."""

    def __init__(self):
        self.nodes: list[_Node] = []
        self.ref: list[list[_Node]] | None = None  # [width]: lone decodes' nodes, the batch's token i against ref[i]
        self.parted: str = ""  # what the first node that differs, or the first unpaired one, says
        self._layer = ""  # the layer of the last node named for one ("-0"): an unnamed node's

    def reset(self) -> None:
        self.nodes, self.parted, self._layer = [], "", ""

    def see(self, t: int, ask: bool) -> bool:
        head = node_head(t)
        op = op_name(head.op)
        # a stop ends only the scheduler's split: the graph's later splits (a GPU's after the CPU's) still come here
        if self.parted or op in VIEWS or head.type != 0 or not _contiguous(head):
            return not ask
        if ask:
            return True
        ne, name, data = tuple(head.ne), self._name(t), node_bytes(t)
        if self.ref is None:
            self.nodes.append(_Node(name, ne, _digest(data)))
            return True
        j, width = len(self.nodes), len(self.ref)
        node = _Node(name, ne, b"")
        self.nodes.append(node)
        lone = [r[j] if j < len(r) else None for r in self.ref]
        if any(n is None or n.name != node.name for n in lone):  # the graphs differ from here: nothing to pair
            self.parted = UNPAIRED.format(name=node.name)
            return False
        dims = [d for d in range(4) if ne[d] != lone[0].ne[d]]
        if len(dims) != 1 or ne[dims[0]] != width or lone[0].ne[dims[0]] != 1 or any(n.ne != lone[0].ne for n in lone):
            return True  # no single dimension over the batch's tokens (a mask, a KV view): not compared
        rows = _Product(name, ne, dims[0], data)  # its token-by-token slices, as a product's
        if any(_digest(rows.token(i)) != n.digest for i, n in enumerate(lone)):
            self.parted = f"{name}: {_what(head, op)}"
            return False  # found: stop the graph
        return True

    def _name(self, t: int) -> str:
        name = node_name(t)
        stem, _, il = name.rpartition("-")
        if stem and il.isdigit():
            self._layer = il
        return f"layer {self._layer}, {name}" if name.startswith("node_") and self._layer else name


def _contiguous(head) -> bool:
    stride = 4  # F32
    for d in range(4):
        if head.ne[d] > 1 and head.nb[d] != stride:
            return False
        stride *= head.ne[d]
    return True


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _type_name(t: int) -> str:
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def _what(head, op: str) -> str:
    """A node's op, and what picks its kernel: a product's matrix (weights, or a KV cache's view) by type and shape,
    attention's cache types and length."""
    if op in PRODUCTS and head.src[0]:
        w = node_head(head.src[0])
        return f"{op} of {_type_name(w.type)} {w.ne[0]} x {w.ne[1]}"
    if op == "FLASH_ATTN_EXT" and head.src[1] and head.src[2]:
        k, v = node_head(head.src[1]), node_head(head.src[2])
        return f"{op} over a {_type_name(k.type)} K / {_type_name(v.type)} V cache of {k.ne[1]} cells"
    return op


def _parting_node(ctx: Context, rec: ProbeCallback, batch: Batch, tokens: np.ndarray, depth: int, width: int) -> str:
    """Where a batch of `width` rows at `depth` first parts from lone decodes, on ctx (rec its eval callback, its cache
    holding the tokens before depth): the first node, in computing order, whose part for some row differs
    ("ffn_gate-0: MUL_MAT of Q4_K 896 x 4864, at depth 8"). A node parts where its inputs were equal: its
    own kernel took another path for the batch. Every node is computed apart there, so a parting that only the whole
    graph shows is not found there (WHOLE_ONLY). The cache is left as it was found."""
    nodes = rec.nodes = NodeRecorder()
    try:
        ref = []
        for i in range(width):
            batch.set([int(tokens[depth + i])], depth + i, logits="all")
            ctx.decode(batch)
            ref.append(nodes.nodes)
        ctx.seq_rm(0, depth)
        nodes.ref = ref
        batch.set(tokens[depth:depth + width].tolist(), depth, logits="all")
        ctx.decode(batch)
        return f"{nodes.parted}, at depth {depth}" if nodes.parted else WHOLE_ONLY
    finally:
        rec.nodes = None
        ctx.seq_rm(0, depth)


def where_parts(target: Context, tokens: np.ndarray, depth: int, width: int) -> str:
    """_parting_node on a context of the target's set-up made for it (n_ubatch `width`: the kernels a batch of
    `width` rows takes, at the compute buffer's least)."""
    rec = ProbeCallback()
    with rec.keeping_escapes(), _probe_context(target, rec, depth + width, width) as ctx, \
            Batch(target.n_batch) as batch:
        _prefix(ctx, batch, tokens, 0, depth)
        return _parting_node(ctx, rec, batch, tokens, depth, width)
