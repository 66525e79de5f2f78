"""Benchmark prompts for the scripts: `eagle3_gguf.benchmarks` (MT-bench and HumanEval read out of the
wheels that ship them), with its one-line errors turned into an exit. Benchmarks only: never train on them.
"""

from __future__ import annotations

from eagle3_gguf import benchmarks
from eagle3_gguf.benchmarks import SOURCES, Prompt, cache_dir  # noqa: F401
from eagle3_gguf.errors import Eagle3Error


def load(workload: str, limit: int | None = None) -> list[Prompt]:
    try:
        return benchmarks.load(workload, limit)
    except Eagle3Error as e:
        raise SystemExit(f"error: {e}") from None
