"""Flags for `eagle3-gguf generate` in tests that need a head to really draft."""

from __future__ import annotations

import os
import subprocess
import sys


def fixed_policy() -> list[str]:
    """`--draft-policy fixed` where generate has that flag: a random head must really draft, and an
    adaptive policy stops drafting with a head that is never accepted."""
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "generate", "--help"], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "200"})
    return ["--draft-policy", "fixed"] if "--draft-policy" in r.stdout else []
