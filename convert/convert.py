"""`convert_head`: an EAGLE-3 checkpoint + its target → a GGUF the pinned llama.cpp loads as `eagle3`.

Order of work: describe the target, open the checkpoint, detect its layout, resolve the layer ids,
check every shape and the whole d2t against the target (all before an output byte is written), then
plan the GGUF and stream it tensor by tensor. Never prints; a user error is one `Eagle3Error` line.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType as VT
from gguf import LlamaFileType

from .. import keys
from ..errors import Eagle3Error
from ..gguf_file import GGUF_MAGIC, HeadGeometry, KeyValue, TargetInfo, TensorEntry, check_head, read_gguf
from ..hf_archs import HF_ARCHITECTURES
from .layouts import MAX_INT, KIND_D2T, KIND_K, KIND_NORM, KIND_Q, T2D_TENSOR, HeadSpec, LayerIds, TensorSource, \
    detect_layout, resolve_layer_ids
from .quantize import Encoded, can_quantize, encode, ggml_type, n_bytes
from .readers import FLOAT_DTYPES, Checkpoint, open_checkpoint, read_json
from .writer import PlannedTensor, WrittenTensor, write_gguf

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
FC_TYPES = ("q4_0", "q8_0", "f16", "bf16", "f32")
# The matrices' type by default: a draft step of an 8B-shaped head cost 11.2 ms in Q8_0 against 18.8 in F16 (this
# 2-core host), and Q8_0 kept the shipped head's acceptance (bench/NOTES.md, "head-types")
DEFAULT_OUTTYPE, DEFAULT_FC_TYPE = "q8_0", "q4_0"
_FILE_TYPE = {GT.F32: LlamaFileType.ALL_F32, GT.F16: LlamaFileType.MOSTLY_F16, GT.BF16: LlamaFileType.MOSTLY_BF16,
              GT.Q8_0: LlamaFileType.MOSTLY_Q8_0}


@dataclass
class TensorRow:
    name: str
    shape: list[int]  # GGUF order: ne[0] (the row length) first
    type: str
    bytes: int
    rel_error: float | None  # relative quantization error; 0.0 when exact, None for d2t
    source: str  # the checkpoint tensor it came from


@dataclass
class ConvertResult:
    out: Path
    layout: str
    layout_reason: str
    target: Path
    target_kind: str
    layer_ids: LayerIds
    n_embd: int
    target_hidden_size: int
    target_vocab: int
    draft_vocab: int | None  # len(d2t); None when the head drafts over the full target vocab
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: list[int] | None  # EAGLE 3.1: [3, n_embd_tgt] of the per-feature norms as stored (metadata), or None
    norm_output: bool  # EAGLE 3.1: output_norm(h) is fed back as g
    own_token_embd: bool
    own_output: bool
    outtype: str
    fc_type: str
    rows: list[TensorRow]
    file_bytes: int
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_out_path(src: str | Path) -> Path:
    """`DIR` → `DIR.gguf` beside it; `x/model.safetensors` → `x/model.gguf`."""
    src = Path(src)
    if src.is_dir():
        return src.parent / f"{src.resolve().name}.gguf"
    return src.with_name(src.name.split(".")[0] + ".gguf")


# ------------------------------------------------------------------------------------------------
# The target
# ------------------------------------------------------------------------------------------------


def describe_target(target: str | Path | TargetInfo) -> TargetInfo:
    """Hidden size, layer count and vocab of the target, from its GGUF (tokenizer included) or its HF
    config.json; a TargetInfo read already is only checked."""
    if isinstance(target, TargetInfo):
        return _check_tokenizer(target)
    target = Path(target)
    if not target.is_file():
        raise Eagle3Error(f"{target}: no such target file (give the target .gguf or its config.json)")
    with open(target, "rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return _check_tokenizer(TargetInfo.from_gguf(read_gguf(target)))
    if target.suffix != ".json":
        raise Eagle3Error(f"{target}: target must be a GGUF file or a HF config.json")
    cfg = read_json(target)
    if not isinstance(cfg, dict):
        raise Eagle3Error(f"{target}: expected a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise Eagle3Error(f"{target}: target config lacks '{missing[0]}'")
    for k in ("num_hidden_layers", "hidden_size", "vocab_size"):
        v = cfg[k]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_INT:
            raise Eagle3Error(f"{target}: target config '{k}' must be an integer in 1..{MAX_INT}, got {v!r}")
    # llama.cpp's name for it, as its converter maps the HF architecture class ("" where it converts none)
    hf = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    arch = next((HF_ARCHITECTURES[a] for a in hf if isinstance(a, str) and a in HF_ARCHITECTURES), "")
    return TargetInfo(target, arch, cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"],
                      arch in keys.HOOKED_TARGET_ARCHS, kind="config.json")


def _check_tokenizer(info: TargetInfo) -> TargetInfo:
    """A GGUF target, refused unless it carries the tokenizer the head copies."""
    if info.kind == "gguf" and (not info.n_vocab or
                                not any(kv.key == keys.KEY_TOKENIZER_TOKENS for kv in info.tokenizer)):
        raise Eagle3Error(f"{info.path}: target GGUF carries no tokenizer ({keys.KEY_TOKENIZER_TOKENS})")
    return info


# ------------------------------------------------------------------------------------------------
# Checks (metadata only, plus the small d2t)
# ------------------------------------------------------------------------------------------------


FIX_CONFIG = "fix config.json"
FIX_CHECKPOINT = "fix the checkpoint or its config.json"


def _geometry(ckpt: Checkpoint, spec: HeadSpec, target: TargetInfo, n_feat: int) -> HeadGeometry:
    """The numbers the GGUF will hold (n_feat: the target features fc reads), checked by the rules the loader
    applies: a config the pinned graph cannot run (14 heads over 3 KV heads, an odd head_dim) is refused here,
    before a tensor is read."""
    hp = spec.hparams
    geo = HeadGeometry(n_layer=1, n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv, head_dim=hp.head_dim,
                       head_dim_v=hp.head_dim, n_rot=hp.head_dim, n_ff=hp.n_ff, n_embd_tgt=target.n_embd,
                       n_feat=n_feat, norm_before_fc=spec.norm_before_fc)
    geo.check(ckpt.config_path or ckpt.path, FIX_CONFIG)
    return geo


def _check_shapes(ckpt: Checkpoint, spec: HeadSpec, target: TargetInfo, geo: HeadGeometry) -> None:
    """Every shape against the config and the target, named as the checkpoint names them."""
    hp, where, n_feat = spec.hparams, ckpt.path, geo.n_feat
    fc = ckpt.tensors[spec.source(keys.T_FC).src_name].shape
    if len(fc) != 2 or fc[0] != hp.n_embd or fc[1] % n_feat:
        raise Eagle3Error(f"{where}: fc.weight is {list(fc)}, expected [hidden_size {hp.n_embd}, {n_feat} x target "
                          f"hidden]")
    trained_for = fc[1] // n_feat
    if trained_for != target.n_embd:
        raise Eagle3Error(f"{where}: fc.weight is {list(fc)}, so the head was trained for a target of hidden size "
                          f"{trained_for}, but {target.path.name} has hidden size {target.n_embd}")
    if hp.target_hidden_size is not None and hp.target_hidden_size != trained_for:
        raise Eagle3Error(f"{where}: config target_hidden_size {hp.target_hidden_size} disagrees with fc.weight "
                          f"{list(fc)} ({n_feat} x {trained_for})")
    for gguf_name, expected in geo.shapes().items():
        src = spec.source(gguf_name)
        shape = tuple(reversed(expected.dims))  # PyTorch order
        if src is not None and ckpt.tensors[src.src_name].shape != shape:
            raise Eagle3Error(f"{where}: '{src.src_name}' is {list(ckpt.tensors[src.src_name].shape)}, "
                              f"expected {list(shape)} from config.json")
    if spec.fc_norm and len(spec.fc_norm) != n_feat:
        raise Eagle3Error(f"{where}: head has {len(spec.fc_norm)} fc_norm weights but fc reads {n_feat} target "
                          f"features: one per feature is needed")
    if spec.norm_before_fc and n_feat != keys.N_TARGET_LAYERS:
        raise Eagle3Error(f"{where}: norm_before_fc spans the {n_feat} features this head reads; the pinned graph "
                          f"reads {keys.N_TARGET_LAYERS} and that norm cannot be padded, so this head cannot run")
    for name in spec.fc_norm:
        if ckpt.tensors[name].shape != (trained_for,):
            raise Eagle3Error(f"{where}: '{name}' is {list(ckpt.tensors[name].shape)}, expected [target hidden "
                              f"{trained_for}]")
    embd = spec.source(keys.T_TOKEN_EMBD)
    if embd is not None and ckpt.tensors[embd.src_name].shape != (target.n_vocab, hp.n_embd):
        raise Eagle3Error(f"{where}: '{embd.src_name}' is {list(ckpt.tensors[embd.src_name].shape)}, expected "
                          f"[target vocab {target.n_vocab}, {hp.n_embd}]")
    if embd is None and hp.n_embd != target.n_embd:
        raise Eagle3Error(f"{where}: head has no embed_tokens and hidden size {hp.n_embd}, so it cannot borrow "
                          f"the target's {target.n_embd}-wide token embeddings")


EMBD_SAMPLE_ROWS = 1024  # token rows compared, spread over the vocab
EMBD_SLACK = 0.01  # beyond the target's own rounding: a bf16 copy against an f16 table differs by ~0.002


def _target_embd_copy(ckpt: Checkpoint, src: TensorSource, tgt: TargetInfo) -> tuple[bool, str]:
    """Whether the head's embed_tokens is the target's token table, and a note that says why: over sampled
    rows, their relative RMS difference from the target's dequantized token_embd must be within 1.5x what
    the target's quantization makes of the head's own rows (ggml's quantizer, no importance matrix), plus
    EMBD_SLACK. A head with only a config.json for its target keeps its table."""
    keep = "embed_tokens kept"
    if tgt.kind != "gguf":
        return False, (f"{keep}: with only a config.json the target's table cannot be compared (give the target "
                       ".gguf to drop a copy of it)")
    info = tgt.token_embd
    n_vocab, width = ckpt.tensors[src.src_name].shape
    if info is None or info.shape != [width, n_vocab]:
        return False, f"{keep}: the target has no {width}-wide token_embd of {n_vocab} rows to compare it with"
    rows = np.unique(np.linspace(0, n_vocab - 1, min(EMBD_SAMPLE_ROWS, n_vocab)).astype(np.int64))
    ours = ckpt.load(src.src_name)[rows]  # [n, width] float32
    from gguf import quants

    from ..gguf_file import read_tensor_rows
    from ..native import quantize_rows

    raw = read_tensor_rows(tgt.path, info, rows)  # [n, row bytes]
    requant = quantize_rows(ours, int(info.ggml_type), raw.shape[1])  # [n, row bytes]
    try:
        theirs = quants.dequantize(raw, info.ggml_type)  # [n, width]
        ours_rounded = quants.dequantize(requant, info.ggml_type) if requant is not None else None
    except NotImplementedError:  # gguf-py reads most types, not all
        ours_rounded = None
    if ours_rounded is None:
        return False, f"{keep}: the target's {info.ggml_type.name} token table cannot be compared here"
    norm = float(np.sqrt(np.mean(ours.astype(np.float64) ** 2))) or 1.0
    diff = float(np.sqrt(np.mean((ours - theirs.reshape(ours.shape)) ** 2))) / norm
    rounding = float(np.sqrt(np.mean((ours - ours_rounded.reshape(ours.shape)) ** 2))) / norm
    tol = 1.5 * rounding + EMBD_SLACK
    mib = n_vocab * width * 2 / 2**20
    if diff <= tol:
        return True, (f"embed_tokens is the target's {info.ggml_type.name} token table (relative RMS difference "
                      f"{diff:.4f} <= {tol:.4f} on {len(rows)} rows): left out, the target's is borrowed "
                      f"(~{mib:.0f} MiB saved at f16)")
    return False, (f"{keep}: it differs from the target's token table (relative RMS difference {diff:.4f} > "
                   f"{tol:.4f} on {len(rows)} rows)")


def _check_vocab(ckpt: Checkpoint, spec: HeadSpec, target: TargetInfo) -> np.ndarray | None:
    """Absolute d2t ids (checked: in range, distinct) or None; lm_head rows must match."""
    where, hp = ckpt.path, spec.hparams
    head = spec.source(keys.T_OUTPUT)
    rows = ckpt.tensors[head.src_name].shape[0] if head else None
    if head and ckpt.tensors[head.src_name].shape[1:] != (hp.n_embd,):
        raise Eagle3Error(f"{where}: '{head.src_name}' is {list(ckpt.tensors[head.src_name].shape)}, "
                          f"expected [draft vocab, {hp.n_embd}]")
    if hp.draft_vocab is not None and rows is not None and rows != hp.draft_vocab and spec.source(keys.T_D2T):
        raise Eagle3Error(f"{where}: config draft_vocab_size {hp.draft_vocab} but lm_head has {rows} rows")
    src = spec.source(keys.T_D2T)
    if src is None:
        if rows is not None and rows != target.n_vocab:
            raise Eagle3Error(f"{where}: lm_head has {rows} rows but no d2t maps them onto the target's "
                              f"{target.n_vocab}-token vocabulary")
        if head is None and hp.n_embd != target.n_embd:
            raise Eagle3Error(f"{where}: head has no lm_head and hidden size {hp.n_embd}, so it cannot borrow "
                              f"the target's {target.n_embd}-wide lm_head")
        return None
    offsets = ckpt.load(src.src_name)
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise Eagle3Error(f"{where}: d2t must be a 1-D integer tensor, got {offsets.dtype} {list(offsets.shape)}")
    if rows is None:
        raise Eagle3Error(f"{where}: head has a d2t but no lm_head; the target's full-vocab lm_head cannot "
                          f"serve a {len(offsets)}-token draft vocab")
    if rows != len(offsets):
        raise Eagle3Error(f"{where}: lm_head has {rows} rows but d2t has {len(offsets)} entries (llama.cpp "
                          f"needs them equal)")
    ids = offsets.astype(np.int64) + np.arange(len(offsets), dtype=np.int64)  # [draft_vocab] absolute ids
    bad = np.flatnonzero((ids < 0) | (ids >= target.n_vocab))
    if bad.size:
        i = int(bad[0])
        raise Eagle3Error(f"{where}: d2t maps draft token {i} to target id {int(ids[i])}, outside the target "
                          f"vocabulary 0..{target.n_vocab - 1}")
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if same.size:
        i, j = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        raise Eagle3Error(f"{where}: d2t maps draft tokens {i} and {j} to the same target id {int(ids[i])}")
    _check_t2d(ckpt, target, ids)
    return ids


def _check_t2d(ckpt: Checkpoint, target: TargetInfo, ids: np.ndarray) -> None:
    """t2d (dropped: d2t says it all) must be the same map seen from the target's side, one flag per target
    token, set for d2t's ids and no others: a head whose two maps disagree was exported wrong or for another
    vocabulary."""
    if not ckpt.has(T2D_TENSOR):
        return
    where, shape = ckpt.path, ckpt.tensors[T2D_TENSOR].shape
    if shape != (target.n_vocab,):
        raise Eagle3Error(f"{where}: t2d is {list(shape)}, expected [target vocab {target.n_vocab}]: the head was "
                          f"trained for another vocabulary")
    marked = np.flatnonzero(ckpt.load(T2D_TENSOR))  # [k] target ids t2d marks
    if marked.size != len(ids):
        raise Eagle3Error(f"{where}: t2d marks {marked.size} target tokens but d2t maps {len(ids)}: the two maps "
                          f"disagree, so the head was exported wrong")
    missing = np.flatnonzero(~np.isin(ids, marked))
    if missing.size:
        i = int(missing[0])
        raise Eagle3Error(f"{where}: d2t maps draft token {i} to target id {int(ids[i])}, which t2d does not mark: "
                          f"the two maps disagree, so the head was exported wrong")


# ------------------------------------------------------------------------------------------------
# Tensor transforms
# ------------------------------------------------------------------------------------------------


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows → llama.cpp's interleaved RoPE order (upstream's LlamaModel.permute).

    Within each head the rows [first half | second half] become pairs (i, i + half).  # [rows, n_in]
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, theta: float, factor: float, original_context: int,
                        low_freq_factor: float, high_freq_factor: float) -> np.ndarray:
    """Per-frequency divisors of llama3 RoPE scaling, as llama.cpp's rope_freqs expects.  # [head_dim/2]"""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))
    return out.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Planning
# ------------------------------------------------------------------------------------------------

_ORDER = [keys.T_TOKEN_EMBD, keys.T_FC, keys.T_ENC_OUTPUT_NORM, keys.blk(keys.T_ATTN_NORM),
          keys.blk(keys.T_ATTN_NORM_2), keys.blk(keys.T_ATTN_Q), keys.blk(keys.T_ATTN_K), keys.blk(keys.T_ATTN_V),
          keys.blk(keys.T_ATTN_OUT), keys.blk(keys.T_FFN_NORM), keys.blk(keys.T_FFN_GATE), keys.blk(keys.T_FFN_UP),
          keys.blk(keys.T_FFN_DOWN), keys.T_OUTPUT_NORM, keys.T_OUTPUT, keys.T_D2T]


def _plan(ckpt: Checkpoint, spec: HeadSpec, d2t: np.ndarray | None, out_t: GT, fc_t: GT, fc_width: int,
          notes: list[str]) -> list[PlannedTensor]:
    """fc_width: the fc input width the pinned graph reads (3 x target hidden); a narrower fc (a head
    reading fewer features) gets zero columns."""
    hp = spec.hparams
    plans: list[PlannedTensor] = []
    for gguf_name in _ORDER:
        src = spec.source(gguf_name)
        if src is None:
            continue
        shape = ckpt.tensors[src.src_name].shape
        if gguf_name == keys.T_FC:
            shape = (shape[0], fc_width)
        if src.kind == KIND_D2T:
            assert d2t is not None
            plans.append(PlannedTensor(gguf_name, shape, GT.I64, lambda ids=d2t: Encoded(ids, GT.I64, 0.0)))
            continue
        if ckpt.tensors[src.src_name].dtype not in FLOAT_DTYPES:
            raise Eagle3Error(f"{ckpt.path}: tensor '{src.src_name}' holds {ckpt.tensors[src.src_name].dtype} values, "
                              "not floats: not a weight of an EAGLE-3 head")
        if src.kind == KIND_NORM:
            t = GT.F32
        else:
            t = fc_t if gguf_name == keys.T_FC else out_t
            if t in (GT.Q4_0, GT.Q8_0) and not can_quantize(shape):
                notes.append(f"{gguf_name}: rows of {shape[-1]} values cannot be {t.name}; stored as F16")
                t = GT.F16
        plans.append(PlannedTensor(gguf_name, shape, t, _producer(ckpt, src, t, hp.n_head, hp.n_head_kv, shape)))
    if hp.rope_scaling is not None and hp.rope_scaling.kind == "llama3":
        r = hp.rope_scaling
        factors = llama3_rope_factors(hp.head_dim, hp.rope_theta, r.factor, r.original_context or 8192,
                                      r.low_freq_factor, r.high_freq_factor)  # [head_dim/2]
        plans.append(PlannedTensor(keys.T_ROPE_FREQS, factors.shape, GT.F32, lambda: Encoded(factors, GT.F32, 0.0)))
    return plans


def _producer(ckpt: Checkpoint, src: TensorSource, t: GT, n_head: int, n_head_kv: int,
              shape: tuple[int, ...]) -> Callable[[], Encoded]:
    def produce() -> Encoded:
        w = ckpt.load(src.src_name)  # float32, PyTorch order
        if not np.isfinite(w).all():  # a diverged or damaged checkpoint: the head would draft nothing but NaN
            raise Eagle3Error(f"{ckpt.path}: tensor '{src.src_name}' holds NaN or infinite values: the checkpoint is "
                              "damaged (nothing was written)")
        if src.kind == KIND_Q:
            w = permute_rope_rows(w, n_head)
        elif src.kind == KIND_K:
            w = permute_rope_rows(w, n_head_kv)
        if w.shape != shape:  # fc of a head reading < 3 features: zero columns for the padded slots
            w = np.pad(w, [(0, want - have) for have, want in zip(w.shape, shape)])
        return encode(w, t, src.src_name)

    return produce


def _eagle31_metadata(ckpt: Checkpoint, spec: HeadSpec) -> list[KeyValue]:
    """Our own keys for what the pinned graph lacks (empty for an EAGLE-3 head): stock llama.cpp loads
    the file and ignores them. Padded feature slots get unit fc_norm weights (their fc columns are zero)."""
    kvs = []
    if spec.fc_norm:
        parts = [ckpt.load(n).astype(np.float32) for n in spec.fc_norm]
        parts += [np.ones_like(parts[-1])] * (keys.N_TARGET_LAYERS - len(parts))
        weights = np.concatenate(parts)  # [3 * n_embd_tgt]
        if not np.isfinite(weights).all():
            raise Eagle3Error(f"{ckpt.path}: fc_norm weights hold non-finite values")
        kvs += [KeyValue(keys.KEY_FC_NORM, True, VT.BOOL),
                KeyValue(keys.KEY_FC_NORM_WEIGHT, weights.tolist(), VT.ARRAY, VT.FLOAT32)]
    if spec.norm_output:
        kvs.append(KeyValue(keys.KEY_NORM_OUTPUT, True, VT.BOOL))
    return kvs


def padded_layer_ids(ids: list[int]) -> list[int]:
    """The 3 ids the pinned graph reads: a head naming fewer repeats its last one."""
    return list(ids) + [ids[-1]] * (keys.N_TARGET_LAYERS - len(ids))


def _metadata(spec: HeadSpec, target: TargetInfo, ids: LayerIds, out_t: GT, name: str) -> list[KeyValue]:
    hp, a = spec.hparams, lambda template: keys.arch_key(template, keys.ARCH_EAGLE3)
    kvs = [
        KeyValue(keys.KEY_NAME, name, VT.STRING),
        KeyValue(keys.KEY_FILE_TYPE, int(_FILE_TYPE[out_t]), VT.UINT32),
        KeyValue(keys.KEY_QUANTIZATION_VERSION, keys.GGML_QUANT_VERSION, VT.UINT32),
        KeyValue(a(keys.KEY_CONTEXT_LENGTH), hp.n_ctx, VT.UINT32),
        KeyValue(a(keys.KEY_EMBEDDING_LENGTH), hp.n_embd, VT.UINT32),
        KeyValue(a(keys.KEY_BLOCK_COUNT), 1, VT.UINT32),
        KeyValue(a(keys.KEY_FEED_FORWARD_LENGTH), hp.n_ff, VT.UINT32),
        KeyValue(a(keys.KEY_HEAD_COUNT), hp.n_head, VT.UINT32),
        KeyValue(a(keys.KEY_HEAD_COUNT_KV), hp.n_head_kv, VT.UINT32),
        KeyValue(a(keys.KEY_RMS_EPS), hp.rms_eps, VT.FLOAT32),
        KeyValue(a(keys.KEY_ROPE_FREQ_BASE), hp.rope_theta, VT.FLOAT32),
        KeyValue(a(keys.KEY_ROPE_DIMENSION_COUNT), hp.head_dim, VT.UINT32),
        KeyValue(a(keys.KEY_VOCAB_SIZE), target.n_vocab, VT.UINT32),
        KeyValue(a(keys.KEY_TARGET_LAYERS), padded_layer_ids(ids.ids), VT.ARRAY, VT.INT32),
        KeyValue(a(keys.KEY_TARGET_HIDDEN_SIZE), target.n_embd, VT.UINT32),
        KeyValue(a(keys.KEY_NORM_BEFORE_RESIDUAL), spec.norm_before_residual, VT.BOOL),
        KeyValue(a(keys.KEY_NORM_BEFORE_FC), spec.norm_before_fc, VT.BOOL),
    ]
    if hp.head_dim_in_config or hp.head_dim * hp.n_head != hp.n_embd:
        kvs += [KeyValue(a(keys.KEY_KEY_LENGTH), hp.head_dim, VT.UINT32),
                KeyValue(a(keys.KEY_VALUE_LENGTH), hp.head_dim, VT.UINT32)]
    r = hp.rope_scaling
    if r is not None and r.kind in ("linear", "yarn"):
        kvs += [KeyValue(a(keys.KEY_ROPE_SCALING_TYPE), r.kind, VT.STRING),
                KeyValue(a(keys.KEY_ROPE_SCALING_FACTOR), r.factor, VT.FLOAT32)]
        if r.original_context:
            kvs.append(KeyValue(a(keys.KEY_ROPE_SCALING_ORIG_CTX), r.original_context, VT.UINT32))
    if target.kind == "gguf":
        kvs += target.tokenizer
    else:  # no tokenizer to copy: llama.cpp makes vocab_size dummy tokens
        kvs.append(KeyValue(keys.KEY_TOKENIZER_MODEL, "none", VT.STRING))
    return kvs


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------


def _check_out(out: Path, inputs: list[Path]) -> None:
    """The output path is no input of the conversion, and no file other than a regular one (a device, a pipe): the
    head replaces whatever is there."""
    if out.exists() and not out.is_dir():
        if not out.is_file():
            raise Eagle3Error(f"{out}: not a regular file; name a .gguf file to write (-o head.gguf)")
        for path in inputs:
            if path.exists() and os.path.samefile(out, path):
                raise Eagle3Error(f"{out}: is an input of this conversion ({path}); name another output (-o)")


def convert_head(src: str | Path, out: str | Path | None, target: str | Path | TargetInfo,
                 layer_ids: list[int] | None = None, outtype: str | None = None, fc_type: str | None = None,
                 name: str | None = None,
                 progress: Callable[[TensorRow, int, int], None] | None = None) -> ConvertResult:
    """Convert an EAGLE-3 checkpoint (file, sharded index or directory) into `out` (arch eagle3).

    `target` is the target's GGUF (its tokenizer is copied in), its HF config.json, or the TargetInfo
    a caller read from either (not read again); `layer_ids` (input-of-layer) overrides the
    checkpoint's; `progress(row, done_bytes, total_bytes)` follows the streaming.
    """
    outtype, fc_type = outtype or DEFAULT_OUTTYPE, fc_type or DEFAULT_FC_TYPE  # None: the defaults
    if outtype.lower() not in OUTTYPES:
        raise Eagle3Error(f"--outtype {outtype}: choose from {', '.join(OUTTYPES)} (fc has its own --fc-type)")
    if fc_type.lower() not in FC_TYPES:
        raise Eagle3Error(f"--fc-type {fc_type}: choose from {', '.join(FC_TYPES)}")
    out_t, fc_t = ggml_type(outtype), ggml_type(fc_type)
    tgt = describe_target(target)
    ckpt = open_checkpoint(src)
    spec = detect_layout(ckpt)
    ids = resolve_layer_ids(spec, tgt.n_layer, layer_ids)
    n_feat = len(ids.ids)
    _check_shapes(ckpt, spec, tgt, _geometry(ckpt, spec, tgt, n_feat))
    d2t = _check_vocab(ckpt, spec, tgt)

    out = Path(out) if out is not None else default_out_path(src)
    _check_out(out, [*ckpt.files, *([ckpt.config_path] if ckpt.config_path else []), Path(tgt.path)])
    notes: list[str] = []
    embd = spec.source(keys.T_TOKEN_EMBD)
    if embd is not None and spec.hparams.n_embd == tgt.n_embd:  # a copy of the target's table goes (borrowed)
        copy, note = _target_embd_copy(ckpt, embd, tgt)
        notes.append(note)
        if copy:
            spec = dataclasses.replace(spec, tensors=[t for t in spec.tensors if t is not embd],
                                       dropped=[*spec.dropped, embd.src_name])
    if not tgt.arch:
        notes.append("the target's config.json names no architecture the pinned llama.cpp converts (its "
                     "'architectures'): whether it can run with this head is unknown; give the target .gguf")
    elif tgt.captured:
        notes.append(f"target arch '{tgt.arch}' has no hidden-state hooks at the pinned llama.cpp: eagle3-gguf "
                     f"generate captures them (an eval callback); upstream llama.cpp cannot run this pair")
    elif not tgt.hooked:
        notes.append(f"target arch '{tgt.arch}' has no hidden-state hooks at the pinned llama.cpp: the head "
                     f"converts but cannot run with this target")
    if tgt.n_layer in ids.ids and tgt.arch not in keys.FINAL_OUTPUT_TARGET_ARCHS:
        notes.append(f"layer id {tgt.n_layer} is the final output, which the pinned llama.cpp does not expose for "
                     f"'{tgt.arch}' targets (it reads zeros): pairing will refuse this head; see --layer-ids")
    if tgt.kind != "gguf":
        notes.append("target given as config.json: no tokenizer copied (pass the target .gguf to copy it)")
    if n_feat < keys.N_TARGET_LAYERS:
        notes.append(f"head reads {n_feat} target feature(s); the pinned graph reads {keys.N_TARGET_LAYERS}: layer "
                     f"{ids.ids[-1]} repeated with zero fc columns (exact), stored ids "
                     f"{padded_layer_ids(ids.ids)}")
    plans = _plan(ckpt, spec, d2t, out_t, fc_t, keys.N_TARGET_LAYERS * tgt.n_embd, notes)
    kvs = _metadata(spec, tgt, ids, out_t, name or out.stem) + _eagle31_metadata(ckpt, spec)
    # the file as llama.cpp will read it, through the loader's own check: never a head `generate` refuses
    check_head(ckpt.path, {kv.key: kv.value for kv in kvs},
               [TensorEntry(p.name, list(reversed(p.shape)), p.ggml_type.name, n_bytes(p.shape, p.ggml_type))
                for p in plans], FIX_CHECKPOINT)

    sources = {t.gguf_name: t.src_name for t in spec.tensors}
    total = sum(n_bytes(p.shape, p.ggml_type) for p in plans)
    done = 0
    rows: list[TensorRow] = []

    def on_tensor(w: WrittenTensor) -> None:
        nonlocal done
        row = TensorRow(w.name, list(reversed(w.shape)), w.ggml_type.name, w.n_bytes, w.rel_error,
                        sources.get(w.name, "(generated)"))
        rows.append(row)
        done += w.n_bytes
        if progress is not None:
            progress(row, done, total)

    write_gguf(out, keys.ARCH_EAGLE3, kvs, plans, on_tensor=on_tensor)
    return ConvertResult(
        out=out, layout=spec.layout, layout_reason=spec.layout_reason, target=tgt.path, target_kind=tgt.kind,
        layer_ids=ids, n_embd=spec.hparams.n_embd, target_hidden_size=tgt.n_embd, target_vocab=tgt.n_vocab,
        draft_vocab=None if d2t is None else len(d2t), norm_before_residual=spec.norm_before_residual,
        norm_before_fc=spec.norm_before_fc,
        fc_norm=[keys.N_TARGET_LAYERS, tgt.n_embd] if spec.fc_norm else None, norm_output=spec.norm_output,
        own_token_embd=spec.source(keys.T_TOKEN_EMBD) is not None,
        own_output=spec.source(keys.T_OUTPUT) is not None, outtype=out_t.name, fc_type=fc_t.name, rows=rows,
        file_bytes=out.stat().st_size, dropped=spec.dropped, notes=notes,
    )


# ------------------------------------------------------------------------------------------------
# Text report (the CLI prints it)
# ------------------------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def result_text(r: ConvertResult) -> str:
    ids = r.layer_ids
    raw = f" (checkpoint says {ids.raw})" if ids.raw is not None and ids.raw != ids.ids else ""
    draft = f"{r.draft_vocab} tokens (d2t)" if r.draft_vocab else f"full target vocab ({r.target_vocab})"
    lines = [
        f"layout           {r.layout}  ({r.layout_reason})",
        f"target           {r.target}  ({r.target_kind}: hidden {r.target_hidden_size}, vocab {r.target_vocab})",
        f"layer ids        {ids.ids}  {ids.convention}{raw}",
        f"ids source       {ids.source}",
        f"draft vocab      {draft}",
        f"norm flags       norm_before_residual={str(r.norm_before_residual).lower()}, "
        f"norm_before_fc={str(r.norm_before_fc).lower()}, fc_norm={str(r.fc_norm is not None).lower()}, "
        f"norm_output={str(r.norm_output).lower()}",
        f"token_embd       {'own' if r.own_token_embd else 'borrowed from the target'}",
        f"lm_head          {'own' if r.own_output else 'borrowed from the target'}",
        "tensors:",
    ]
    width = max((len(t.name) for t in r.rows), default=10)
    lines.append(f"  {'name':<{width}}  {'shape':<16} {'type':<5} {'bytes':>11}  rel.error  source")
    for t in r.rows:
        err = "-" if t.rel_error is None else f"{t.rel_error:.2e}"
        lines.append(f"  {t.name:<{width}}  {str(t.shape):<16} {t.type:<5} {_size(t.bytes):>11}  {err:>9}  {t.source}")
    if r.fc_norm is not None:
        lines.append(f"fc_norm          {r.fc_norm} f32 in metadata {keys.KEY_FC_NORM_WEIGHT} (the pinned loader "
                     f"refuses extra tensors); applied by eagle3-gguf, ignored by upstream llama.cpp")
    if r.norm_output:
        lines.append(f"norm_output      {keys.KEY_NORM_OUTPUT}: eagle3-gguf feeds output_norm(h) back; upstream "
                     f"llama.cpp feeds the pre-norm h")
    if r.dropped:
        lines.append(f"dropped          {', '.join(r.dropped)}")
    lines += [f"note             {n}" for n in r.notes]
    lines.append(f"wrote            {r.out}  ({_size(r.file_bytes)})")
    return "\n".join(lines)
