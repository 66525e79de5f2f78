"""Load a target and an EAGLE-3 head as a pair, after checking in pure Python that they fit.

Every check runs on the GGUF headers before llama.cpp sees the files, because the pinned
llama.cpp answers most mismatches with GGML_ASSERT (an abort, not an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES

from . import keys, rpc
from .capture import capture_for
from .context import Context
from .errors import Eagle3Error
from .gguf_file import HeadInfo, TargetInfo, read_gguf, tensor_bytes
from .native import Model, cache_type, default_threads, flash_attn_type, free_memory
from .session import Eagle3Session
from .speculator import Speculator


@dataclass
class PairConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0  # the target's layers offloaded to a GPU (< 0: all), as llama.cpp's -ngl
    n_gpu_layers_draft: int | None = None  # the head's (-ngld); None: as the target's
    draft_n_ctx: int | None = None  # defaults to n_ctx
    # The target's KV cache (llama.cpp's -ctk/-ctv). On a CPU, V in bf16 keeps ggml-cpu's flash attention
    # batch-invariant (native.batch_invariant_cache), so speculative output equals target-only output
    # bit for bit at any context length and thread count; with f16/f16 (llama.cpp's default) a lone
    # row past 256 tokens takes a split-KV path and near-ties can part. bf16 V is read into an f32
    # accumulator (f16 V accumulates in f16), and costs ~4% of target-only speed here (96 vs 100 tok/s).
    # "auto": bf16 there, f16 where the target's layers are on a GPU (default_type_v)
    cache_type_k: str = "f16"
    cache_type_v: str = "auto"
    flash_attn: bool = True  # batch-invariant rows need it on CPU (docs/exactness.md)
    # llama.cpp repacks some weight types for its CPU kernels; Q4_K's (q4_K_8x8 here) then compute a verify
    # row differently from a lone row (Gemma 3 270M Q4_K_M: logits off by 0.5-1.2), while Q4_0's stay exact and
    # are twice as fast in batches. None: repack where the target's types are keys.REPACK_EXACT_TYPES, else
    # load the weights as stored (bit-equal rows; Gemma's decode measured no slower: 9.41 vs 9.37 ms a token)
    repack: bool | None = None
    n_seq_max: int = 1  # each context's sequences: a draft tree's (DraftConfig.tree_sequences)
    rpc_servers: tuple[str, ...] = ()  # rpc-server hosts (host:port) for the target's offloaded layers
    rpc_backend: str | None = None  # a libggml-rpc module, where llama-cpp-python has no RPC built in
    # the target's offloaded layers per device (llama.cpp's --tensor-split), or rpc.HEAD_SPLIT: rpc.head_split's
    tensor_split: tuple[float, ...] | str = ()


def default_type_v(n_gpu_layers: int, remote: bool = False, offload_kqv: bool = True) -> str:
    """The target's V cache type where none is asked for (-ctv auto): bf16 where its layers run on this machine's CPU,
    which keeps ggml-cpu's flash attention batch-invariant (native.batch_invariant_cache); f16 where they go to a local
    GPU. On CUDA bf16 buys no exactness (ggml-cuda's flash attention takes its vector kernel for one row and its MMA
    kernel for two or more, with either type) and costs a copy: the default build has no f16-bf16 vector kernel, so
    it converts V to f16 on every lone-row decode, as the MMA kernel does for batches (fattn.cu,
    fattn-mma-f16.cuh). On Metal it costs more: its flash attention takes K and V of one type only, so attention
    would run on the CPU, layer by layer (ggml-metal-device.m's supports_op). Others are taken to be alike,
    unmeasured. With RPC servers in play bf16 stays: their backends are not known here. So it does where the cache and
    attention stay on the CPU with the layers on a GPU (llama-cpp-python's offload_kqv=False)."""
    return "f16" if _kv_cache_on(n_gpu_layers, remote, offload_kqv) == "gpu" else "bf16"


def _kv_cache_on(n_gpu_layers: int, remote: bool, offload_kqv: bool) -> str:
    """Where the target's KV cache (and its attention) lives: "cpu", "rpc" (servers', of unknown backends) or "gpu"
    (this machine's)."""
    if n_gpu_layers == 0 or not offload_kqv:
        return "cpu"
    if remote or rpc.in_use():
        return "rpc"
    return "gpu" if rpc.local_devices() else "cpu"


def check_kv_memory(target: TargetInfo, n_ctx: int, type_k: int, type_v: int, n_gpu_layers: int, remote: bool = False,
                    offload_kqv: bool = True) -> None:
    """Refuse a context whose target KV cache alone cannot fit in this machine's free memory, where the cache lives on
    its CPU: llama.cpp zeroes the whole cache as it makes it, and past the free memory the kernel kills the process
    without a word (-c 2000000000 did, after a minute). A lower bound (the weights and the head's cache left out, a
    head's K and V widths as llama.cpp reads them), so only for architectures that cache every token in every layer."""
    n_ctx = n_ctx or target.n_ctx_train
    if _kv_cache_on(n_gpu_layers, remote, offload_kqv) != "cpu" or target.arch not in keys.FULL_KV_ARCHS or \
            target.sliding_window or n_ctx <= 0:
        return
    free = free_memory()
    heads = target.n_head if isinstance(target.n_head, list) else [target.n_head or 0]
    kv = target.n_head_kv if isinstance(target.n_head_kv, list) else [target.n_head_kv or 0] * target.n_layer
    if free is None or not max(heads) or type_k not in GGML_QUANT_SIZES or type_v not in GGML_QUANT_SIZES:
        return  # (an unknown type: llama.cpp's to refuse)
    width_k = target.key_length or target.n_embd // max(heads)  # llama.cpp's default for each: hidden / heads
    width_v = target.value_length or target.n_embd // max(heads)
    cells = n_ctx * sum(kv)  # K and V rows of a head, over every token and layer
    need = tensor_bytes([cells * width_k], type_k) + tensor_bytes([cells * width_v], type_v)
    if need > free:
        raise Eagle3Error(f"a context of {n_ctx} tokens needs {_gib(need)} for {target.path.name}'s KV cache alone, "
                          f"more than the {_gib(free)} this machine has free: lower -c (n_ctx)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_pair(target: TargetInfo, head: HeadInfo, d2t: np.ndarray | None = None) -> None:
    """Raise one Eagle3Error line for the first thing that keeps the two from working together."""
    target.require_extraction()
    if target.captured and 0 in head.target_layers:
        raise Eagle3Error(
            f"head extracts layer id 0 (the embeddings), which eagle3-gguf captures only from hooked graphs, not "
            f"'{target.arch}': reconvert the head with --layer-ids from 1")
    if head.target_hidden_size != target.n_embd:
        raise Eagle3Error(
            f"head expects target hidden size {head.target_hidden_size}, but {target.path.name} has {target.n_embd}: "
            "this head was trained for another model")
    # a head without its own token_embd or lm_head runs on the target's: the graph's norm and matmul abort on a
    # width other than its own hidden size
    for own, what in ((head.own_token_embd, f"{keys.T_TOKEN_EMBD} (token embeddings)"),
                      (head.own_output, f"{keys.T_OUTPUT} (lm_head)")):
        if not own and head.n_embd != target.n_embd:
            raise Eagle3Error(
                f"{head.path.name}: head has hidden size {head.n_embd} and no {what} of its own, but "
                f"{target.path.name}'s are {target.n_embd} wide: this head was trained for another model")
    top = target.n_layer if target.arch in keys.FINAL_OUTPUT_TARGET_ARCHS else target.n_layer - 1  # the ids it serves
    for lid in head.target_layers:
        if lid < 0 or lid > target.n_layer:
            raise Eagle3Error(
                f"head extracts target layer {lid}, but {target.path.name} has {target.n_layer} layers "
                f"(ids 0..{top}): reconvert the head with --layer-ids")
        if lid == target.n_layer and target.arch not in keys.FINAL_OUTPUT_TARGET_ARCHS:
            raise Eagle3Error(
                f"head extracts layer id {lid} (the final output), which the pinned llama.cpp does not expose for "
                f"'{target.arch}' targets: reconvert the head with --layer-ids below {target.n_layer}")
    if head.n_vocab != target.n_vocab:
        raise Eagle3Error(
            f"head vocab ({head.n_vocab}) differs from the target's ({target.n_vocab}): the head belongs to another "
            "tokenizer")
    if head.draft_vocab is not None and not head.own_output:
        raise Eagle3Error(f"{head.path.name}: head has a d2t map but no lm_head (output.weight) of its own")
    if d2t is not None and d2t.size and (d2t.min() < 0 or d2t.max() >= target.n_vocab):
        raise Eagle3Error(f"{head.path.name}: d2t maps to token ids outside the target vocab (0..{target.n_vocab - 1})")


def read_pair(target_path: str | Path, head_path: str | Path) -> tuple[TargetInfo, HeadInfo]:
    """Read and check both headers; no C call."""
    tg = read_gguf(target_path)
    hg = read_gguf(head_path)
    if tg.arch == keys.ARCH_EAGLE3:
        raise Eagle3Error(f"{tg.path}: this is an EAGLE-3 head; pass it with --draft and the target with -m")
    target = TargetInfo.from_gguf(tg)
    head = HeadInfo.from_gguf(hg)
    check_pair(target, head, _read_d2t(hg.raw) if head.draft_vocab else None)
    return target, head


def _read_d2t(raw) -> np.ndarray:
    return raw.tensor_data(keys.T_D2T).view(np.int64).reshape(-1)  # [n_draft_vocab]


@dataclass
class Pair:
    """A loaded target and head, with their contexts (the head's borrows from the target's)."""

    target_info: TargetInfo
    head_info: HeadInfo
    target_model: Model
    target: Context
    head_model: Model
    head: Context

    def speculator(self) -> Speculator:
        """The speculative cycle on this pair: a Speculator with a head session of its own (closed with it)."""
        return Speculator(self.target, Eagle3Session(self.target, self.head))

    def close(self) -> None:
        for owner in (self.head, self.head_model, self.target, self.target_model):
            owner.close()

    def __enter__(self) -> "Pair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _head_split(target: TargetInfo, head: HeadInfo, config: PairConfig, n_remote: int) -> tuple[float, ...]:
    """rpc.head_split's layers per rpc-server (none on this machine's GPUs, listed after them: Model's split is
    zero past what it is given)."""
    if not config.rpc_servers:
        raise Eagle3Error(f"--tensor-split {rpc.HEAD_SPLIT} places the target's layers on rpc-servers: add --rpc")
    if n_remote != len(config.rpc_servers):  # devices of one server share its connection, so its reads queue
        raise Eagle3Error(f"--tensor-split {rpc.HEAD_SPLIT} needs one device per rpc-server ({len(config.rpc_servers)} "
                          f"servers offer {n_remote}): give proportions")
    if 0 <= config.n_gpu_layers <= target.n_layer:
        raise Eagle3Error(f"--tensor-split {rpc.HEAD_SPLIT} needs every layer offloaded: -ngl all "
                          f"(got -ngl {config.n_gpu_layers})")
    return tuple(map(float, rpc.head_split(target.n_layer, head.target_layers, len(config.rpc_servers))))


def load_pair(target_path: str | Path, head_path: str | Path, config: PairConfig = PairConfig(),
              target_model: Model | None = None, target_ctx: Context | None = None,
              infos: tuple[TargetInfo, HeadInfo] | None = None) -> Pair:
    """Check, then load both models and make the contexts. An existing target model/context
    (e.g. from llama_cpp.Llama) may be passed in to be shared instead of loaded again, and the pair's
    headers where the caller has read them already (`read_pair`)."""
    target_info, head_info = infos or read_pair(target_path, head_path)
    type_v = config.cache_type_v
    if type_v == "auto":
        type_v = default_type_v(config.n_gpu_layers, bool(config.rpc_servers))
    type_k, type_v = cache_type(config.cache_type_k), cache_type(type_v)
    if target_ctx is None:
        check_kv_memory(target_info, config.n_ctx, type_k, type_v, config.n_gpu_layers, bool(config.rpc_servers))
    threads = config.n_threads or default_threads()
    opened: list = []
    try:
        # the target's layers over the network where asked (the servers first, then this machine's GPUs, as
        # llama.cpp's default orders them), the head's on this machine in any case
        target_devices, remote = None, []
        if config.rpc_servers:
            remote = rpc.connect(config.rpc_servers, config.rpc_backend)
            target_devices = remote + rpc.local_devices()
        head_devices = rpc.local_devices() if rpc.in_use() else None
        if target_model is None:
            repack = target_info.repack_exact if config.repack is None else config.repack
            split = config.tensor_split
            if split == rpc.HEAD_SPLIT:
                split = _head_split(target_info, head_info, config, len(remote))
            target_model = Model(target_path, n_gpu_layers=config.n_gpu_layers, devices=target_devices, repack=repack,
                                 tensor_split=split)
            opened.append(target_model)
        if target_ctx is None:
            capture = capture_for(target_info, head_info.target_layers, config.n_batch)
            target_ctx = Context(target_model, n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=threads,
                                 type_k=type_k, type_v=type_v, flash_attn=flash_attn_type(config.flash_attn),
                                 n_seq_max=config.n_seq_max, capture=capture)
            opened.append(target_ctx)
        else:
            target_info.require_hook()
        head_ngl = config.n_gpu_layers if config.n_gpu_layers_draft is None else config.n_gpu_layers_draft
        head_model = Model(head_path, n_gpu_layers=head_ngl, devices=head_devices)
        opened.append(head_model)
        head_ctx = Context(head_model, n_ctx=config.draft_n_ctx or config.n_ctx, n_batch=config.n_batch,
                           n_threads=threads, ctx_other=target_ctx, n_seq_max=config.n_seq_max)
    except BaseException:
        for owner in reversed(opened):
            owner.close()
        raise
    return Pair(target_info, head_info, target_model, target_ctx, head_model, head_ctx)
