"""Shared fixtures: the real SmolLM2 GGUF and tiny random GGUFs the tests build themselves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))  # serving.py, shared with scripts/soak.py

from eagle3_gguf.assets import smollm2_path as _smollm2_path
from model_factory import HeadSpec, TinyDims, write_random_head, write_tiny_target

TINY = TinyDims()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _smollm2_path()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_path) -> Path:
    """A 6-layer random llama target (hidden 64) with SmolLM2's tokenizer."""
    return write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny-target.gguf", TINY, tokenizer_from=smollm2_path)


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, tiny_target) -> Path:
    """A random EAGLE-3 head for tiny_target, borrowing its embeddings and lm_head."""
    spec = HeadSpec(n_embd_tgt=TINY.n_embd, target_layers=(1, 3, 5))
    return write_random_head(tmp_path_factory.mktemp("tiny") / "tiny-head.gguf", spec, tokenizer_from=tiny_target)


@pytest.fixture(scope="session")
def tiny_head_d2t(tmp_path_factory, tiny_target) -> Path:
    """A random EAGLE-3 head with a 512-token draft vocab (d2t + own lm_head)."""
    spec = HeadSpec(n_embd_tgt=TINY.n_embd, target_layers=(0, 2, 5), draft_vocab=512)
    return write_random_head(tmp_path_factory.mktemp("tiny") / "tiny-head-d2t.gguf", spec, tokenizer_from=tiny_target)
