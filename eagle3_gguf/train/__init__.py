"""Training an EAGLE-3 head for a GGUF target (the `[train]` extra: torch).

Stages, each in its own place under the run folder OUT/ and each resumable:
    data/        prompts → the target's greedy answers + 3 layer-input features per token (data.py)
    vocab.npz    the draft vocabulary: the N most frequent generated tokens (vocab.py)
    train/       the torch head trained with training-time test (model.py, loop.py)
    checkpoint/  SafeAILab-layout model.safetensors + config.json (export.py)
    head.gguf    converted with our converter (Q4_0 fc)

`run_training` chains them; data.py, vocab.py and prompts.py need no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import Eagle3Error


@dataclass
class PipelineConfig:
    n_prompts: int = 1000
    prompt_mix: str = "balanced"  # prompts.MIXES: "balanced" (every category) or "prose"
    layer_ids: list[int] | None = None  # default [2, n//2, n-3]
    draft_vocab: int = 8192
    n_ff: int | None = None  # the head's MLP width; default: the target's
    n_seq: int = 16
    max_new: int = 256
    data_target: str | Path | None = None  # generate the data with this GGUF of the same model (e.g. a faster
    #                                         quantization); the head is still built for `target`
    n_threads: int | None = None
    outtype: str = "f16"
    fc_type: str = "q4_0"
    seed: int = 0
    resume: bool = False
    train: Any = None  # a loop.TrainConfig; default TrainConfig()


@dataclass
class PipelineResult:
    out: Path
    n_tokens: int
    n_answer_tokens: int
    data_seconds: float
    draft_vocab: int
    coverage: dict[int, float]  # held-out coverage of generated tokens by vocab size
    train: Any  # loop.TrainResult
    checkpoint: Path
    gguf: Path
    gguf_bytes: int


Event = Callable[[str, Any], None]  # (stage, payload): "data" Progress, "vocab" dict, "train" TrainReport, ...


def run_training(target: str | Path, out: str | Path, cfg: PipelineConfig, on_event: Event | None = None) -> PipelineResult:
    """target GGUF → data → draft vocab → trained head → SafeAILab checkpoint → head GGUF in `out`."""
    import torch

    from ..convert.layouts import default_layer_ids
    from .data import DataConfig, generate_data, load_dataset
    from .export import convert_to_gguf, export_safeai, read_target, read_token_embeddings
    from .loop import TrainConfig, train_head
    from .model import HeadConfig
    from .prompts import MIXES, build_prompts, source
    from .vocab import DraftVocab, answer_token_counts, build_draft_vocab, heldout_coverage

    emit = on_event or (lambda _stage, _payload: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = read_target(target)
    layers = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(tgt.n_layer)
    if len(layers) != 3 or not all(0 <= x < tgt.n_layer for x in layers):
        raise Eagle3Error(f"--layer-ids {layers}: need 3 ids in 0..{tgt.n_layer - 1} for this target")

    data_target = cfg.data_target or target
    if cfg.data_target is not None:
        dt = read_target(data_target)
        if (dt.n_vocab, dt.n_embd, dt.n_layer) != (tgt.n_vocab, tgt.n_embd, tgt.n_layer):
            raise Eagle3Error(f"--data-model {data_target}: not the same model as {target} (vocab, hidden size, "
                              f"layers {dt.n_vocab}, {dt.n_embd}, {dt.n_layer} vs {tgt.n_vocab}, {tgt.n_embd}, "
                              f"{tgt.n_layer}): pass another quantization of the target")

    data_dir = out / "data"
    if (data_dir / "manifest.json").is_file() and not cfg.resume:
        raise Eagle3Error(f"{out} already holds a run: pass --resume to continue it, or choose another -o")
    if cfg.prompt_mix not in MIXES:
        raise Eagle3Error(f"--prompt-mix {cfg.prompt_mix}: one of {', '.join(MIXES)}")
    manifest = generate_data(data_target, build_prompts(cfg.n_prompts, cfg.seed, cfg.prompt_mix), data_dir,
                             DataConfig(layers=layers, n_seq=cfg.n_seq, max_new=cfg.max_new, n_threads=cfg.n_threads),
                             prompts_source=source(cfg.prompt_mix, cfg.seed), progress=lambda p: emit("data", p))
    data = load_dataset(data_dir)

    counts = answer_token_counts(data, tgt.n_vocab)
    sizes = sorted({1024, 2048, 4096, 8192, 16384, 32768} | {cfg.draft_vocab})
    coverage = heldout_coverage(data, tgt.n_vocab, [s for s in sizes if s <= tgt.n_vocab])
    vocab_path = out / "vocab.npz"
    if cfg.resume and vocab_path.is_file():
        vocab = DraftVocab.load(vocab_path, tgt.n_vocab)
        if vocab.size != cfg.draft_vocab:
            raise Eagle3Error(f"{vocab_path}: this run's draft vocab has {vocab.size} tokens, not {cfg.draft_vocab}")
    else:
        vocab = build_draft_vocab(counts, cfg.draft_vocab)
        vocab.save(vocab_path)
    emit("vocab", {"size": vocab.size, "coverage": vocab.coverage, "curve": coverage})  # in-sample, held-out

    head_cfg = HeadConfig.for_target(tgt, vocab.size, cfg.n_ff)
    embed = torch.from_numpy(read_token_embeddings(target))  # [n_vocab, n_embd]
    head, result = train_head(data, vocab, head_cfg, embed, out / "train", cfg.train or TrainConfig(),
                              resume=cfg.resume, progress=lambda r: emit("train", r))

    ckpt_dir = export_safeai(head, vocab, layers, tgt.n_layer, out / "checkpoint")
    conv = convert_to_gguf(ckpt_dir, target, out / "head.gguf", layers, outtype=cfg.outtype, fc_type=cfg.fc_type,
                           name=f"{Path(target).stem}-eagle3")
    emit("convert", conv)
    return PipelineResult(out, manifest.n_tokens, manifest.n_answer_tokens, manifest.seconds, vocab.size, coverage,
                          result, ckpt_dir, conv.out, conv.file_bytes)
