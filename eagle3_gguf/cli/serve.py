"""`eagle3-gguf serve`: llama-cpp-python's own OpenAI-compatible server (`llama_cpp.server`, its
`[server]` extra), serving the target with an EAGLE-3 head attached.

The app is llama-cpp-python's `create_app`; only its model proxy differs: every model it loads gets the
head through `attach_eagle3`, and a request naming a model the server does not serve gets a 404
(llama-cpp-python would silently answer with its default model; `--any-model` keeps that). A request
check in front answers malformed JSON and schema errors with 400 (llama-cpp-python answers them 500).
max_tokens past the context is llama-cpp-python's rule: clamped, the answer stops with "length".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ..errors import Eagle3Error
from .generate import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN, check_decoding_flags

SERVER_EXTRA_HINT = "pip install 'eagle3-gguf[server]'"
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass
class ServeConfig:
    model: Path
    draft: Path
    host: str = "127.0.0.1"
    port: int = 8000
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_p_min: float = DEFAULT_DRAFT_P_MIN
    n_ctx: int = 4096
    n_threads: int | None = None
    alias: str | None = None  # the model name clients send; default: the target's file name without .gguf
    any_model: bool = False  # answer every model name (llama-cpp-python's behaviour) instead of 404

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
    from fastapi import HTTPException
    from llama_cpp.server import app as server_app
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from ..llama import attach_eagle3
    from ..native import CACHE_TYPES
    from ..pair import read_pair

    read_pair(config.model, config.draft)  # a mismatched pair fails here with one line, before loading

    class Eagle3LlamaProxy(LlamaProxy):
        def load_llama_from_model_settings(self, settings):
            llm = LlamaProxy.load_llama_from_model_settings(settings)
            try:
                return attach_eagle3(llm, config.draft, draft_max=config.draft_max, draft_p_min=config.draft_p_min)
            except BaseException:
                llm.close()
                raise

        def __call__(self, model: Optional[str] = None):
            if model is not None and not config.any_model and model not in self._model_settings_dict:
                raise HTTPException(status_code=404, detail={
                    "message": f"The model `{model}` does not exist; this server serves `{config.model_alias}`",
                    "type": "invalid_request_error", "param": "model", "code": "model_not_found"})
            return super().__call__(model)

    threads = {} if config.n_threads is None else {"n_threads": config.n_threads, "n_threads_batch": config.n_threads}
    model_settings = ModelSettings(model=str(config.model), model_alias=config.model_alias, n_ctx=config.n_ctx,
                                   flash_attn=True, type_v=CACHE_TYPES["bf16"], verbose=False, **threads)  # EXACTNESS
    server_settings = ServerSettings(host=config.host, port=config.port)
    plain_proxy = server_app.LlamaProxy
    server_app.LlamaProxy = Eagle3LlamaProxy  # create_app builds its proxy from this module name
    try:
        app = server_app.create_app(server_settings=server_settings, model_settings=[model_settings])
    finally:
        server_app.LlamaProxy = plain_proxy
    app.add_middleware(RequestCheck)
    return app


class RequestCheck:
    """ASGI middleware: completion requests whose body is not JSON, or does not fit llama-cpp-python's own
    request model, get a 400 in OpenAI's error shape (llama-cpp-python's route handler answers them 500)."""

    def __init__(self, app):
        from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

        self.app = app
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
        import json

        from pydantic import ValidationError

        try:
            model.model_validate(json.loads(body))
        except ValueError as e:  # json.JSONDecodeError and pydantic's ValidationError are ValueErrors
            if isinstance(e, ValidationError):
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"]) or "body"
                return f"invalid request: {where}: {first['msg']}"
            return f"the request body is not valid JSON: {e}"
        return None

    @staticmethod
    async def reject(send, message: str) -> None:
        import json

        payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                        "code": None}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        model: Path = typer.Option(..., "-m", "--model", help="Target GGUF."),
        draft: Path = typer.Option(..., "-md", "--draft", help="EAGLE-3 head GGUF."),
        host: str = typer.Option("127.0.0.1", "--host", help="Listen address (loopback by default)."),
        port: int = typer.Option(8000, "--port", help="Listen port."),
        draft_max: int = typer.Option(DEFAULT_DRAFT_MAX, "--draft-max", help="Tokens drafted per cycle (K); 0 = target only."),
        draft_p_min: float = typer.Option(DEFAULT_DRAFT_P_MIN, "--draft-p-min", help="Stop drafting when the draft's top probability falls below this."),
        n_ctx: int = typer.Option(4096, "-c", "--ctx-size", help="Context size (tokens)."),
        threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads."),
        alias: Optional[str] = typer.Option(None, "--alias", help="Model name clients send (default: the target file name without .gguf)."),
        any_model: bool = typer.Option(False, "--any-model", help="Answer requests for any model name instead of 404."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show llama.cpp's log and every request."),
    ) -> None:
        """Serve the target with the head through llama-cpp-python's OpenAI-compatible server (/v1/...)."""
        from .main import fail, setup_logging

        setup_logging(verbose)
        config = ServeConfig(model, draft, host=host, port=port, draft_max=draft_max, draft_p_min=draft_p_min,
                             n_ctx=n_ctx, n_threads=threads, alias=alias, any_model=any_model)
        try:
            check_decoding_flags(n_ctx, threads, draft_max, draft_p_min)
            if not 0 < port < 65536:
                raise Eagle3Error(f"--port must be in 1..65535 (got {port})")
            server = build_app(config)
        except Eagle3Error as e:
            fail(str(e))
        import uvicorn

        typer.echo(f"serving {config.model_alias} (+ {draft.name}, K={draft_max}, p_min {draft_p_min}) on "
                   f"http://{host}:{port}/v1", err=True)
        uvicorn.run(server, host=host, port=port, log_level="info" if verbose else "warning")
