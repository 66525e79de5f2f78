"""eagle3-gguf: EAGLE-3 speculative decoding on llama.cpp, from Python."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import Eagle3Error, NativeError

__all__ = ["Eagle3Error", "NativeError", "__version__"]
