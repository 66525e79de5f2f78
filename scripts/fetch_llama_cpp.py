#!/usr/bin/env python3
"""Fetch the pinned llama.cpp source into vendor/llama.cpp/ (gitignored).

The tree is the one bundled in the llama-cpp-python sdist named in vendor/llama.cpp/PIN: the sdist
is downloaded from the package index with pip, its sha256 checked, and its llama.cpp unpacked.
Idempotent: a stamp file records the sha256 of what is unpacked.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pin import VENDOR_DIR, read_pin  # noqa: E402

STAMP = VENDOR_DIR / ".fetched-sha256"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(pin) -> Path:
    dest = pin.cache_dir / "sdist"
    sdist = dest / pin.sdist
    if not sdist.exists():
        dest.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "-d", str(dest), f"{pin.package}=={pin.version}"], capture_output=True, text=True)
        if r.returncode != 0 or not sdist.exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"error: could not download {pin.sdist} from the package index: {tail}")
    digest = sha256_of(sdist)
    if digest != pin.sha256:
        sdist.unlink()
        sys.exit(f"error: {sdist.name} sha256 {digest} != pinned {pin.sha256}; refusing to unpack")
    return sdist


def unpack(pin, sdist: Path) -> None:
    prefix = pin.subdir.rstrip("/") + "/"
    tmp = VENDOR_DIR.parent / ".llama.cpp.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(prefix):]
            if m.name and not m.name.startswith(("/", "..")):
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    for child in VENDOR_DIR.iterdir():
        if child.name != "PIN":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    for child in tmp.iterdir():
        shutil.move(str(child), VENDOR_DIR / child.name)
    tmp.rmdir()


def main() -> None:
    pin = read_pin()
    if STAMP.exists() and STAMP.read_text().strip() == pin.sha256:
        print(f"vendor/llama.cpp: already at {pin.package} {pin.version} (llama.cpp {pin.build})")
        return
    sdist = download(pin)
    unpack(pin, sdist)
    STAMP.write_text(pin.sha256 + "\n")
    print(f"vendor/llama.cpp: unpacked llama.cpp {pin.build} from {pin.sdist} (sha256 ok)")


if __name__ == "__main__":
    main()
