"""Tell which published EAGLE-3 layout a checkpoint uses and normalize it to one `HeadSpec`.

Four layouts exist in the wild (names checked against the public sources):

- SafeAILab/EAGLE: llama config + `draft_vocab_size`; `midlayer.*`; usually names no layer ids
  (then the input-of default `[2, n//2, n-3]`).
- vLLM speculators: `Eagle3Speculator`, nested `transformer_layer_config`; `layers.0.*`;
  ids in `eagle_aux_hidden_state_layer_ids`.
- NVIDIA ModelOpt: `LlamaForCausalLMEagle3` + `eagle_config`; `layers.0.*`;
  ids in `eagle_config.eagle_aux_hidden_state_layer_ids`.
- SpecForge: `LlamaForCausalLMEagle3` + `eagle_config` (or EAGLE 3.1's `fc_norm.{i}`, which SafeAILab
  never has); `midlayer.*`; ids as ModelOpt. Published SafeAILab heads also name LlamaForCausalLMEagle3.

All share `fc`, `norm`, `lm_head`, `d2t` (int64 offsets), `t2d` (dropped) and optional `embed_tokens`;
speculators adds `input_norm` (norm_before_fc). EAGLE 3.1 (speculators, SpecForge): `fc_norm` (config
flag, tensors `fc_norm.{i}.weight`, one RMSNorm per target feature before fc) and `norm_output` (config
flag: the post-norm hidden state is fed back across draft steps). The pinned graph has neither; the
converter carries them in our own metadata keys and eagle3_gguf.head_norms applies them at run time.

A head may name fewer than 3 layers (speculators allows any number): the pinned graph reads exactly 3,
so the converter repeats the last id and gives the extra slots zero fc columns, which is exact unless a
norm spans the concatenation (norm_before_fc): such a head, and one naming more than 3, is refused.

Layer-id conventions: "output of layer X" (first id == 1; ModelOpt/SpecForge default `[1, n//2-1, n-4]`)
and "input of layer X" (SafeAILab default `[2, n//2, n-3]`, and what the GGUF stores). Like SGLang,
the first id tells them apart; output-of ids are converted by +1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import keys
from ..errors import Eagle3Error
from .readers import Checkpoint

LAYOUT_SAFEAI = "SafeAILab/EAGLE"
LAYOUT_SPECULATORS = "vLLM speculators"
LAYOUT_MODELOPT = "NVIDIA ModelOpt"
LAYOUT_SPECFORGE = "SpecForge"

CONVENTION_INPUT = "input-of-layer"
CONVENTION_OUTPUT = "output-of-layer (converted: +1)"
CONVENTION_DEFAULT = "input-of-layer (default)"

KIND_WEIGHT = "weight"  # a matrix: takes the outtype (or fc_type for fc)
KIND_NORM = "norm"  # a 1-D vector: always f32
KIND_Q = "rope_q"  # permuted into llama.cpp's RoPE row order with n_head
KIND_K = "rope_k"  # ... with n_head_kv
KIND_D2T = "d2t"  # int64 offsets → absolute target ids

# Tensors of the decoder layer: checkpoint suffix → (GGUF name, kind)
_LAYER_TENSORS = {
    "input_layernorm.weight": (keys.blk(keys.T_ATTN_NORM), KIND_NORM),
    "hidden_norm.weight": (keys.blk(keys.T_ATTN_NORM_2), KIND_NORM),
    "self_attn.q_proj.weight": (keys.blk(keys.T_ATTN_Q), KIND_Q),
    "self_attn.k_proj.weight": (keys.blk(keys.T_ATTN_K), KIND_K),
    "self_attn.v_proj.weight": (keys.blk(keys.T_ATTN_V), KIND_WEIGHT),
    "self_attn.o_proj.weight": (keys.blk(keys.T_ATTN_OUT), KIND_WEIGHT),
    "post_attention_layernorm.weight": (keys.blk(keys.T_FFN_NORM), KIND_NORM),
    "mlp.gate_proj.weight": (keys.blk(keys.T_FFN_GATE), KIND_WEIGHT),
    "mlp.up_proj.weight": (keys.blk(keys.T_FFN_UP), KIND_WEIGHT),
    "mlp.down_proj.weight": (keys.blk(keys.T_FFN_DOWN), KIND_WEIGHT),
}
# Top-level tensors: checkpoint name → (GGUF name, kind, required)
_TOP_TENSORS = {
    "fc.weight": (keys.T_FC, KIND_WEIGHT, True),
    "norm.weight": (keys.T_OUTPUT_NORM, KIND_NORM, True),
    "lm_head.weight": (keys.T_OUTPUT, KIND_WEIGHT, False),
    "embed_tokens.weight": (keys.T_TOKEN_EMBD, KIND_WEIGHT, False),
    "d2t": (keys.T_D2T, KIND_D2T, False),
}
NORM_BEFORE_FC_TENSOR = "input_norm.weight"  # speculators: RMSNorm on the 3 concatenated features
FC_NORM_TENSOR = "fc_norm.{i}.weight"  # EAGLE 3.1: RMSNorm on target feature i, before the concatenation
_FC_NORM_RE = re.compile(r"^fc_norm\.(\d+)\.weight$")
T2D_TENSOR = "t2d"  # bool [target vocab]: d2t seen from the target's side (checked against d2t, then dropped)
_DROPPED = (T2D_TENSOR, "verifier_lm_head.weight", "verifier_norm.weight")


@dataclass
class RopeScaling:
    kind: str  # "linear", "yarn" or "llama3"
    factor: float
    original_context: int | None = None
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only


@dataclass
class HeadHParams:
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_in_config: bool  # config names head_dim: write attention.key_length / value_length
    rms_eps: float
    rope_theta: float
    n_ctx: int
    draft_vocab: int | None  # config's draft_vocab_size (checked against lm_head / d2t)
    target_hidden_size: int | None  # config's target_hidden_size (checked against fc)
    rope_scaling: RopeScaling | None = None


@dataclass
class TensorSource:
    gguf_name: str
    src_name: str
    kind: str


@dataclass
class HeadSpec:
    """A checkpoint, whatever its layout: hparams, flags, tensor mapping, named layer ids."""

    layout: str
    layout_reason: str  # what gave the layout away
    hparams: HeadHParams
    norm_before_residual: bool
    norm_before_fc: bool
    raw_layer_ids: list[int] | None  # as the checkpoint names them, None when it names none
    layer_ids_key: str | None  # where: e.g. "eagle_config.eagle_aux_hidden_state_layer_ids"
    tensors: list[TensorSource]
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors not carried over (t2d, ...)
    fc_norm: list[str] = field(default_factory=list)  # EAGLE 3.1: the fc_norm.{i}.weight names, in feature order
    norm_output: bool = False  # EAGLE 3.1: output_norm(h) is fed back as g

    @property
    def eagle31(self) -> bool:
        return bool(self.fc_norm) or self.norm_output

    def source(self, gguf_name: str) -> TensorSource | None:
        return next((t for t in self.tensors if t.gguf_name == gguf_name), None)


@dataclass
class LayerIds:
    ids: list[int]  # input-of-layer ids (== n_layer: final output); 1 to 3, the GGUF pads to 3
    raw: list[int] | None  # as the checkpoint or the user gave them
    source: str  # e.g. "config.json eagle_config.eagle_aux_hidden_state_layer_ids", "--layer-ids", "default"
    convention: str  # CONVENTION_*


# ------------------------------------------------------------------------------------------------
# Detection
# ------------------------------------------------------------------------------------------------


def _flag(config: dict[str, Any], key: str) -> bool:
    """A boolean the config sets at the top level (speculators) or in eagle_config (SpecForge)."""
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    return bool(config.get(key) or eagle_config.get(key))


def _fc_norm_names(ckpt: Checkpoint, names: list[str], config: dict[str, Any]) -> list[str]:
    """The fc_norm.{i}.weight names in feature order (checked: numbered 0..n-1); [] for no fc_norm."""
    found = sorted((int(m.group(1)), n) for n in names if (m := _FC_NORM_RE.match(n)))
    stray = [n for n in names if n.startswith("fc_norm") and not _FC_NORM_RE.match(n)]
    if stray:
        raise Eagle3Error(f"{ckpt.path}: unexpected tensor '{stray[0]}' (EAGLE 3.1 fc_norm weights are "
                          f"fc_norm.{{i}}.weight)")
    if _flag(config, "fc_norm") and not found:
        raise Eagle3Error(f"{ckpt.path}: config sets fc_norm but the checkpoint has no fc_norm.{{i}}.weight tensors")
    if [i for i, _ in found] != list(range(len(found))):
        raise Eagle3Error(f"{ckpt.path}: fc_norm weights are numbered {[i for i, _ in found]}, expected "
                          f"0..{len(found) - 1} (one per target feature)")
    return [n for _, n in found]


def detect_layout(ckpt: Checkpoint) -> HeadSpec:
    """Name the layout, read hparams, map every tensor; raise Eagle3Error on anything unusable."""
    config = ckpt.config
    if config is None:
        raise Eagle3Error(f"{ckpt.path}: no config.json next to the checkpoint (an EAGLE-3 head ships one "
                          f"with hidden_size, num_attention_heads, ...)")
    names = list(ckpt.tensors)
    fc_norm = _fc_norm_names(ckpt, names, config)

    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    has_mid = any(n.startswith("midlayer.") for n in names)
    has_layers = any(n.startswith("layers.") for n in names)
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else None

    if ("Eagle3Speculator" in archs or config.get("speculators_model_type") == "eagle3"
            or isinstance(config.get("transformer_layer_config"), dict)):
        layout, reason, prefix = LAYOUT_SPECULATORS, "Eagle3Speculator config", "layers."
        nested = config.get("transformer_layer_config")
        hp_config = {**config, **(nested if isinstance(nested, dict) else {})}
    elif has_layers and ("LlamaForCausalLMEagle3" in archs or eagle_config is not None):
        layout, reason, prefix = LAYOUT_MODELOPT, "LlamaForCausalLMEagle3/eagle_config + layers.0.*", "layers."
        hp_config = config
    elif has_mid and (eagle_config is not None or fc_norm):  # SafeAILab has no EAGLE 3.1 heads
        why = "eagle_config" if eagle_config is not None else "fc_norm.{i}"
        layout, reason, prefix = LAYOUT_SPECFORGE, f"{why} + midlayer.*", "midlayer."
        hp_config = config
    elif has_mid:
        layout, reason, prefix = LAYOUT_SAFEAI, "midlayer.* tensors", "midlayer."
        hp_config = config
    else:
        sample = ", ".join(sorted(names)[:3]) or "no tensors"
        raise Eagle3Error(f"{ckpt.path}: unknown checkpoint layout (tensors: {sample}, ...); expected SafeAILab "
                          f"(midlayer.*), speculators (Eagle3Speculator), ModelOpt (LlamaForCausalLMEagle3, "
                          f"layers.0.*) or SpecForge (midlayer.*, eagle_config)")

    layer_prefix = _single_layer_prefix(ckpt, names, prefix)
    hparams = _read_hparams(hp_config, ckpt.config_path)
    tensors, dropped = _map_tensors(ckpt, names, layout, layer_prefix, set(fc_norm))

    norm_before_fc = _flag(config, "norm_before_fc") or ckpt.has(NORM_BEFORE_FC_TENSOR)
    if norm_before_fc:
        if not ckpt.has(NORM_BEFORE_FC_TENSOR):
            raise Eagle3Error(f"{ckpt.path}: missing tensor '{NORM_BEFORE_FC_TENSOR}' (config sets norm_before_fc)")
        tensors.append(TensorSource(keys.T_ENC_OUTPUT_NORM, NORM_BEFORE_FC_TENSOR, KIND_NORM))
    if norm_before_fc and fc_norm:
        raise Eagle3Error(f"{ckpt.path}: head has both fc_norm (per-feature norms) and norm_before_fc "
                          f"('{NORM_BEFORE_FC_TENSOR}'); EAGLE 3.1 makes them mutually exclusive")

    raw_ids, ids_key = _named_layer_ids(config, ckpt.config_path)
    return HeadSpec(layout, reason, hparams, bool(config.get("norm_before_residual", False)), norm_before_fc,
                    raw_ids, ids_key, tensors, dropped, fc_norm, _flag(config, "norm_output"))


def _single_layer_prefix(ckpt: Checkpoint, names: list[str], prefix: str) -> str:
    if prefix == "midlayer.":
        return prefix
    layer_ids = {n.split(".")[1] for n in names if n.startswith("layers.")}
    if layer_ids != {"0"}:
        raise Eagle3Error(f"{ckpt.path}: head has {len(layer_ids)} decoder layers ({', '.join(sorted(layer_ids))}); "
                          f"the pinned llama.cpp eagle3 graph runs exactly one")
    return "layers.0."


def _map_tensors(ckpt: Checkpoint, names: list[str], layout: str, layer_prefix: str,
                 fc_norm: set[str]) -> tuple[list[TensorSource], list[str]]:
    tensors: list[TensorSource] = []
    for src, (gguf_name, kind, required) in _TOP_TENSORS.items():
        if ckpt.has(src):
            tensors.append(TensorSource(gguf_name, src, kind))
        elif required:
            raise Eagle3Error(f"{ckpt.path}: missing tensor '{src}' (a {layout} head needs it)")
    for suffix, (gguf_name, kind) in _LAYER_TENSORS.items():
        src = layer_prefix + suffix
        if not ckpt.has(src):
            raise Eagle3Error(f"{ckpt.path}: missing tensor '{src}' (a {layout} head needs it)")
        tensors.append(TensorSource(gguf_name, src, kind))

    known = {t.src_name for t in tensors} | {NORM_BEFORE_FC_TENSOR} | fc_norm
    dropped = []
    for name in names:
        if name in known:
            continue
        if name in _DROPPED or name.endswith("rotary_emb.inv_freq"):
            dropped.append(name)
            continue
        raise Eagle3Error(f"{ckpt.path}: unexpected tensor '{name}' in a {layout} head; the pinned eagle3 graph "
                          f"has no place for it")
    return tensors, dropped


def _need(cfg: dict[str, Any], key: str, path: Path | None) -> Any:
    value = cfg.get(key)
    if value is None:
        raise Eagle3Error(f"{path}: config lacks '{key}'")
    return value


_SILU = ("silu", "swish")  # the MLP activation the pinned graph hard-codes (LLM_FFN_SILU)
MAX_INT = 2**31 - 1  # hparams are stored as u32/i32 in the GGUF


def _int(cfg: dict[str, Any], key: str, path: Path | None, default: int | None = None, minimum: int = 1) -> int | None:
    """An integer hparam (JSON number with no fraction, not a bool) in [minimum, 2^31), or `default` when the
    config has none (None, 0 or absent, as the publishers write "unset")."""
    value = cfg.get(key)
    if value is None or (value == 0 and default is not None and not isinstance(value, bool)):
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not minimum <= value <= MAX_INT \
            or value != int(value):
        raise Eagle3Error(f"{path}: config '{key}' must be an integer in {minimum}..{MAX_INT}, got {value!r}: "
                          "fix config.json")
    return int(value)


def _float(cfg: dict[str, Any], key: str, path: Path | None, default: float) -> float:
    """A positive finite float hparam, or `default` when unset."""
    value = cfg.get(key)
    if value is None or (value == 0 and not isinstance(value, bool)):
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise Eagle3Error(f"{path}: config '{key}' must be a positive number, got {value!r}: fix config.json")
    return float(value)


def _read_hparams(cfg: dict[str, Any], path: Path | None) -> HeadHParams:
    _need(cfg, "hidden_size", path)
    _need(cfg, "num_attention_heads", path)
    _need(cfg, "intermediate_size", path)
    n_embd = _int(cfg, "hidden_size", path)
    n_head = _int(cfg, "num_attention_heads", path)
    n_head_kv = _int(cfg, "num_key_value_heads", path, default=n_head)
    head_dim = _int(cfg, "head_dim", path, default=0)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope = rope if isinstance(rope, dict) else {}
    rope_theta = _float(cfg, "rope_theta", path, 0.0) or _float(rope, "rope_theta", path, 10000.0)
    for key in ("hidden_act", "hidden_activation"):  # gemma configs name it the second way
        if cfg.get(key) is not None and cfg[key] not in _SILU:
            raise Eagle3Error(f"{path}: config {key} {cfg[key]!r}: the pinned llama.cpp eagle3 graph's MLP is "
                              f"SiLU-gated only, so this head cannot run there")
    draft_vocab = _int(cfg, "draft_vocab_size", path, default=0)
    target_hidden = _int(cfg, "target_hidden_size", path, default=0)
    return HeadHParams(
        n_embd=n_embd,
        n_ff=_int(cfg, "intermediate_size", path),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim or n_embd // n_head,
        head_dim_in_config=bool(head_dim),
        rms_eps=_float(cfg, "rms_norm_eps", path, 1e-6),
        rope_theta=rope_theta,
        n_ctx=_int(cfg, "max_position_embeddings", path, default=2048),
        draft_vocab=draft_vocab or None,
        target_hidden_size=target_hidden or None,
        rope_scaling=_rope_scaling(rope, path),
    )


def _rope_scaling(rope: dict[str, Any], path: Path | None) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    factor = _float(rope, "factor", path, 1.0)
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "yarn":
        _need(rope, "original_max_position_embeddings", path)
        return RopeScaling("yarn", factor, _int(rope, "original_max_position_embeddings", path))
    if kind == "llama3":
        return RopeScaling("llama3", _float(rope, "factor", path, 8.0),
                           _int(rope, "original_max_position_embeddings", path, default=8192),
                           _float(rope, "low_freq_factor", path, 1.0), _float(rope, "high_freq_factor", path, 4.0))
    raise Eagle3Error(f"{path}: rope_scaling type {kind!r} is not supported (linear, yarn and llama3 are)")


def _named_layer_ids(config: dict[str, Any], path: Path | None) -> tuple[list[int] | None, str | None]:
    candidates = [("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))]
    eagle_config = config.get("eagle_config")
    if isinstance(eagle_config, dict):
        candidates.append(("eagle_config.eagle_aux_hidden_state_layer_ids",
                           eagle_config.get("eagle_aux_hidden_state_layer_ids")))
    for key, value in candidates:
        if value is None:
            continue
        if not isinstance(value, list) or not value or not all(isinstance(x, int) for x in value):
            raise Eagle3Error(f"{path}: '{key}' must list integer layer ids, got {value!r}")
        if len(value) > keys.N_TARGET_LAYERS:
            raise Eagle3Error(f"{path}: '{key}' names {len(value)} target layers {value}; the pinned llama.cpp "
                              f"eagle3 graph reads exactly {keys.N_TARGET_LAYERS} (its loader refuses other "
                              f"counts), so this head cannot run")
        return [int(x) for x in value], key
    return None, None


# ------------------------------------------------------------------------------------------------
# Layer ids against the target
# ------------------------------------------------------------------------------------------------


def default_layer_ids(n_layer: int) -> list[int]:
    """SafeAILab's input-of-layer default, also what upstream llama.cpp writes."""
    return [2, n_layer // 2, n_layer - 3]


def resolve_layer_ids(spec: HeadSpec, n_layer: int, override: list[int] | None = None) -> LayerIds:
    """The head's input-of-layer ids (3, or the 1-2 its config names) for a target with `n_layer` layers,
    with where they came from."""
    if override is not None:
        if len(override) != 3:
            raise Eagle3Error(f"--layer-ids needs exactly 3 ids, got {len(override)}")
        result = LayerIds(list(override), list(override), "--layer-ids", CONVENTION_INPUT)
    elif spec.raw_layer_ids is not None:
        raw = spec.raw_layer_ids
        if raw[0] == 1:  # "output of layer X" (ModelOpt / SpecForge), as SGLang tells them apart
            result = LayerIds([x + 1 for x in raw], raw, f"config.json {spec.layer_ids_key}", CONVENTION_OUTPUT)
        else:
            result = LayerIds(list(raw), raw, f"config.json {spec.layer_ids_key}", CONVENTION_INPUT)
    else:
        result = LayerIds(default_layer_ids(n_layer), None, "default [2, n//2, n-3] (the checkpoint names none)",
                          CONVENTION_DEFAULT)
    bad = [x for x in result.ids if not 0 <= x <= n_layer]
    if bad:
        raise Eagle3Error(f"layer ids {result.ids} ({result.convention}, from {result.source.split(' (')[0]}) are "
                          f"out of range for a {n_layer}-layer target: each must be 0..{n_layer} "
                          f"({n_layer} = final output)")
    return result
