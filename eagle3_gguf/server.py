"""llama-cpp-python's own OpenAI-compatible server (`llama_cpp.server`, its `[server]` extra), serving a
target with an EAGLE-3 head attached; `eagle3-gguf serve` is its command.

The app is llama-cpp-python's `create_app`; only its model proxy differs: every model it loads gets the
head through `attach_eagle3`. Like llama-cpp-python's server, a request naming a model the server does
not serve is answered by its model; `strict_model` answers it 404 instead. A request check in front
answers malformed JSON and schema errors with 400 (llama-cpp-python answers them 500). max_tokens past
the context is llama-cpp-python's rule: clamped, the answer stops with "length".

Concurrent requests queue (first come, first served) instead of interrupting one another: llama-cpp-python's
server, by default (`interrupt_requests`), ends a running stream with an early `[DONE]` as soon as another
request arrives, so that client silently gets a short or empty answer; `interrupt_requests=True` restores
that. A stream whose client disconnects stops at its next token, and its generator is closed while the
request still holds the model, so the model is free for the next request and nothing of that stream
runs later (an abandoned generator closed by the garbage collector would cut the KV cache under another
request). Queueing is logged on the `eagle3_gguf.server` logger. With `parallel` N > 1, up to N requests run at
once, each on a slot of a `slots.SlotPool` (its own KV sequence, n_ctx / N of the context), their target decodes
sharing one batch; the others queue as above. llama-cpp-python's server keeps its
model, locks and settings in module globals, so one process serves one app; `build_app` installs its
request gate and stream publisher into `llama_cpp.server.app` for good (`create_app_with`, the one adapter).

Speculation statistics (what `llm.spec_stats` says of a request, summed up by `speculation_summary`): a
non-streamed completion's `usage` object carries them as `usage.speculation` (OpenAI clients keep unknown
usage fields: `response.usage.speculation` in openai-python), and `GET /v1/eagle3/stats` answers the last
request's, streamed or not, with totals since the server started.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hmac
import importlib
import itertools
import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from . import keys, rpc
from .config import COMMAND_LINE, DraftConfig
from .errors import Eagle3Error
from .request_errors import explain

SERVER_EXTRA_HINT = "pip install 'eagle3-gguf[server]'"
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServeConfig:
    model: Path
    draft: Path
    drafting: DraftConfig = COMMAND_LINE  # as `generate`: rejection sampling at temperature > 0
    host: str = "127.0.0.1"
    port: int = 8000
    n_ctx: int = 4096
    n_threads: int | None = None
    alias: str | None = None  # the model name clients send; default: the target's file name without .gguf
    strict_model: bool = False  # 404 for other model names (llama-cpp-python answers them with its model)
    interrupt_requests: bool = False  # llama-cpp-python's default (True) ends a running stream for a new request
    parallel: int = 1  # requests served at once (slots.SlotPool), n_ctx split among them; 1: one at a time
    n_gpu_layers: int = 0  # the target's layers on the GPU (< 0: all), llama-cpp-python's n_gpu_layers
    n_gpu_layers_draft: int | None = None  # the head's; None: as the target's
    cache_type_k: str = "f16"  # the target's KV cache (native.CACHE_TYPES), llama.cpp's -ctk
    cache_type_v: str = "auto"  # -ctv; auto: pair.default_type_v (bf16 on a CPU, for exactness)
    api_key: str | None = None  # requests must send it (Authorization: Bearer KEY); None: none asked
    rpc_servers: tuple[str, ...] = ()  # rpc-server hosts for the target's offloaded layers (eagle3_gguf.rpc)
    rpc_backend: str | None = None  # the RPC client module, where llama-cpp-python has none built in
    # With rpc_servers: on_stall(seconds) is called once, from a watching thread, when one graph call has run
    # for more than rpc_timeout seconds (an rpc-server that stopped answering: llama.cpp waits forever)
    rpc_timeout: float = 60.0
    on_stall: Callable[[float], None] | None = None

    @property
    def loopback(self) -> bool:
        """Whether --host listens on this machine only."""
        import ipaddress

        try:
            return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @property
    def model_alias(self) -> str:
        return self.alias or self.model.name.removesuffix(".gguf")


def require_server_extra() -> None:
    """One clear error when llama-cpp-python's server dependencies are missing."""
    missing = []
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise Eagle3Error(f"the server needs {', '.join(missing)}: {SERVER_EXTRA_HINT}")


def build_app(config: ServeConfig):
    """llama-cpp-python's FastAPI app, serving config.model with the head config.draft attached."""
    require_server_extra()
    for path, what in ((config.model, "target (-m)"), (config.draft, "head (--draft)")):
        if not Path(path).is_file():
            raise Eagle3Error(f"{path}: no such file for the {what}")
    from fastapi import Depends, HTTPException
    from llama_cpp.server import app as server_app
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from starlette.middleware import Middleware

    from .llama import attach_eagle3
    from .native import CACHE_TYPES, cache_type
    from .pair import check_kv_memory, default_type_v, read_pair

    target, _ = read_pair(config.model, config.draft)  # a mismatched pair fails here with one line, before loading
    if config.rpc_servers:  # registered before the target loads, so that llama.cpp places its layers there
        rpc.connect(config.rpc_servers, config.rpc_backend)

    def load(settings):
        try:
            llm = LlamaProxy.load_llama_from_model_settings(settings)
        except ValueError as e:  # llama-cpp-python's "Failed to create llama_context" and the like
            raise Eagle3Error(f"{config.model}: {e} (n_ctx={settings.n_ctx}, KV cache {config.cache_type_k}/"
                              f"{config.cache_type_v}; -v shows llama.cpp's reason)") from None
        try:
            return attach_eagle3(llm, config.draft, draft_config=config.drafting,
                                 n_gpu_layers_draft=config.n_gpu_layers_draft)
        except BaseException:
            llm.close()
            raise

    class Eagle3LlamaProxy(LlamaProxy):
        def load_llama_from_model_settings(self, settings):
            from .slots import Engine, SlotPool

            SLOTS.close()
            engine = Engine()  # the model is built, and every graph computed, on the engine's thread
            if config.rpc_servers and config.on_stall is not None:
                engine.watch(config.rpc_timeout, config.on_stall)
            try:
                llm = engine.adopt_llama(engine.call(load, settings))
                try:
                    if config.parallel > 1:
                        SLOTS.pool = SlotPool(llm, config.parallel, engine)
                except BaseException:
                    engine.call(llm.close)
                    raise
            except BaseException:
                engine.close()
                raise
            SLOTS.engine, SLOTS.llm = engine, llm
            return llm

        def __call__(self, model: Optional[str] = None):
            if model is not None and config.strict_model and model not in self._model_settings_dict:
                raise HTTPException(status_code=404, detail={
                    "message": f"The model `{model}` does not exist; this server serves `{config.model_alias}`",
                    "type": "invalid_request_error", "param": "model", "code": "model_not_found"})
            return super().__call__(model)

    extra = {} if config.n_threads is None else {"n_threads": config.n_threads, "n_threads_batch": config.n_threads}
    # parallel: every slot gets a context as large as the Eagle3Llama's own (-c / N, padded by llama.cpp as a
    # lone Llama's is), which only calibrates; slots keep no logits per row (no logprobs)
    n_ctx = config.n_ctx // config.parallel
    if config.parallel > 1:
        extra["logits_all"] = False
    type_k = cache_type(config.cache_type_k)
    type_v = CACHE_TYPES[default_type_v(config.n_gpu_layers, bool(config.rpc_servers))] \
        if config.cache_type_v == "auto" else cache_type(config.cache_type_v)  # EXACTNESS (llama.py)
    check_kv_memory(target, config.n_ctx, type_k, type_v, config.n_gpu_layers, bool(config.rpc_servers))
    model_settings = ModelSettings(model=str(config.model), model_alias=config.model_alias, n_ctx=n_ctx,
                                   n_gpu_layers=config.n_gpu_layers, flash_attn=True, type_k=type_k, type_v=type_v,
                                   verbose=False, **extra)
    server_settings = ServerSettings(host=config.host, port=config.port, interrupt_requests=config.interrupt_requests,
                                     api_key=config.api_key)
    app = create_app_with(server_app, Eagle3LlamaProxy, server_settings, model_settings)
    no_bos = any(kv.key == keys.KEY_ADD_BOS and kv.value is False for kv in target.tokenizer)
    app.get("/v1/eagle3/stats", dependencies=[Depends(server_app.authenticate)])(speculation_stats)
    # inside llama-cpp-python's CORS and request-id middleware (app.add_middleware would wrap them around it): our
    # 400s and 401s carry their headers, so a browser on another origin can read them
    if config.api_key is not None:  # a request without the key reaches nothing of ours
        app.user_middleware.append(Middleware(ApiKeyCheck, key=config.api_key, open_paths=open_paths(app)))
    app.user_middleware.append(Middleware(SpeculationReport))  # (the first listed runs outermost)
    app.user_middleware.append(Middleware(RequestCheck, parallel=config.parallel, empty_prompt_fails=no_bos,
                                          grammar_parses=served_grammar_parses))
    return app


def served_grammar_parses(text: str) -> bool:
    """Whether the served target's grammar parser takes `text` (True while no model is loaded: its route says so)."""
    from .llama import grammar_parses

    llm = SLOTS.llm
    return llm is None or grammar_parses(llm, text)


def create_app_with(server_app, proxy_class, server_settings, model_settings):
    """llama-cpp-python's `create_app` with our model proxy, request gate and stream publisher: the adapter
    for the three places its server offers no hook. `create_app` builds its proxy from the module name
    `LlamaProxy` (swapped for the call only), and the completion routes look `get_llama_proxy` and
    `get_event_publisher` up in their module at request time (replaced for good: one process serves one app).
    tests/test_serve.py::test_llama_cpp_server_adapter fails if llama-cpp-python stops looking them up there."""
    plain_proxy = server_app.LlamaProxy
    server_app.LlamaProxy = proxy_class
    try:
        app = server_app.create_app(server_settings=server_settings, model_settings=[model_settings])
    finally:
        server_app.LlamaProxy = plain_proxy
    server_app.get_llama_proxy = queued_llama_proxy
    server_app.get_event_publisher = event_publisher
    from sse_starlette.sse import AppStatus

    # sse-starlette cuts every stream the moment uvicorn starts shutting down; a stream then ends, as a plain
    # answer does, once its generation ends (uvicorn waits for it), so SIGTERM loses no streamed token either
    AppStatus.disable_automatic_graceful_drain()
    return app


# ------------------------------------------------------------------------------------------------
# The model gate: one request at a time, first come first served, queueing logged
# ------------------------------------------------------------------------------------------------


@dataclass
class QueueState:
    """Requests that want the model: waiting for it, or holding it (at most one)."""

    waiting: int = 0
    running: int = 0
    served: int = 0


QUEUE = QueueState()
_request_ids = itertools.count(1)


async def queued_llama_proxy():
    """llama-cpp-python's `get_llama_proxy` with the queue counted and logged: the model (one request at a
    time, `_take_model`), or with slots (`parallel` > 1) a free slot (`_take_slot`), first come first served."""
    from llama_cpp.server import app as server_app

    pool = SLOTS.pool
    places = len(pool.slots) if pool is not None else 1
    rid = next(_request_ids)
    ahead = QUEUE.waiting + QUEUE.running - places + 1
    if ahead > 0:
        log.info("request %d queued: %d ahead (%d running, %d waiting)", rid, ahead, QUEUE.running, QUEUE.waiting)
    QUEUE.waiting += 1
    t0 = time.monotonic()
    try:
        proxy, release = await (_take_slot(server_app, pool) if pool is not None else _take_model(server_app))
    finally:
        QUEUE.waiting -= 1
    QUEUE.running += 1
    if ahead > 0:
        log.info("request %d started after %.2f s in the queue", rid, time.monotonic() - t0)
    before = _spec_stats(proxy)
    try:
        yield proxy
    finally:
        QUEUE.running -= 1
        QUEUE.served += 1
        try:
            record_speculation(proxy, before)
            trim_heap()
        finally:
            release()


async def _take_model(server_app):
    """The model, through llama-cpp-python's two locks (so its other routes share the gate). The outer one
    lets a running stream see that another request waits (for `interrupt_requests`); both are FIFO, so
    requests get the model in arrival order. Returns the proxy and how to give it back."""
    outer, inner = server_app.llama_outer_lock, server_app.llama_inner_lock
    await outer.acquire()
    try:
        await inner.acquire()
    finally:
        outer.release()
    return server_app._llama_proxy, inner.release


async def _take_slot(server_app, pool):
    """A free slot of the pool, as a proxy whose model is the slot. Returns it and how to give it back."""
    import asyncio

    if SLOTS.free is None:
        SLOTS.free = asyncio.Semaphore(len(pool.slots))
    free = SLOTS.free  # this request's, even if the model were loaded again meanwhile
    await free.acquire()
    slot = pool.try_acquire()  # the semaphore's permit guarantees one

    def release() -> None:
        pool.release(slot)
        free.release()

    return SlotProxy(server_app._llama_proxy, slot), release


@dataclass
class SlotState:
    """The thread that computes the served model's graphs (slots.Engine): requests run on the server's worker
    threads, and ggml's OpenMP team belongs to the thread that computes, so decodes from several threads
    made every one of them ~2x slower on 2 cores (bench/NOTES.md). With `parallel` > 1, the slot pool and
    the free slots' count too."""

    pool: object = None  # slots.SlotPool
    engine: object = None  # slots.Engine
    free: object = None  # asyncio.Semaphore, made in the server's event loop
    llm: object = None  # the served Eagle3Llama (its vocabulary checks a request's grammar before the request runs)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.pool = self.engine = self.free = self.llm = None


SLOTS = SlotState()


class SlotProxy:
    """What a request's route sees of the model proxy while it holds a slot: the model it gets is the slot
    (an Eagle3Llama on its own sequence), after the proxy's model-name rule."""

    def __init__(self, proxy, slot):
        self._proxy = proxy
        self._current_model = slot

    def __call__(self, model: Optional[str] = None):
        self._proxy(model)  # strict_model's 404, as without slots
        return self._current_model


M_ARENA_MAX = -8  # glibc's mallopt parameter


@functools.cache
def _libc():
    """glibc, or None on another C library (loaded once)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the memory requests left behind back to the system: first the garbage in reference cycles (a
    dropped or finished stream's cancelled tasks hold frames and tracebacks, which Python's own full collection
    reaches only every few dozen requests: held memory rose ~15 MiB between them at serve --parallel 4; this
    runs in a request's teardown, so it mostly frees the requests' before it), then the heap pages freed
    (glibc's malloc_trim(0); a no-op on other C libraries). The collection runs only once `configure_heap` has
    frozen the objects alive at start-up: it then takes ~0.7 ms, against ~55 ms over a whole heap."""
    if gc.get_freeze_count():
        gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def configure_heap() -> None:
    """For a long-running server process, once the model is loaded. The objects alive now (the libraries, the
    model: ~92,000) are frozen out of the garbage collector's passes (gc.freeze), so a full collection scans
    only what requests made (~0.7 ms against ~55 ms on 2 cores), the one after every request included. And
    one malloc arena: requests run one at a time, but on whichever of the thread pool's threads is free, and
    glibc gives each thread its own arena, whose freed pages it keeps: measured on 400 mixed requests from 4
    clients, RSS crept ~4% with the default arenas (a trim after every request included) and stayed within
    noise (±3%) with one. The arena setting is a no-op on other C libraries."""
    gc.collect()
    gc.freeze()
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 1)


async def event_publisher(request, inner_send_chan, body, body_model, llama_call, kwargs):
    """llama-cpp-python's streaming publisher, made safe to drop: the chunk generator is always closed, in
    a worker thread and while this request still holds the model, whether the stream ends, its client
    disconnects, it is interrupted (`interrupt_requests`) or it fails."""
    import anyio
    from llama_cpp.server import app as server_app

    settings = next(server_app.get_server_settings())
    interrupt = bool(settings.interrupt_requests) if settings else False
    done = object()
    async with contextlib.asynccontextmanager(queued_llama_proxy)() as proxy:
        llama = server_app.prepare_request_resources(body, proxy, body_model, kwargs)
        iterator, sent = None, 0
        async with inner_send_chan:
            try:
                iterator = await anyio.to_thread.run_sync(lambda: llama_call(llama, **kwargs))
                while True:
                    chunk = await anyio.to_thread.run_sync(next, iterator, done)
                    if chunk is done:
                        break
                    await inner_send_chan.send(dict(data=json.dumps(chunk)))
                    sent += 1
                    if await request.is_disconnected():
                        raise anyio.get_cancelled_exc_class()()
                    if interrupt and server_app.llama_outer_lock.locked():
                        log.info("stream interrupted after %d chunks: another request arrived (interrupt_requests)",
                                 sent)
                        await inner_send_chan.send(dict(data="[DONE]"))
                        raise anyio.get_cancelled_exc_class()()
                await inner_send_chan.send(dict(data="[DONE]"))
            except anyio.get_cancelled_exc_class():
                if not interrupt or not server_app.llama_outer_lock.locked():
                    log.info("stream stopped after %d chunks: the client disconnected", sent)
                raise
            finally:
                if iterator is not None and hasattr(iterator, "close"):
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(iterator.close)


def open_paths(app) -> frozenset[str]:
    """The paths llama-cpp-python's server leaves open with an API key set: its docs pages, and the routes its
    OpenAPI schema lists without a security requirement (its `authenticate` depends on the bearer scheme, so a
    guarded route carries one). Read from the schema because FastAPI keeps an included router's routes in its
    internals; a route hidden from the schema counts as guarded."""
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url} - {None}
    schema = app.openapi()["paths"]
    if not any(op.get("security") for operations in schema.values() for op in operations.values()):
        raise Eagle3Error("llama-cpp-python's server marks no route as needing its API key: --api-key cannot guard it")
    return frozenset(docs | {path for path, operations in schema.items()
                             if not any(op.get("security") for op in operations.values())})


class ApiKeyCheck:
    """ASGI middleware: a request to any path but those llama-cpp-python's server leaves open gets 401 (its
    answer) unless it sends `Authorization: Bearer KEY`, compared in constant time (llama-cpp-python compares
    with ==, which a wrong key then never reaches). A browser's CORS preflight (OPTIONS, which carries no
    credentials) passes, as without a key (serve's CORS middleware, around this one, answers it first)."""

    def __init__(self, app, key: str, open_paths: frozenset[str]):
        self.app = app
        self.key = key.encode()
        self.open = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in self.open and not _preflight(scope):
            auth = dict(scope.get("headers", ())).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not (hmac.compare_digest(scheme.lower(), b"bearer") & hmac.compare_digest(token, self.key)):
                payload = b'{"detail":"Invalid API key"}'
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)


def _preflight(scope) -> bool:
    headers = dict(scope.get("headers", ()))
    return scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers


class RequestCheck:
    """ASGI middleware: completion requests whose body is not JSON, does not fit llama-cpp-python's own request model,
    or asks what its completion code fails on (`refusal`) get a 400 in OpenAI's error shape (llama-cpp-python's route
    handler answers them 500, or a stream with no error event). `parallel`: serve's slots; `empty_prompt_fails`: the
    target adds no BOS token, so an empty prompt leaves nothing to decode; `grammar_parses`: the target's grammar
    parser."""

    def __init__(self, app, parallel: int = 1, empty_prompt_fails: bool = False,
                 grammar_parses: Callable[[str], bool] | None = None):
        from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

        self.app = app
        self.parallel = parallel
        self.empty_prompt_fails = empty_prompt_fails
        self.grammar_parses = grammar_parses
        self.models = {"/v1/completions": CreateCompletionRequest, "/v1/chat/completions": CreateChatCompletionRequest}

    async def __call__(self, scope, receive, send) -> None:
        model = self.models.get(scope.get("path", "")) if scope["type"] == "http" else None
        if model is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        error = self.check(model, body)
        if error is None:
            error = refusal(json.loads(body), self.parallel, self.empty_prompt_fails, self.grammar_parses)
        if error is not None:
            await self.reject(send, error)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    def check(model, body: bytes) -> str | None:
        from pydantic import ValidationError

        try:
            request = json.loads(body)
            model.model_validate(request)
        except ValueError as e:  # json.JSONDecodeError and pydantic's ValidationError are ValueErrors
            if isinstance(e, ValidationError):
                return f"invalid request: {explain(e.errors(), request)}"
            return f"the request body is not valid JSON: {e}"
        return None

    @staticmethod
    async def reject(send, message: str) -> None:
        payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": None}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def refusal(request: dict, parallel: int, empty_prompt_fails: bool = False,
            grammar_parses: Callable[[str], bool] | None = None) -> str | None:
    """What a valid completion request (a chat one where it has messages) asks that llama-cpp-python's completion code
    fails on (a 500, or a stream with no error event), said as a 400 would say it; None where nothing is.
    `empty_prompt_fails`: the target adds no BOS token (with one, an empty prompt is the BOS alone); `grammar_parses`:
    the target's grammar parser, where the request's grammar is to be checked."""
    chat = "messages" in request
    prompt = request.get("prompt", "")  # the request model's default
    if not chat and isinstance(prompt, list) and len(prompt) > 1:  # (one string in a list: the route takes it)
        return "one prompt a request: give prompt as a string"
    if not chat and empty_prompt_fails and prompt in ("", [], [""]):
        return "the prompt is empty, and this model adds no BOS token to start from: give it some text"
    grammar = request.get("grammar")
    if grammar and grammar_parses is not None and not grammar_parses(grammar):
        from .llama import GRAMMAR_FAILS

        return GRAMMAR_FAILS
    bias = request.get("logit_bias")
    if isinstance(bias, dict) and request.get("logit_bias_type") != "tokens":  # "tokens": its keys are token texts
        for key in bias:
            try:
                int(key)
            except ValueError:
                return f"logit_bias keys are token ids: {key!r} is not one (or set logit_bias_type to tokens)"
    if parallel > 1:  # what llama-cpp-python hands on as logprobs needs every row's logits
        wants = request.get("logprobs") and request.get("top_logprobs") is not None if chat else \
            request.get("logprobs") is not None
        if wants:
            return "logprobs need serve --parallel 1 (parallel slots keep no logits for each row)"
    return None


# ------------------------------------------------------------------------------------------------
# Speculation statistics: usage.speculation on non-streamed answers, GET /v1/eagle3/stats
# ------------------------------------------------------------------------------------------------


def speculation_summary(llm) -> dict:
    """What an Eagle3Llama's last call did, as the server reports it. spec_sampling: greedy, match or
    rejection; verification: the same with its detail (q's temperature scale, why a chain fell back to
    match); fallback: why the call decoded plainly (None when it speculated)."""
    st = llm.spec_stats
    return {"drafted": st.n_drafted, "accepted": st.n_accepted, "acceptance_rate": st.acceptance_rate,
            "target_forwards": st.n_target_forwards, "generated": st.n_generated, "tokens_per_forward": st.tau,
            "draft_max": st.draft_max, "policy": st.policy.name if st.policy is not None else None,
            "spec_sampling": st.spec_sampling.split(" ")[0] or None, "verification": st.spec_sampling or None,
            "fallback": llm.spec_fallback}


@dataclass
class SpeculationBoard:
    """The last generating request's summary, and totals over every request that generated."""

    last: dict | None = None
    requests: int = 0
    totals: dict = field(default_factory=lambda: dict.fromkeys(("drafted", "accepted", "target_forwards",
                                                                "generated"), 0))

    def add(self, summary: dict) -> None:
        self.last = summary
        self.requests += 1
        for key in self.totals:
            self.totals[key] += summary[key]

    def to_dict(self) -> dict:
        t = self.totals
        forwards = t["target_forwards"]
        return {"requests": self.requests, "last": self.last,
                "total": {**t, "tokens_per_forward": t["generated"] / forwards if forwards else 0.0}}


SPECULATION = SpeculationBoard()
# The running request's slot (SpeculationReport sets it; the model gate fills it): a dict shared with every
# task and thread the request's context is copied into
_REQUEST_SPECULATION: ContextVar[dict | None] = ContextVar("eagle3_request_speculation", default=None)


def _spec_stats(proxy):
    llm = getattr(proxy, "_current_model", None)
    return getattr(llm, "spec_stats", None)


def record_speculation(proxy, before) -> None:
    """After a request held the model: if it generated (llm.spec_stats is a new object), its summary goes to
    the board and to the request's slot."""
    stats = _spec_stats(proxy)
    if stats is None or stats is before:
        return
    summary = speculation_summary(proxy._current_model)
    SPECULATION.add(summary)
    slot = _REQUEST_SPECULATION.get()
    if slot is not None:
        slot["speculation"] = summary


async def speculation_stats() -> dict:
    """GET /v1/eagle3/stats: the last request's speculation (None before the first), and totals; with slots,
    what the shared target batches held."""
    answer = SPECULATION.to_dict()
    if SLOTS.pool is not None:
        st = SLOTS.pool.joint.stats
        answer["slots"] = {"n": len(SLOTS.pool.slots), "decodes": st.decodes, "rows": st.rows,
                           "sequences_per_decode": st.sequences / st.decodes if st.decodes else 0.0,
                           "most_sequences": st.most_sequences}
    return answer


class SpeculationReport:
    """ASGI middleware: a non-streamed completion's JSON answer gets `usage.speculation` (the request's
    speculation_summary); streams and everything else pass through untouched."""

    PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            await self.app(scope, receive, send)
            return
        slot: dict = {}
        start, chunks = None, []

        async def send_reported(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 200 and any(
                    k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in message["headers"]):
                start = message  # held until the body is complete: its length changes
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = self.report(b"".join(chunks), slot.get("speculation"))
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        token = _REQUEST_SPECULATION.set(slot)
        try:
            await self.app(scope, receive, send_reported)
        finally:
            _REQUEST_SPECULATION.reset(token)

    @staticmethod
    def report(body: bytes, summary: dict | None) -> bytes:
        if summary is None:
            return body
        try:
            answer = json.loads(body)
        except ValueError:
            return body
        if not isinstance(answer, dict) or not isinstance(answer.get("usage"), dict):
            return body
        answer["usage"]["speculation"] = summary
        # as FastAPI's JSONResponse renders it
        return json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
