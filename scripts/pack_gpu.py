#!/usr/bin/env python
"""Pack what head v2's lent GPU call needs into ignored carry folders, from a fresh checkout, and print the calls.

    python scripts/pack_gpu.py [--answers] [--minutes 9.3] [--answer-minutes 5] [--init-from HEAD.gguf | --from-scratch]

A device call carries at most 64 MiB with the working tree (~21 MiB: the shipped head is half of it), and nothing
is fetched there, so the 94 MiB target travels in three parts (`.gpu/m1`, `.gpu/m2`, `.gpu/m3`; 37 MiB each at
most), the last beside the gguf wheel (pure Python; the machine's image has numpy, torch, safetensors, typer) and
the target's sha256. `--stage prepare`'s outputs (runs/smollm2-v2/sharegpt, ours.npz, prose.npz) are made here
first where missing. `--answers` also packs the answers this machine made (`--stage answers`: self*.npz) for a
call of their own: they live in runs/, which a new checkout does not have, so only a session that made them can.

The calls it prints: two that copy the first parts to /tmp/parts (the first starts the machine), then
`bash scripts/gpu_train_v2.sh MINUTES --self --answer-minutes M --init-from HEAD --tag ft` (join, check, install,
answer, fine-tune the shipped head or HEAD, export; exit 75 while work is left: rerun it while the machine is warm).
Fine-tuning the shipped head made stage 4, the head shipped (bench/NOTES head-v2-ft-h200); `--from-scratch` trains a
fresh one. The device's minutes are the budget: `status` first.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from eagle3_gguf.assets import default_head_path, smollm2_path  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts"))
from train_smollm2 import V2_ANSWERS as ANSWERS, V2_PROMPT_SETS as PROMPTS, V2_RUN as RUN  # noqa: E402

PACK = ROOT / ".gpu"
PART_BYTES = 37 << 20  # the three calls about even: ~58-59 MiB each with today's tree
CALL_LIMIT = 64 << 20  # what one call carries, the working tree included
PARTS = ("m1", "m2", "m3")


class PackError(Exception):
    """A one-line reason the pack cannot be made (exit 2)."""


def tree_bytes() -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def split_target(target: Path) -> str:
    """The target in three parts, one per carry folder; its sha256 beside the last part."""
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        for i, name in enumerate(PARTS):
            (PACK / name).mkdir(parents=True, exist_ok=True)
            chunk = f.read(PART_BYTES)
            digest.update(chunk)
            (PACK / name / f"smol.part{i}").write_bytes(chunk)
        if f.read(1):
            raise PackError(f"{target} is over {len(PARTS) * PART_BYTES} bytes: more parts are needed")
    # its own file name: the head's general.name is made from it
    (PACK / "m3" / "target.sha256").write_text(f"{digest.hexdigest()}  {target.name}\n")
    return digest.hexdigest()


def gguf_wheel() -> Path:
    """The installed gguf package's wheel (pure Python), downloaded into .gpu/m3."""
    version = metadata.version("gguf")
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "-d", str(PACK / "m3"), f"gguf=={version}"])
    wheels = sorted((PACK / "m3").glob("gguf-*.whl"))
    if got.returncode or len(wheels) != 1:
        raise PackError(f"pip could not download gguf=={version}'s wheel into {PACK / 'm3'}: check the package index")
    return wheels[0]


def travelling_head(head: Path) -> str:
    """HEAD's path in the repository, which the call's working tree brings (not ignored by git)."""
    path = head.resolve()
    if not path.is_file():
        raise PackError(f"--init-from {head}: no such file (a head GGUF)")
    if not path.is_relative_to(ROOT):
        raise PackError(f"--init-from {head}: outside this repository, so no call brings it: copy it in")
    rel = path.relative_to(ROOT).as_posix()
    if subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", rel]).returncode == 0:
        raise PackError(f"--init-from {head}: git ignores it, so no call brings it: copy it outside runs/")
    return rel


def pack(args: argparse.Namespace) -> None:
    """Make the carry folders and print the calls."""
    found = [RUN / n for n in ANSWERS if (RUN / n).is_file()]
    if args.answers and not found:
        raise PackError(f"--answers: no {' or '.join(ANSWERS)} in {RUN}: make them with "
                        "scripts/train_smollm2.py --v2 --stage answers, or leave out --answers")
    if not (RUN / "sharegpt").is_dir() or not all((RUN / f).is_file() for f in PROMPTS):
        prepare = [sys.executable, str(ROOT / "scripts" / "train_smollm2.py"), "--v2", "--stage", "prepare"]
        if subprocess.run(prepare).returncode:
            raise PackError("preparing the conversations failed (above): fix that, then pack again")
    init_from = None if args.from_scratch else travelling_head(Path(args.init_from) if args.init_from else
                                                                default_head_path())
    shutil.rmtree(PACK, ignore_errors=True)
    digest = split_target(smollm2_path())
    wheel = gguf_wheel()
    calls = [([".gpu/m1"], "mkdir -p /tmp/parts && cp .gpu/m1/smol.part0 /tmp/parts/"),
             ([".gpu/m2"], "cp .gpu/m2/smol.part1 /tmp/parts/")]
    if args.answers:
        (PACK / "answers").mkdir()
        for f in found:
            shutil.copy2(f, PACK / "answers" / f.name)
        # runs/ is kept in the machine's copy of the repository while it is warm
        calls.append(([".gpu/answers"], "mkdir -p runs/smollm2-v2 && cp .gpu/answers/*.npz runs/smollm2-v2/"))
    calls.append(([".gpu/m3", "runs/smollm2-v2/sharegpt", *(f"runs/smollm2-v2/{f}" for f in PROMPTS)],
                  f"bash scripts/gpu_train_v2.sh {args.minutes:g} --self --answer-minutes {args.answer_minutes:g}"
                  + ("" if args.from_scratch else f" --init-from {init_from} --tag ft")))
    tree = tree_bytes()
    print(f"target sha256 {digest[:16]}, {wheel.name}; the working tree carries {tree / 2**20:.1f} MiB each call")
    for i, (carry, command) in enumerate(calls, 1):
        size = tree + sum(folder_bytes(ROOT / c) for c in carry)
        if size > CALL_LIMIT:
            raise PackError(f"call {i} would carry {size / 2**20:.1f} MiB, over 64 MiB: carry less")
        print(f"call {i} ({size / 2**20:.1f} MiB): carry {carry}\n    {command}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", action="store_true",
                    help="also pack runs/smollm2-v2/self*.npz for a call of their own")
    ap.add_argument("--minutes", type=float, default=9.3, help="the training call's budget (at most 9.5: the call "
                    "installs first, within the device's 10 minutes)")
    ap.add_argument("--answer-minutes", type=float, default=5.0, help="how long that call answers before it trains")
    start = ap.add_mutually_exclusive_group()
    start.add_argument("--init-from", help="the head GGUF the call fine-tunes, inside this repository (default: the "
                       "shipped head)")
    start.add_argument("--from-scratch", action="store_true", help="train a fresh head instead")
    args = ap.parse_args()
    if not 0 < args.answer_minutes < args.minutes <= 9.5:
        print("error: --answer-minutes must be under --minutes, and --minutes at most 9.5 (one device call)",
              file=sys.stderr)
        return 2
    try:
        pack(args)
    except (PackError, Eagle3Error) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
