"""A drop-in `llama_cpp.Llama` that decodes through an EAGLE-3 head.

    from eagle3_gguf.llama import Eagle3Llama
    llm = Eagle3Llama(model_path="target.gguf", draft_model_path="head.gguf")   # was: Llama(model_path=...)

`Eagle3Llama` IS a `llama_cpp.Llama`: every public method (`create_completion`, `__call__`,
`create_chat_completion`, streaming, `stop`, `max_tokens`, `seed`, `logprobs` with `logits_all=True`,
`logit_bias`, grammars, logits processors, stopping criteria, the RAM/disk caches) is llama-cpp-python's
own code. Only `generate()`, the token generator they all consume, is replaced:

- the prompt is decoded in `n_batch` chunks, each chunk's hidden states are fed to the head;
- every cycle the head drafts up to `draft_max` tokens, the target decodes [id_last, d1..dK] in one batch
  with logits on every row, and Llama's own sampler chain samples row 0, 1, ... in order, one call per
  emitted token, while the sampled token equals the draft; the first disagreement ends the cycle.

So each emitted token is sampled by the very sampler chain plain decoding uses, from the logits of the
same context, once per token and in the same order: greedy and seeded sampling give the same text, and
stateful samplers (grammar, repeat penalties, mirostat, logits processors) see the same sequence of
calls, up to where the caller stops: a cycle samples its kept rows before handing out its first token, so a
caller that stops inside one (a stop string, a stream closed) has had up to draft_max more calls made. While row
i is sampled, `n_tokens`/`input_ids` describe exactly row i's context, as they do in plain decoding, so a logits
processor reading `input_ids` sees what it would see there.

State kept consistent with what Llama expects: `input_ids[:n_tokens]` is always what the KV cache
holds; when the caller stops consuming (stop string, max_tokens) the cache is cut back to exactly where
plain decoding would have left it, so the next call's prefix reuse is unchanged. The head remembers
which tokens it has processed and rewinds with the target, so prefix reuse keeps working for it too.

Exactness needs batch-invariant kernels: flash attention on and a bf16 V cache (the defaults here;
see EXACTNESS).

Rejection sampling (`spec_sampling="rejection"`, spec_sampling.py): at temperature != 0 the head draws
its drafts from its own distribution q and the rows are verified by rejection sampling, so more drafts
are kept and every token is still distributed as the sampler chain's; but the draws are numpy's, from
a stream seeded with Llama's seed, over the closed form of the chain (top-k → top-p → min-p →
temperature, llama.cpp's order, in float64): the same seed gives the same text run after run, not
plain Llama's text. A chain that is not a closed per-position distribution (a grammar, logits
processors, logit_bias, repetition penalties, mirostat, typical_p) falls back to exact match, and
`spec_stats.spec_sampling` says so. The default, "match", keeps plain Llama's text for every seed.

Fallback to plain decoding (Llama.generate itself), reported in `.spec_fallback`: `draft_max == 0`,
an empty prompt, and `generate(reset=False)` (continuing a raw stream, whose rows the head never saw).
`.spec_stats` (a SpecStats) describes the last call.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp import llama_cpp as C

from . import rpc
from .config import DraftConfig
from .context import Adapters, Context
from .decode import spec_sampling_label
from .errors import Eagle3Error
from .gguf_file import HeadInfo, TargetInfo
from .native import CACHE_TYPES, Model
from .pair import Pair, PairConfig, check_kv_memory, default_type_v, load_pair, read_pair
from .session import Eagle3Session
from .spec_sampling import RejectionSampler, Transform
from .speculator import Cycle, RunHooks, Speculator
from .stats import SpecStats

_LIBRARY = DraftConfig()  # the knobs' library defaults

# EXACTNESS: the verify batch computes each row as one-token decoding does, bit for bit, only where
# llama.cpp's kernels are batch-invariant; the exactness probe (exactness.py) measures which widths are at load,
# and the run keeps to them. On CPU batch-invariance takes flash attention (the non-flash path sums a row of a
# batch in another order) and a KV cache other than f16/f16 (there, a lone row with 512+ KV cells takes flash
# attention's split-KV path). Eagle3Llama therefore defaults to flash_attn=True and type_v=bf16 (ggml type 30):
# plain Llama(..., flash_attn=True, type_v=30) gives the same text as Eagle3Llama. With layers on a GPU it
# defaults to f16 instead (pair.default_type_v: bf16 buys no exactness there and costs a conversion), unless
# offload_kqv=False keeps the cache and attention on the CPU.
INEXACT_WARNING = ("no verify batch of 2 or more rows is computed bit for bit as one-token decoding on this set-up "
                   "(exactness probe: {found}{hint}): speculating anyway (exact='auto'), so rare near-ties may resolve "
                   "differently from plain Llama; exact='strict' keeps its output")


VOCAB_ONLY = "vocab_only=True loads no weights for the head to draft from: tokenize with a plain llama_cpp.Llama"
BUSY = ("this Eagle3Llama is generating in another thread: use one Eagle3Llama per thread, or a lock around "
        "its calls (llama_cpp.Llama is not thread-safe either)")
GRAMMAR_FAILS = "the grammar does not parse (llama.cpp's log says where; check its rules and its root)"
SUPERSEDED = ("this generation was superseded by a newer call on the same Eagle3Llama (from another thread, or "
              "after this stream was left unfinished): use one Eagle3Llama per thread")


class _Turn:
    """One generation's right to use an Eagle3Llama. The target's and the head's caches are one state, so
    a generation runs only while it holds the object's lock: from its start to each token it yields, and
    again from each resume. A newer generation supersedes an unfinished one (as a new call on a plain Llama
    does); the older one then raises SUPERSEDED instead of touching the newer one's state. Another thread
    arriving while a generation runs gets BUSY."""

    def __init__(self, llm: "Eagle3Llama"):
        self.llm = llm
        self.held = False
        self._take()
        llm._e3_generation += 1
        self.n = llm._e3_generation

    def _try_take(self) -> bool:
        self.held = self.llm._e3_running.acquire(blocking=False)
        return self.held

    def _take(self) -> None:
        if not self._try_take():
            raise Eagle3Error(BUSY)

    @property
    def current(self) -> bool:
        return self.llm._e3_generation == self.n

    def resume(self) -> None:
        self._take()
        if not self.current:
            self.release()
            raise Eagle3Error(SUPERSEDED)

    def resume_to_close(self) -> bool:
        """Take the lock to clean up after a caller who stopped; False (nothing to clean) if superseded."""
        return self._try_take() and self.current

    def release(self) -> None:
        if self.held:
            self.held = False
            self.llm._e3_running.release()


def _draft_config(draft_config: DraftConfig | None, **knobs) -> DraftConfig:
    """The drafting knobs given as one DraftConfig, or else one by one, checked."""
    if draft_config is not None and not isinstance(draft_config, DraftConfig):
        raise Eagle3Error(f"draft_config is a DraftConfig (eagle3_gguf.config), not a {type(draft_config).__name__}: "
                          "DraftConfig(draft_max=..., ...), or give the knobs as arguments")
    config = draft_config or DraftConfig(**knobs)
    _check_chains(config)
    return config


def _check_llama_kwargs(kwargs: dict[str, Any]) -> None:
    """The context settings llama.cpp crashes on (a segfault or an abort, also under plain Llama), refused first."""
    for name in ("type_k", "type_v"):
        value = kwargs.get(name)
        if value is not None and value not in CACHE_TYPES.values():
            kinds = ", ".join(f"{v} ({k})" for k, v in CACHE_TYPES.items())
            raise Eagle3Error(f"{name}={value} is no KV cache type llama.cpp takes (one of: {kinds})")
    if kwargs.get("n_batch", 1) < 1:
        raise Eagle3Error(f"n_batch must be at least 1 (got {kwargs['n_batch']})")
    if kwargs.get("n_ubatch", 0) < 0:  # 0: as n_batch (llama.cpp's reading)
        raise Eagle3Error(f"n_ubatch must be 0 (as n_batch) or more (got {kwargs['n_ubatch']})")
    if kwargs.get("n_ctx", 0) < 0:
        raise Eagle3Error(f"n_ctx must be 0 (the model's training context) or more (got {kwargs['n_ctx']})")


def _check_chains(config: DraftConfig) -> None:
    """A draft tree needs sequences of its own in the target's context; llama-cpp-python opens it with one."""
    if config.draft_topk > 1:
        raise Eagle3Error("Eagle3Llama drafts chains (llama-cpp-python opens its context with one sequence, a draft "
                          "tree needs several): set draft_topk to 1; `eagle3-gguf generate --draft-topk` drafts trees")


class Eagle3Llama(Llama):
    """`llama_cpp.Llama(model_path=..., **kwargs)` plus an EAGLE-3 head (`draft_model_path`)."""

    def __init__(self, model_path: str, draft_model_path: str | Path | None = None, *,
                 draft_max: int = _LIBRARY.draft_max, draft_p_min: float = _LIBRARY.draft_p_min,
                 draft_policy: str = _LIBRARY.draft_policy, spec_sampling: str = _LIBRARY.spec_sampling,
                 draft_temp_scale: float = _LIBRARY.draft_temp_scale, draft_lookup: bool = _LIBRARY.draft_lookup,
                 draft_lookup_max: int = _LIBRARY.draft_lookup_max, exact: str = _LIBRARY.exact,
                 draft_config: DraftConfig | None = None, n_gpu_layers_draft: int | None = None, rpc_servers: str | None = None,
                 rpc_backend: str | None = None, **kwargs: Any):
        """The drafting knobs are config.DraftConfig's (checked before anything loads), one by one or as one
        `draft_config`; `draft_config` holds them afterwards. n_gpu_layers_draft: the head's layers on the GPU
        (-1: all), beside llama-cpp-python's n_gpu_layers for the target; None: as the target's.
        rpc_servers: "host:port,..." (llama-cpp-python's former argument, llama.cpp's --rpc): the target's
        n_gpu_layers go to those rpc-servers, the head stays here; rpc_backend: the RPC client module where
        llama-cpp-python has none built in (eagle3_gguf.rpc)."""
        if draft_model_path is None:
            raise Eagle3Error("Eagle3Llama needs the EAGLE-3 head: Eagle3Llama(model_path=..., draft_model_path=HEAD.gguf)")
        if kwargs.get("draft_model") is not None:
            raise Eagle3Error("draft_model (prompt lookup) and an EAGLE-3 head cannot be combined: drop draft_model")
        config = _draft_config(draft_config, draft_max=draft_max, draft_p_min=draft_p_min, draft_policy=draft_policy,
                               spec_sampling=spec_sampling, draft_temp_scale=draft_temp_scale, draft_lookup=draft_lookup,
                               draft_lookup_max=draft_lookup_max, exact=exact)
        _check_llama_kwargs(kwargs)
        kwargs.setdefault("flash_attn", True)  # see EXACTNESS
        kwargs.setdefault("type_v", CACHE_TYPES[default_type_v(kwargs.get("n_gpu_layers", 0), bool(rpc_servers),
                                                               kwargs.get("offload_kqv", True))])
        self._e3_rpc = (rpc_servers, rpc_backend)
        infos = read_pair(model_path, draft_model_path)  # a wrong pair fails in one line before the target loads,
        infos[0].require_hook()  # as a target whose states only eagle3-gguf's own contexts capture
        type_k = kwargs.get("type_k")
        check_kv_memory(infos[0], kwargs.get("n_ctx", 512), CACHE_TYPES["f16"] if type_k is None else type_k,
                        kwargs["type_v"], kwargs.get("n_gpu_layers", 0), bool(rpc_servers),
                        kwargs.get("offload_kqv", True))
        if rpc_servers:  # registered before Llama loads the target, so that llama.cpp places it there
            rpc.connect(rpc.parse_servers(rpc_servers), rpc_backend)
        super().__init__(model_path=model_path, **kwargs)
        try:
            self._eagle3_setup(draft_model_path, config, n_gpu_layers_draft, infos)
        except BaseException:
            self.close()
            raise

    # -- setup / teardown ---------------------------------------------------------------------------
    def _fit_rows_to_context(self) -> None:
        """llama.cpp pads n_ctx (160 becomes 256) and Llama generates up to the padded size, but sizes
        input_ids (and scores with logits_all) by the n_ctx asked for. Plain decoding writes one row at a time
        and numpy drops a row past the end without a word; a cycle writes several and numpy refuses. Size
        them by the context's real n_ctx, so every row is kept."""
        n = self._n_ctx
        if len(self.input_ids) < n:
            ids = np.zeros(n, dtype=np.intc)  # [n_ctx]
            ids[:len(self.input_ids)] = self.input_ids
            self.input_ids = ids
        if self._logits_all and self.scores.shape[0] < n:
            scores = np.zeros((n, self._n_vocab), dtype=np.single)  # [n_ctx, n_vocab]
            scores[:self.scores.shape[0]] = self.scores
            self.scores = scores

    def _eagle3_setup(self, head_path: str | Path, config: DraftConfig, n_gpu_layers_draft: int | None,
                      infos: tuple[TargetInfo, HeadInfo] | None = None) -> None:
        if self.draft_model is not None:
            raise Eagle3Error("this Llama already has a draft_model (prompt lookup); create it without one")
        if self.context_params.embeddings:
            raise Eagle3Error("an EAGLE-3 head needs a generation context: create the Llama with embedding=False")
        if self.model_params.vocab_only:  # llama.cpp aborts building the head's graph over a target with no weights
            raise Eagle3Error(VOCAB_ONLY)
        if self._is_recurrent or self._is_hybrid:
            raise Eagle3Error(f"{Path(self.model_path).name}: recurrent/hybrid targets cannot roll back rejected drafts")
        cp = self.context_params
        self._fit_rows_to_context()
        self._draft_config = config
        self.spec_stats = SpecStats()
        self.spec_fallback: str | None = None
        self._e3_head_path = Path(head_path)
        self._e3_head_ngl = n_gpu_layers_draft
        self._e3_budget: int | None = None  # tokens the running completion still wants (a hint)
        self._e3_running = threading.Lock()  # held by the generation that is running (see _Turn)
        self._e3_generation = 0  # generations started so far; the latest is the current one
        self._e3_unfinished = False  # a generation started and has not ended
        self._e3_runner: Callable | None = None  # computes plain decoding's graphs (run_graphs_with)
        n_gpu_layers = self.model_params.n_gpu_layers
        model = Model(self.model_path, n_gpu_layers=n_gpu_layers, borrowed=self._model.model)
        # the Llama set its LoRA adapter on this context: the exactness probe's own context sets it too
        adapters = Adapters((self._lora_adapter,), (self.lora_path,), (self.lora_scale,)) \
            if self._lora_adapter is not None else None
        target = Context(model, n_ctx=self._n_ctx, n_batch=self.n_batch, n_threads=cp.n_threads, type_k=cp.type_k,
                         type_v=cp.type_v, flash_attn=cp.flash_attn_type, borrowed=self._ctx.ctx, adapters=adapters)
        pair_config = PairConfig(n_ctx=self._n_ctx, n_batch=self.n_batch, n_threads=cp.n_threads,
                                 n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft)
        self._e3_pair: Pair | None = load_pair(self.model_path, head_path, pair_config, target_model=model,
                                               target_ctx=target, infos=infos)
        self._e3_spec: Speculator | None = None
        try:
            self._e3_spec = self._e3_pair.speculator()
        except BaseException:
            self._eagle3_close()
            raise
        self._e3_head_tokens: list[int] = []  # target rows the head has processed, in order
        self._stack.callback(self._eagle3_close)  # runs before Llama frees its context and model
        self._calibrate_if_needed()

    @property
    def _e3_session(self) -> Eagle3Session | None:
        """The head's session: the one the speculative cycle drafts with."""
        spec = getattr(self, "_e3_spec", None)
        return spec.session if spec is not None else None

    @_e3_session.setter
    def _e3_session(self, session: Eagle3Session) -> None:
        self._e3_spec.session = session

    def _eagle3_close(self) -> None:
        for owner in (self._e3_spec, getattr(self, "_e3_pair", None)):  # the speculator closes its session
            if owner is not None:
                owner.close()
        self._e3_spec = self._e3_pair = None

    def close(self) -> None:
        if getattr(self, "_stack", None) is not None:  # a constructor that failed early made no stack
            super().close()

    def _require_open(self) -> None:
        """One error line once this Eagle3Llama (or the Llama it is attached to: they close together) is closed:
        llama-cpp-python would hand llama.cpp the freed model or context (a segfault)."""
        if self._e3_session is None or _closed(self):
            raise Eagle3Error("this Eagle3Llama is closed")

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Llama.tokenize (every completion's first step), refused once closed."""
        self._require_open()
        return super().tokenize(text, add_bos, special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        """Llama.detokenize, a token id outside the vocabulary refused: llama.cpp aborts the process on one (a served
        /extras/detokenize request killed the server)."""
        self._require_open()
        ids = np.asarray(tokens)  # (prev_tokens only offset the text: llama.cpp never reads them)
        if ids.size and not 0 <= ids.min() <= ids.max() < self._n_vocab:
            bad = next(int(t) for t in ids.ravel() if not 0 <= t < self._n_vocab)
            raise Eagle3Error(f"token id {bad} is outside the vocabulary (0 to {self._n_vocab - 1})")
        return super().detokenize(tokens, prev_tokens, special)

    # Llama's calls on its context or model, which close() frees: refused in one line, not a segfault (these check
    # the Llama alone: its constructor makes some before the head is set up)
    def n_ctx(self) -> int:
        _require_live(self)
        return super().n_ctx()

    def n_embd(self) -> int:
        _require_live(self)
        return super().n_embd()

    def pooling_type(self) -> str:
        _require_live(self)
        return super().pooling_type()

    def embed(self, *args, **kwargs):
        _require_live(self)
        return super().embed(*args, **kwargs)

    def save_state(self) -> llama_cpp.LlamaState:
        _require_live(self)
        return super().save_state()

    def load_state(self, state: llama_cpp.LlamaState) -> None:
        _require_live(self)
        super().load_state(state)

    def __getstate__(self):
        return {**super().__getstate__(), "draft_model_path": str(self._e3_head_path), "draft_config": self.draft_config,
                "n_gpu_layers_draft": self._e3_head_ngl, "rpc_servers": self._e3_rpc[0], "rpc_backend": self._e3_rpc[1]}

    @property
    def draft_config(self) -> DraftConfig:
        """The drafting knobs of the next generation (config.DraftConfig)."""
        return self._draft_config

    @draft_config.setter
    def draft_config(self, config: DraftConfig) -> None:
        if not isinstance(config, DraftConfig):
            raise Eagle3Error(f"draft_config must be an eagle3_gguf.config.DraftConfig (got {type(config).__name__})")
        _check_chains(config)
        self._draft_config = config
        self._calibrate_if_needed()

    def _calibrate_if_needed(self) -> None:
        """The exactness probe and the adaptive policy's cost curve (cached, or measured in a second or two):
        measuring clears the caches, so the state that says what they hold is cleared with them. Warns once where
        the run speculates past the exact widths (exact='auto' and none above 1 is exact)."""
        config = self.draft_config
        if config.draft_max > 0 and self._e3_spec.needs_calibration(config):
            self.n_tokens = 0
            self._e3_head_tokens.clear()
            report = self._e3_spec.prepare(config)
            if report.mode == "auto" and not report.kept:
                cp = self.context_params
                hint = ("; flash_attn=False" if cp.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED else
                        f"; KV cache type_k={cp.type_k}, type_v={cp.type_v}" if cp.type_k == cp.type_v else "")
                hint += f"; width {report.exact + 1} parts first at {report.parts_at}" if report.parts_at else ""
                warnings.warn(INEXACT_WARNING.format(found=report.rows()[0][1], hint=hint), RuntimeWarning,
                              stacklevel=4)

    # -- completion budget hint -----------------------------------------------------------------------
    def _create_completion(self, *args, **kwargs):
        """Llama's own; only notes max_tokens so that the last cycles draft no further than needed."""
        max_tokens = kwargs.get("max_tokens", 16)
        self._e3_budget = max_tokens if max_tokens is not None and max_tokens > 0 else None
        try:
            yield from super()._create_completion(*args, **kwargs)
        finally:
            self._e3_budget = None

    # -- plain decoding's graphs ------------------------------------------------------------------------
    def run_graphs_with(self, runner: Callable | None) -> None:
        """Compute llama-cpp-python's own decodes (plain decoding, where a call falls back) by `runner(fn, *args)`
        (serve: `slots.Engine.call`, the thread that computes every graph); None: in the calling thread."""
        self._e3_runner = runner

    def eval(self, tokens: Sequence[int]) -> None:
        """Llama's own, through the runner set by run_graphs_with; refused once closed."""
        self._require_open()
        if self._e3_runner is None:
            return super().eval(tokens)
        return self._e3_runner(super().eval, tokens)

    # -- the token generator ------------------------------------------------------------------------------
    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None):
        """Same contract as Llama.generate; speculative unless a fallback applies (see module doc)."""
        sampling = dict(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                        repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                        presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                        mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                        logits_processor=logits_processor, grammar=grammar)
        tokens = list(tokens)
        self._require_open()
        self._fit_rows_to_context()  # again: Llama.load_state (a cache's hit too) puts back rows of the n_ctx asked for
        if grammar is not None and not grammar_parses(self, grammar._grammar, grammar._root):
            raise Eagle3Error(GRAMMAR_FAILS)
        turn = _Turn(self)
        try:
            if self._e3_unfinished:  # an earlier generation was left suspended
                self._requires_eval = True
            self._e3_unfinished = True
            self.spec_fallback = self._fallback_reason(tokens, reset)
            if self.spec_fallback is not None:
                self.spec_stats = SpecStats(n_prompt=len(tokens), target_on=str(self._e3_spec.target.model.placement),
                                            stop_reason=f"plain decoding: {self.spec_fallback}")
                inner = self._plain_generate(tokens, reset, stopping_criteria, sampling)
            else:
                inner = self._speculate(tokens, sampling, stopping_criteria, turn)
            sent = None
            while True:
                try:
                    tok = inner.send(sent)
                except StopIteration as done:
                    self._e3_unfinished = False
                    return done.value
                turn.release()  # while the caller holds the token
                try:
                    sent = yield tok
                except GeneratorExit:
                    if turn.resume_to_close():
                        inner.close()
                        self._e3_unfinished = False
                    raise
                turn.resume()
        finally:
            turn.release()

    def _plain_generate(self, tokens: list[int], reset: bool, stopping_criteria, sampling: dict) -> Iterator[int]:
        """Llama.generate itself: the fallback's decoding."""
        return super().generate(tokens, reset=reset, stopping_criteria=stopping_criteria, **sampling)

    def _fallback_reason(self, tokens: list[int], reset: bool) -> str | None:
        if self.draft_config.draft_max == 0:
            return "draft_max is 0"
        if not tokens:
            return "empty prompt"
        if not reset:
            return "generate(reset=False) continues rows the head has not seen"
        return None

    @staticmethod
    def _not_closed_form(sampling: dict) -> str:
        """The parts of a sampler chain that are not a closed per-position distribution ('' if none)."""
        parts = []
        if sampling["grammar"] is not None:
            parts.append("a grammar")
        if sampling["logits_processor"]:
            parts.append("logits processors (logit_bias is one)")
        if (sampling["repeat_penalty"] != 1.0 or sampling["frequency_penalty"] != 0.0
                or sampling["presence_penalty"] != 0.0):
            parts.append("repetition penalties")
        if sampling["mirostat_mode"] != 0:
            parts.append("mirostat")
        if sampling["typical_p"] < 1.0:
            parts.append("typical_p")
        return ", ".join(parts)

    def _rejection_sampler(self, sampling: dict, not_closed: str) -> RejectionSampler | None:
        """Rejection sampling for this call, or None: greedy, the "match" rule, or a chain that is not
        a closed per-position distribution (`not_closed` names its parts)."""
        temp = sampling["temp"]
        if temp == 0.0 or self.draft_config.spec_sampling != "rejection" or not_closed:
            return None
        # llama-cpp-python's chain: top-k, typical, top-p, min-p, temperature, dist; temp < 0: dist alone
        transform = (Transform(temp, sampling["top_k"], sampling["top_p"], sampling["min_p"]) if temp > 0.0
                     else Transform(1.0, 0, 1.0, 0.0))
        return RejectionSampler(transform, self.draft_config.draft_temp_scale, np.random.default_rng(self._seed))

    def _speculate(self, prompt: list[int], sampling: dict, stopping_criteria, turn: _Turn) -> Iterator[int]:
        """The one run (Speculator.run), its tokens handed out one at a time as plain decoding does: a stop
        check or a caller who stops reading inside a cycle cuts the caches back to that token."""
        spec, config = self._e3_spec, self.draft_config
        not_closed = self._not_closed_form(sampling) if config.spec_sampling == "rejection" else ""
        rejection = self._rejection_sampler(sampling, not_closed)
        label = spec_sampling_label(sampling["temp"], config.spec_sampling, config.draft_temp_scale, not_closed)
        self._mirostat_mu = ctypes.c_float(2.0 * sampling["mirostat_tau"])
        self._sampler = self._init_sampler(**sampling)
        run = spec.run(prompt, _DropInHooks(self, rejection), config, rejection, label,
                       keep=self._reusable_prefix(prompt))
        st = self.spec_stats = run.stats
        last = -1
        try:
            for cyc in run:
                pos = cyc.pos
                for j, tok in enumerate(cyc.out):
                    self.n_tokens = pos + j + 1  # plain decoding's state when it emits out[j]
                    if self._stop_requested(stopping_criteria, pos + j + 1):
                        self._end_inside(cyc, j, emitted=j)
                        st.stop_reason = "stopping_criteria"
                        return
                    last = tok
                    try:
                        sent = yield tok
                    except GeneratorExit:  # the caller is done (stop string, max_tokens, closed stream)
                        if turn.current:  # else a newer generation owns the caches now
                            self._end_inside(cyc, j, emitted=j + 1)
                        raise
                    self._check_sent(sent)
                self.n_tokens = pos + cyc.n_acc + 1
        except GeneratorExit:
            st.stop_reason = "eos" if spec.is_end(last) else "caller stopped"
            raise
        except BaseException:
            self._e3_head_tokens.clear()  # the head's state is unknown: the next call starts it afresh
            raise
        finally:
            self._requires_eval = True  # the last decode's last row may not be row n_tokens - 1
            run.close()

    # -- helpers -------------------------------------------------------------------------------------------
    def _end_inside(self, cyc: Cycle, j: int, emitted: int) -> None:
        """The generation ends at cyc.out[j], `emitted` of the cycle's tokens handed out: the caches keep
        the rows up to it, and the statistics count the cycle as accepting j drafts."""
        self._cut(cyc.pos + j + 1)
        st = self.spec_stats
        st.cut_cycle(cyc.n_acc, j)
        st.n_generated -= len(cyc.out) - emitted

    def _check_sent(self, sent) -> None:
        if sent is not None:
            raise Eagle3Error("Eagle3Llama.generate() drafts its own tokens: send() of draft tokens is not supported")

    def _cut(self, n: int) -> None:
        """Keep the first n rows of the target's cache."""
        self._e3_spec.seq_rm(n)
        self.n_tokens = n

    def _stop_requested(self, stopping_criteria, n_ctx_rows: int) -> bool:
        """Llama.generate's check, with the arguments it passes: the context before the new token, and
        `_scores[sample_idx - n_tokens]` (which is row 0 there)."""
        if stopping_criteria is None:
            return False
        return bool(stopping_criteria(self.input_ids[:n_ctx_rows], self.scores[0, :]))

    def _reusable_prefix(self, prompt: list[int]) -> int:
        """The longest prefix that both the target's cache and the head's state hold for this prompt,
        always leaving the last prompt token to decode again (for fresh logits and features).

        The head stores at position p the pair (token p+1, features of row p), so the pairs up to T-1 are
        valid for the prompt when the head processed prompt[:T+1]; they stay, and the head resumes at T."""
        n_target = self.longest_token_prefix(self.input_ids[:self.n_tokens].tolist(), prompt)
        n_head = self.longest_token_prefix(self._e3_head_tokens, prompt)
        return max(min(n_target, n_head - 1, len(prompt) - 1), 0)


def _closed(llm: Llama) -> bool:
    """Whether llama-cpp-python has freed the Llama's context (close(); its calls would then segfault)."""
    return getattr(getattr(llm, "_ctx", None), "ctx", None) is None


def _require_live(llm: Llama) -> None:
    if _closed(llm):
        raise Eagle3Error("this Eagle3Llama is closed")


def grammar_parses(llm: Llama, text: str, root: str = "root") -> bool:
    """Whether llama.cpp's grammar parser takes the GBNF `text` for this Llama's vocabulary. llama-cpp-python adds the
    sampler it makes to its chain unchecked, and the NULL one a grammar that does not parse gives crashed the process
    at the first token (a served request killed the server)."""
    # LLAMA_API struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab,
    #                                                             const char * grammar_str, const char * grammar_root);
    sampler = C.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), root.encode("utf-8"))
    if not sampler:
        return False
    C.llama_sampler_free(sampler)
    return True


class _DropInHooks(RunHooks):
    """The drop-in's side of the one run: llama-cpp-python's sampler chain picks each row (or, at T > 0 with
    rejection, the run's rule does), with input_ids / n_tokens describing that row's context as plain decoding
    has them; the kept rows are mirrored into input_ids (and scores, with logits_all) and into the record of
    what the head has processed."""

    def __init__(self, llm: Eagle3Llama, rejection: RejectionSampler | None):
        self.llm = llm
        self.spec = llm._e3_spec
        self.rejection = rejection
        self.prefill_logits = "all" if llm._logits_all else "last"

    def first_token(self, row: int) -> int:
        llm, rejection = self.llm, self.rejection
        if rejection is None:
            return llm._sampler.sample(llm._ctx, self.spec.batch_row(row))
        return rejection.target(self.spec.logits_ith(row)).sample(rejection.rng.random())

    def pick(self, rows: list[int], pos: int, i: int) -> int:
        llm = self.llm
        if i == 0:
            llm.input_ids[pos:pos + len(rows)] = rows
        llm.n_tokens = pos + i + 1
        return llm._sampler.sample(llm._ctx, self.spec.batch_row(i))

    def budget(self, pos: int, st: SpecStats) -> int:
        """Never ends the run (the caller stops reading); drafts only what fits and what the completion
        still wants (max_tokens, a hint)."""
        k = self.llm._n_ctx - pos - 1
        want = self.llm._e3_budget
        return k if want is None else min(k, want - st.n_generated - 1)

    def on_rewind(self, pos0: int) -> None:
        self.llm.n_tokens = pos0
        del self.llm._e3_head_tokens[pos0:]

    def on_prefill(self, chunk: list[int], pos0: int) -> None:
        llm = self.llm
        llm.input_ids[pos0:pos0 + len(chunk)] = chunk
        if llm._logits_all:
            llm.scores[pos0:pos0 + len(chunk), :] = self.spec.target.logits(len(chunk))
        llm.n_tokens = pos0 + len(chunk)
        llm._e3_head_tokens[pos0:] = chunk

    def on_cycle(self, cyc: Cycle) -> None:
        llm, pos, kept = self.llm, cyc.pos, cyc.n_acc + 1
        if self.rejection is not None:  # Llama's chain sampled no row: the kept rows, as plain decoding has them
            llm.input_ids[pos:pos + kept] = cyc.rows[:kept]
        if llm._logits_all:
            llm.scores[pos:pos + kept, :] = self.spec.target.logits(len(cyc.rows))[:kept]
        llm._e3_head_tokens[pos:] = cyc.rows[:kept]


class _AttachedLlama(Eagle3Llama):
    """An Eagle3Llama over a Llama someone else built (`attach_eagle3`). llama-cpp-python's state (model,
    context, settings, caches, input_ids, n_tokens) stays that Llama's, read and written through it; only the
    head's state (`_e3_*`, the drafting config, the statistics) is this object's. So the two are one model and
    one KV cache: either may generate, the other's next call reuses what the cache really holds, and closing
    either closes both (the head's contexts first)."""

    _OWN = frozenset({"_draft_config", "spec_stats", "spec_fallback"})

    def __init__(self, llm: Llama, head_path: str | Path, config: DraftConfig, n_gpu_layers_draft: int | None):
        object.__setattr__(self, "_e3_llama", llm)
        self._e3_rpc = (None, None)  # the Llama is loaded where its builder put it; the head stays here
        self._eagle3_setup(head_path, config, n_gpu_layers_draft)

    def __getattr__(self, name: str):  # only for names this object does not hold: the Llama's
        llm = self.__dict__.get("_e3_llama")
        if llm is None:
            raise AttributeError(name)
        return getattr(llm, name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_e3_") or name in self._OWN or isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        else:
            setattr(self._e3_llama, name, value)

    def __del__(self) -> None:  # the Llama is its builder's to close (and closes the head with it)
        pass

    def __reduce__(self):
        return _unpickle, (self.__getstate__(),)


def _unpickle(state: dict) -> Eagle3Llama:
    """An attached Eagle3Llama comes back from a pickle as an Eagle3Llama of the same files and settings."""
    return Eagle3Llama(**state)


def attach_eagle3(llm: Llama, head_path: str | Path, *, draft_max: int = _LIBRARY.draft_max,
                  draft_p_min: float = _LIBRARY.draft_p_min, draft_policy: str = _LIBRARY.draft_policy,
                  spec_sampling: str = _LIBRARY.spec_sampling,
                  draft_temp_scale: float = _LIBRARY.draft_temp_scale,
                  draft_lookup: bool = _LIBRARY.draft_lookup,
                  draft_lookup_max: int = _LIBRARY.draft_lookup_max, exact: str = _LIBRARY.exact,
                  draft_config: DraftConfig | None = None, n_gpu_layers_draft: int | None = None) -> Eagle3Llama:
    """An Eagle3Llama over an existing `llama_cpp.Llama`, sharing its model, context and settings (nothing is
    loaded again): `llm = attach_eagle3(llm, "head.gguf")`. The Llama passed in stays usable and plain; both
    are one KV cache (see _AttachedLlama). A subclass of Llama keeps its methods: the result is an instance
    of it too. `draft_config`: the drafting knobs as one DraftConfig (serve's), instead of one by one.
    n_gpu_layers_draft: the head's layers on the GPU (-1: all); None: as the Llama's n_gpu_layers."""
    if isinstance(llm, Eagle3Llama):
        raise Eagle3Error("this Llama already has an EAGLE-3 head")
    if not isinstance(llm, Llama):
        raise Eagle3Error(f"attach_eagle3 needs a llama_cpp.Llama, not {type(llm).__name__}")
    if llm in _ATTACHED:
        raise Eagle3Error("this Llama already has an EAGLE-3 head: use the Eagle3Llama attach_eagle3 returned")
    if _closed(llm):
        raise Eagle3Error("this Llama is closed: attach the head to an open one")
    config = _draft_config(draft_config, draft_max=draft_max, draft_p_min=draft_p_min, draft_policy=draft_policy,
                           spec_sampling=spec_sampling, draft_temp_scale=draft_temp_scale, draft_lookup=draft_lookup,
                           draft_lookup_max=draft_lookup_max, exact=exact)
    cls = type(llm)
    attached_cls = _AttachedLlama if cls is Llama else type(f"Eagle3{cls.__name__}", (_AttachedLlama, cls), {})
    attached = attached_cls(llm, head_path, config, n_gpu_layers_draft)
    _ATTACHED.add(llm)
    return attached


_ATTACHED: "weakref.WeakSet[Llama]" = weakref.WeakSet()  # Llamas with a head attached: one each
