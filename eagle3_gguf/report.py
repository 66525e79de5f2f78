"""What `info` shows about a GGUF: a dataclass a script can dump as JSON, and its text form."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import keys
from .gguf_file import HeadInfo, TargetInfo, read_gguf


@dataclass
class TensorRow:
    name: str
    shape: list[int]
    type: str
    bytes: int


@dataclass
class TypeShare:
    count: int
    bytes: int


@dataclass
class GGUFReport:
    path: str
    kind: str  # "eagle3-head" or "target"
    architecture: str
    name: str | None
    file_bytes: int
    n_tensors: int
    # target fields
    n_layer: int | None = None
    n_embd: int | None = None
    n_vocab: int | None = None
    context_length: int | None = None
    extraction_supported: bool | None = None
    extraction: str | None = None  # "hook", "eval callback" or "none" (TargetInfo.extraction)
    chat_template: bool | None = None
    # head fields
    target_layers: list[int] | None = None
    target_hidden_size: int | None = None
    draft_vocab: int | None = None
    norm_before_residual: bool | None = None
    norm_before_fc: bool | None = None
    fc_norm: list[int] | None = None  # EAGLE 3.1: [3, n_embd_tgt] of the per-feature norms as stored, or None
    norm_output: bool | None = None
    own_token_embd: bool | None = None
    own_output: bool | None = None
    n_head: int | None = None  # heads and ffn: the target's or the head's own
    n_head_kv: int | None = None
    n_ff: int | None = None
    tensor_types: dict[str, TypeShare] = field(default_factory=dict)  # the quantisation mix, most bytes first
    tensors: list[TensorRow] = field(default_factory=list)

    def text(self, tensors: bool = False) -> str:
        """A summary of at most 20 lines; `tensors` appends one line per tensor."""
        lines = [f"{self.path}", f"  architecture     {self.architecture}" + (f"  ({self.name})" if self.name else ""),
                 f"  file             {_mib(self.file_bytes)}, {self.n_tensors} tensors",
                 f"  tensor types     {self.type_mix()}"]
        if self.kind == "eagle3-head":
            draft = f"{self.draft_vocab} tokens (d2t)" if self.draft_vocab else f"full target vocab ({self.n_vocab})"
            lines += [
                f"  target layers    {self.target_layers}  (input-of-layer ids; == n_layer means final output)",
                f"  target hidden    {self.target_hidden_size}",
                f"  head             n_embd {self.n_embd}, heads {self.n_head}/{self.n_head_kv}, ffn {self.n_ff}",
                f"  draft vocab      {draft}",
                f"  target vocab     {self.n_vocab}",
                f"  norm flags       norm_before_residual={str(self.norm_before_residual).lower()}, "
                f"norm_before_fc={str(self.norm_before_fc).lower()}, fc_norm={str(self.fc_norm is not None).lower()}, "
                f"norm_output={str(self.norm_output).lower()}",
                f"  token_embd       {'own' if self.own_token_embd else 'borrowed from the target'}",
                f"  lm_head          {'own' if self.own_output else 'borrowed from the target'}",
            ]
            if self.fc_norm is not None:
                lines.append(f"  fc_norm          {self.fc_norm} f32 in metadata {keys.KEY_FC_NORM_WEIGHT} "
                             f"(EAGLE 3.1; applied by eagle3-gguf, ignored by upstream llama.cpp)")
            if self.norm_output:
                lines.append("  norm_output      output_norm(h) fed back as g (EAGLE 3.1; upstream llama.cpp feeds h)")
        else:
            ok = {"hook": "yes",
                  "eval callback": "yes: no hook in the pinned graph, captured by an eval callback (generate "
                                   "and train; not the drop-in or serve, not upstream's runtime)"}.get(
                self.extraction, f"no: the pinned llama.cpp has no hidden-state hooks for '{self.architecture}'")
            lines += [
                f"  layers           {self.n_layer}",
                f"  hidden size      {self.n_embd}",
                f"  attention heads  {self.n_head} (KV heads {self.n_head_kv})",
                f"  vocab            {self.n_vocab}",
                f"  context (train)  {self.context_length}",
                f"  chat template    {'yes' if self.chat_template else 'no'}",
                f"  EAGLE-3 target   {ok}",
            ]
        if tensors:
            lines.append("  tensors:")
            width = max((len(t.name) for t in self.tensors), default=10)
            for t in self.tensors:
                lines.append(f"    {t.name:<{width}}  {str(t.shape):<18} {t.type:<6} {_mib(t.bytes):>10}")
        return "\n".join(lines)

    def type_mix(self) -> str:
        """'Q4_1 x169 (95%), F32 x61 (1%)': tensor count per type and its share of the tensor bytes."""
        total = sum(share.bytes for share in self.tensor_types.values()) or 1
        return ", ".join(f"{name} x{share.count} ({_percent(share.bytes / total)})"
                         for name, share in self.tensor_types.items())


def _percent(fraction: float) -> str:
    return "<1%" if 0 < fraction < 0.005 else f"{100 * fraction:.0f}%"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _type_mix(rows: list[TensorRow]) -> dict[str, TypeShare]:
    mix: dict[str, TypeShare] = {}
    for t in rows:
        share = mix.setdefault(t.type, TypeShare(0, 0))
        share.count += 1
        share.bytes += t.bytes
    return dict(sorted(mix.items(), key=lambda kv: (-kv[1].bytes, kv[0])))


def describe_gguf(path: str | Path) -> GGUFReport:
    """Read a GGUF (pure Python, no llama.cpp) and describe it as a head or a target."""
    g = read_gguf(path)
    rows = [TensorRow(t.name, t.shape, t.type, t.n_bytes) for t in g.tensors]
    base = dict(path=str(g.path), architecture=g.arch, name=g.metadata.get(keys.KEY_NAME),
                file_bytes=g.file_size, n_tensors=len(g.tensors), tensor_types=_type_mix(rows), tensors=rows)
    if g.arch == keys.ARCH_EAGLE3:
        h = HeadInfo.from_gguf(g)
        return GGUFReport(kind="eagle3-head", n_embd=h.n_embd, n_vocab=h.n_vocab, target_layers=h.target_layers,
                          target_hidden_size=h.target_hidden_size, draft_vocab=h.draft_vocab,
                          norm_before_residual=h.norm_before_residual, norm_before_fc=h.norm_before_fc,
                          fc_norm=h.fc_norm, norm_output=h.norm_output,
                          own_token_embd=h.own_token_embd, own_output=h.own_output, n_head=h.n_head,
                          n_head_kv=h.n_head_kv, n_ff=h.n_ff, **base)
    t = TargetInfo.from_gguf(g)
    return GGUFReport(kind="target", n_layer=t.n_layer, n_embd=t.n_embd, n_vocab=t.n_vocab,
                      context_length=t.n_ctx_train, extraction_supported=t.extraction != "none",
                      extraction=t.extraction,
                      chat_template=t.has_chat_template, n_head=_heads(t.n_head), n_head_kv=_heads(t.n_head_kv),
                      **base)


def _heads(value) -> int | None:
    """A head count as stored: one number, or one per layer (hybrid models) reported as the largest."""
    if value is None:
        return None
    return max(int(v) for v in value) if isinstance(value, (list, tuple)) else int(value)
