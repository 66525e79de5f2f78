"""A row's choice made in the graph: choice.c's backend sampler, for Context.set_graph_choice.

Greedy decoding reads one thing of a verify row, its argmax, and a greedy draft step two or a few: the head's
likeliest tokens and their probabilities under a softmax over the whole vocab (the policy's confidence, a tree's
branches). llama.cpp's backend sampling can take them in the graph, so that a row's logits need not cross to the host
(128,256 floats a row at Llama 3's vocab) nor numpy go over them. Its own greedy sampler hands the row back all the
same (as the sampled row's logits); choice.c's sampler hands back only the ids and probabilities asked for.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from llama_cpp import llama_cpp as C

from .cbuild import library
from .errors import Eagle3Error
from .native import _Owner, sibling_library

_SOURCE = Path(__file__).with_name("choice.c")
_GGML = ("nelements", "reshape_1d", "reshape_2d", "soft_max", "argmax", "top_k", "get_rows")


class _Choice(ctypes.Structure):
    """choice.c's `struct choice`."""

    _fields_ = [*((name, ctypes.c_void_p) for name in _GGML), ("k", ctypes.c_int), ("probs", ctypes.c_int)]


_unavailable: str | None = None  # why choice.c cannot be built or loaded in this process, once found


def available() -> bool:
    """Whether the graph can choose here: choice.c builds (a C compiler, once) and ggml's base library is beside
    libllama. Where not, a Context hands back the logits as llama-cpp-python does (no compiler is needed to decode)."""
    global _unavailable
    if _unavailable is None:
        try:
            _compiled()
            if sibling_library("ggml-base") is None:
                raise Eagle3Error("no libggml-base beside libllama")
            _unavailable = ""
        except Eagle3Error as e:
            _unavailable = str(e)
    return not _unavailable


def _compiled() -> ctypes.CDLL:
    lib = library(_SOURCE, "choosing tokens in the graph", _Choice)
    # struct llama_sampler_i * eagle3_choice_iface(void)
    lib.eagle3_choice_iface.restype = ctypes.c_void_p
    return lib


class GraphChoice(_Owner):
    """A sampler chain holding choice.c's sampler: each output row's argmax (k = 1) or its k likeliest token ids in
    no order (k > 1), and with `probs` their probabilities. The chain owns the sampler; the sampler reads its settings
    from `_struct`, which lives as long as this object."""

    def __init__(self, k: int, probs: bool):
        if k < 1:
            raise Eagle3Error(f"a graph choice of {k} tokens: at least 1")
        if not available():
            raise Eagle3Error(f"tokens cannot be chosen in the graph here: {_unavailable}")
        base, lib = sibling_library("ggml-base"), _compiled()
        self.k, self.probs = k, probs
        c = self._struct = _Choice(k=k, probs=int(probs))
        for name in _GGML:
            setattr(c, name, ctypes.cast(getattr(base, f"ggml_{name}"), ctypes.c_void_p))
        # LLAMA_API struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
        ptr = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if not ptr:
            raise Eagle3Error("llama_sampler_chain_init failed")
        self.ptr = ptr
        # LLAMA_API struct llama_sampler * llama_sampler_init(struct llama_sampler_i * iface, llama_sampler_context_t ctx);
        smpl = C.llama_sampler_init(ctypes.cast(lib.eagle3_choice_iface(), ctypes.POINTER(C.llama_sampler_i)),
                                    ctypes.cast(ctypes.pointer(c), ctypes.c_void_p))
        # LLAMA_API void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
        C.llama_sampler_chain_add(ptr, smpl)  # the chain owns it

    def _free(self, ptr) -> None:
        C.llama_sampler_free(ptr)
