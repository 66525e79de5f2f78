"""eagle3-gguf: EAGLE-3 speculative decoding on llama.cpp, from Python."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# llama_cpp before numpy and any module that imports gguf (which imports sentencepiece where it is installed): on
# the lent H200's image numpy, sentencepiece or tokenizers loaded first made llama.cpp segfault in its tokenizer's
# set-up at model load; llama_cpp first loaded (bench/NOTES.md, tree-gpu and scale-gpu). A training machine may
# lack it, or its library: train.torch_target needs neither, and the modules that run llama.cpp import it
# themselves (and raise there)
try:
    importlib.import_module("llama_cpp")
except (ImportError, OSError, RuntimeError):
    pass

from .errors import Eagle3Error, NativeError  # noqa: E402

__all__ = ["Eagle3Error", "NativeError", "__version__"]
