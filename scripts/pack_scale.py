#!/usr/bin/env python3
"""Pack what issue 54's lent GPU call needs into the ignored carry folder .gpu/scale, and print the call.

    python scripts/pack_scale.py

The call (scripts/gpu_scale.sh) unpacks or builds llama-cpp-python with CUDA there, makes the synthetic models there
and runs scripts/bench_scale.py, in one command of at most 10 minutes; nothing can be fetched there, and a call
carries at most 64 MiB with the working tree (~19 MiB; pack_scale prints the sum). So the folder holds:
- llama-cpp-python's sdist, trimmed (76.6 MB as published): no .git (38 MB), no vocab-only test models
  (vendor/llama.cpp/models/*.gguf, 74 MB unpacked), no docs, benches or media (the build reads none of them);
- the wheels of what the machine's image lacks (WHEELS: gguf, and llama-cpp-python's diskcache; pure Python), at the
  versions installed here;
- the CUDA build scripts/cuda_wheel.py made here (cuda_wheel.TREE, with its BUILT line), in cuda/ where it is there
  or kept from an earlier clone: the call unpacks it in seconds, and builds from the sdist only where it does not load;
- SmolLM2's tokenizer alone (synthetic.write_vocab: the synthetic targets pad it), not the 94 MiB model: its
  exactness probe would take three calls of parts (scripts/pack_gpu.py's way), and the synthetic pairs' probes
  come with the benchmark;
- SHA256SUMS, checked there before anything is used.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
import cuda_wheel  # noqa: E402
import fetch_llama_cpp  # noqa: E402
import synthetic  # noqa: E402
from pin import read_pin  # noqa: E402

from eagle3_gguf.errors import Eagle3Error  # noqa: E402

PACK = ROOT / ".gpu" / "scale"
CALL_LIMIT = 64 << 20  # what one call carries, the working tree included
SDIST = "llama_cpp_python-trimmed.tar.gz"
VOCAB = "smollm2-vocab.gguf"
DROP_DIRS = ("vendor/llama.cpp/docs/", "vendor/llama.cpp/benches/", "vendor/llama.cpp/media/")
# What the lent machine's image holds of what the call imports (.library/device/KINDS.md, its package list of
# 2026-11-17), and the wheels carried for the rest: the first lent call of 2026-11-27 stopped at llama_cpp's
# `import diskcache`. tests/test_scale.py checks that the two cover llama-cpp-python's, gguf's and our requirements.
IMAGE_HAS = frozenset({"numpy", "jinja2", "typing-extensions", "pyyaml", "requests", "tqdm", "safetensors", "typer",
                       "torch", "sentencepiece"})
WHEELS = ("gguf", "diskcache")


class PackError(Exception):
    """A one-line reason the pack cannot be made (exit 2)."""


def keep(name: str) -> bool:
    """Whether an sdist member (its name below the top folder) goes into the trimmed sdist."""
    parts = name.split("/")
    if ".git" in parts or any(name.startswith(d) for d in DROP_DIRS):
        return False
    return not (name.startswith("vendor/llama.cpp/models/") and name.endswith(".gguf"))


def trim_sdist(src: Path, dst: Path) -> tuple[int, int]:
    """Copy src into dst without what keep() drops: (members kept, members dropped)."""
    kept = dropped = 0
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz", compresslevel=6) as tout:
        for m in tin:
            below = m.name.partition("/")[2]
            if not keep(below):
                dropped += 1
                continue
            data = tin.extractfile(m).read() if m.isfile() else None
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
            kept += 1
    return kept, dropped


def wheel(name: str) -> Path:
    """`name`'s wheel at the version installed here, from pip's index (or its cache) into the pack."""
    version = metadata.version(name)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                          "-d", str(PACK), f"{name}=={version}"])
    wheels = sorted(PACK.glob(f"{name}-*.whl"))
    if got.returncode or len(wheels) != 1:
        raise PackError(f"pip could not download {name}=={version}'s wheel into {PACK}: check the package index")
    return wheels[0]


def tree_bytes() -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def pack() -> None:
    shutil.rmtree(PACK, ignore_errors=True)
    PACK.mkdir(parents=True)
    pin = read_pin()
    try:
        sdist = fetch_llama_cpp.download(pin)  # the pinned sdist, from pip's index where not cached
    except SystemExit as e:
        raise PackError(str(e.code).removeprefix("error: ")) from None
    kept, dropped = trim_sdist(sdist, PACK / SDIST)
    wheels = [wheel(name) for name in WHEELS]
    synthetic.write_vocab(PACK / VOCAB, synthetic.default_tokenizer())
    files = [PACK / SDIST, *wheels, PACK / VOCAB]
    built = [cuda_wheel.OUT / cuda_wheel.TREE, cuda_wheel.OUT / cuda_wheel.BUILT]
    if not all(f.exists() for f in built):
        cuda_wheel.restore()  # a build an earlier clone made and kept: this clone's .gpu is new
    if all(f.exists() for f in built) and pin.sdist in built[1].read_text():  # a build of the pinned version
        (PACK / "cuda").mkdir()
        files += [Path(shutil.copy2(f, PACK / "cuda" / f.name)) for f in built]
    (PACK / "SHA256SUMS").write_text("".join(f"{fetch_llama_cpp.sha256_of(f)}  {f.relative_to(PACK)}\n"
                                             for f in files))
    carried = sum(f.stat().st_size for f in PACK.rglob("*") if f.is_file())
    tree = tree_bytes()
    prebuilt = (f"the CUDA build {built[0].stat().st_size / 2**20:.1f} MiB" if (PACK / "cuda").exists() else
                "no CUDA build (python scripts/cuda_wheel.py makes one: the call then skips its 4-minute build)")
    print(f"{PACK.relative_to(ROOT)}: sdist {(PACK / SDIST).stat().st_size / 2**20:.1f} MiB ({kept} members kept, "
          f"{dropped} dropped), {', '.join(w.name for w in wheels)}, "
          f"{VOCAB} {(PACK / VOCAB).stat().st_size / 2**20:.1f} MiB, {prebuilt}")
    if tree + carried > CALL_LIMIT:
        raise PackError(f"the call would carry {(tree + carried) / 2**20:.1f} MiB, over 64 MiB: carry less")
    print(f"the call carries {(tree + carried) / 2**20:.1f} MiB (working tree {tree / 2**20:.1f} MiB):\n"
          f"    carry ['.gpu/scale'], timeout_s 600\n    bash scripts/gpu_scale.sh")


def main() -> int:
    if len(sys.argv) > 1:
        print("error: pack_scale.py takes no arguments (see its docstring)", file=sys.stderr)
        return 2
    try:
        pack()
    except (PackError, Eagle3Error, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
