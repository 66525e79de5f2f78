"""README.md's two set-up commands: CI runs exactly the test command, and the main command runs generate."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_command(name: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(rf"<!-- {name} -->\s*```\n(.*?)\n```\s*<!-- /{name} -->", text, re.S)
    assert block, f"README.md has no {name} block"
    return block.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[-1] == readme_command("test-command")
    assert lines[-1].endswith("&& pytest")


def test_main_command_runs_generate_with_baseline_on_the_defaults():
    assert readme_command("main-command").endswith("eagle3-gguf generate --baseline")
