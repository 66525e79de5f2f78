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


# What .ci/run may do besides the README command: fail on the first error, start at the root, and afterwards
# (in the venv the README command leaves active) check the built wheel.
CI_BEFORE = ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
CI_AFTER = ["python scripts/check_wheel.py"]


def test_ci_runs_exactly_the_readme_test_command():
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith("#")]
    command = readme_command("test-command")
    assert command.endswith("&& pytest")
    assert lines == [*CI_BEFORE, command, *CI_AFTER]
    assert all((ROOT / step.split()[1]).is_file() for step in CI_AFTER)


def test_main_command_runs_generate_with_baseline_on_the_defaults():
    assert readme_command("main-command").endswith("eagle3-gguf generate --baseline")
