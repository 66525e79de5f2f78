"""CI's wheel check: build the wheel, install it into a fresh venv and, from that venv, run every command's
`--help` and import every module of the package.

An editable checkout hides what a wheel lacks (a subpackage, the embedded head); this finds it. The fresh
venv gets the dependencies pinned to the versions of the venv running this script (pip's wheel cache, so
llama-cpp-python is not rebuilt; nothing beyond the package index), with the `[train]` extra, which the
train modules import. Run from the dev venv:

    python scripts/check_wheel.py
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "eagle3_gguf"
SUBPACKAGE_DIRS = {"convert": f"{PACKAGE}.convert"}  # pyproject's package-dir: top-level folder -> package
DATA = ("heads/*.gguf", "heads/*.md", "capture.c", "choice.c", "chain.c", "logfilter.c")  # pyproject's package-data
NOT_SOURCE = (".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "vendor", "runs",
              "_work")

# Run inside the fresh venv: import every module of the installed package, print one name per line.
IMPORT_ALL = f"""
import importlib, pkgutil, sys
import {PACKAGE}
sys.stderr.write({PACKAGE}.__file__ + "\\n")
for m in pkgutil.walk_packages({PACKAGE}.__path__, "{PACKAGE}."):
    importlib.import_module(m.name)
    print(m.name)
print("{PACKAGE}")
"""
COMMANDS = f"import typer.main; from {PACKAGE}.cli.main import app; print(*typer.main.get_command(app).commands)"


def source_modules() -> set[str]:
    """Every module the checkout has, named as installed."""
    names = set()
    roots = {ROOT / PACKAGE: PACKAGE, **{ROOT / d: name for d, name in SUBPACKAGE_DIRS.items()}}
    for folder, prefix in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.add(".".join([prefix, *parts]))
    return names


def run(cmd: list[str], cwd: Path, what: str) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"check_wheel: {what} failed (exit {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r.stdout


def check(work: Path) -> None:
    t0 = time.monotonic()
    pip = [sys.executable, "-m", "pip"]
    # build from a copy without build outputs: setuptools reuses a stale build/lib, which could hide a lack
    shutil.copytree(ROOT, work / "src", ignore=shutil.ignore_patterns(*NOT_SOURCE))
    run([*pip, "wheel", "--no-deps", "-q", "-w", str(work / "dist"), str(work / "src")], work, "building the wheel")
    wheel = next((work / "dist").glob(f"{PACKAGE}-*.whl"))
    pins = run([*pip, "list", "--format=freeze", "--exclude-editable"], work, "pip list")
    (work / "constraints.txt").write_text(pins)
    run([sys.executable, "-m", "venv", str(work / "venv")], work, "creating the venv")
    bindir = work / "venv" / "bin"
    run([str(bindir / "python"), "-m", "pip", "install", "-q", "--no-compile", "-c", str(work / "constraints.txt"),
         f"{wheel}[train]"], work, f"installing {wheel.name}")  # --no-compile: torch's .pyc files alone take a minute
    print(f"check_wheel: {wheel.name} built and installed in {time.monotonic() - t0:.0f}s")

    r = subprocess.run([str(bindir / "python"), "-c", IMPORT_ALL], cwd=work, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"check_wheel: importing the installed package failed:\n{r.stderr[-3000:]}")
    location = Path(r.stderr.splitlines()[0]).resolve()
    if work.resolve() not in location.parents:
        sys.exit(f"check_wheel: {PACKAGE} was imported from {location}, not from the fresh venv")
    installed = set(r.stdout.split())
    missing = sorted(source_modules() - installed)
    if missing:
        sys.exit(f"check_wheel: the wheel lacks {', '.join(missing)}")
    package_dir = location.parent
    for pattern in DATA:
        want = {p.name for p in (ROOT / PACKAGE).glob(pattern)}
        have = {p.name for p in package_dir.glob(pattern)}
        if want - have:
            sys.exit(f"check_wheel: the wheel lacks package data {sorted(want - have)} ({pattern})")
    print(f"check_wheel: imported all {len(installed)} modules from the wheel, package data present")

    cli = str(bindir / "eagle3-gguf")
    commands = run([str(bindir / "python"), "-c", COMMANDS], work, "listing the commands").split()
    run([cli, "--help"], work, "eagle3-gguf --help")
    for name in commands:
        if "Usage:" not in run([cli, name, "--help"], work, f"eagle3-gguf {name} --help"):
            sys.exit(f"check_wheel: eagle3-gguf {name} --help printed no usage")
    print(f"check_wheel: eagle3-gguf --help and {' '.join(commands)} --help ran ({time.monotonic() - t0:.0f}s in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="Keep the build and the venv (printed) for a look.")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eagle3-wheel-"))
    try:
        check(work)
    finally:
        if args.keep:
            print(f"check_wheel: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
