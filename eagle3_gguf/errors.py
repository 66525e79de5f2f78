"""The one exception type that users see.

Every error a user can cause (a bad file, a mismatched pair, a bad flag) is raised as `Eagle3Error`
with a one-line message that says what is wrong and what to do. The CLI prints it and exits 2;
library callers catch it like any other exception.
"""

from __future__ import annotations


class Eagle3Error(Exception):
    """A user-facing error: one line, actionable."""


class DecodeError(Eagle3Error, RuntimeError):
    """llama_decode failed: a RuntimeError too, as llama-cpp-python raises for it, so code that catches that still does."""


class NativeError(Eagle3Error):
    """libllama lacks something this package needs (wrong llama-cpp-python build)."""
