"""The llama.cpp pin (vendor/llama.cpp/PIN) and where its fetched source and builds live."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "vendor" / "llama.cpp" / "PIN"
VENDOR_DIR = PIN_FILE.parent


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    sdist: str
    sha256: str
    subdir: str
    build: str

    @property
    def cache_dir(self) -> Path:
        """Outside the clone, keyed by the pin, so fresh clones and CI reuse it."""
        base = Path(os.environ.get("EAGLE3_GGUF_CACHE", Path.home() / ".cache" / "eagle3-gguf"))
        return base / f"llama.cpp-{self.build}-{self.sha256[:12]}"


def read_pin() -> Pin:
    fields = {}
    for line in PIN_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip()
    return Pin(**fields)
