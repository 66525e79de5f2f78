"""llama-cpp-python's own OpenAI-compatible server (`llama_cpp.server`, its `[server]` extra), serving a
target with an EAGLE-3 head attached; `eagle3-gguf serve` is its command.

The app is llama-cpp-python's `create_app`; only its model proxy differs: every model it loads gets the
head through `attach_eagle3`. Like llama-cpp-python's server, a request naming a model the server does
not serve is answered by its model; `strict_model` answers it 404 instead. A request check in front
answers malformed JSON and schema errors with 400 (llama-cpp-python answers them 500). max_tokens past
the context is llama-cpp-python's rule: clamped, the answer stops with "length".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import Eagle3Error

SERVER_EXTRA_HINT = "pip install 'eagle3-gguf[server]'"
SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass(kw_only=True)
class ServeConfig:
    model: Path
    draft: Path
    draft_max: int
    draft_p_min: float
    draft_policy: str
    host: str = "127.0.0.1"
    port: int = 8000
    n_ctx: int = 4096
    n_threads: int | None = None
    alias: str | None = None  # the model name clients send; default: the target's file name without .gguf
    strict_model: bool = False  # 404 for other model names (llama-cpp-python answers them with its model)

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

    from .llama import attach_eagle3
    from .native import CACHE_TYPES
    from .pair import read_pair

    read_pair(config.model, config.draft)  # a mismatched pair fails here with one line, before loading

    class Eagle3LlamaProxy(LlamaProxy):
        def load_llama_from_model_settings(self, settings):
            llm = LlamaProxy.load_llama_from_model_settings(settings)
            try:
                return attach_eagle3(llm, config.draft, draft_max=config.draft_max, draft_p_min=config.draft_p_min,
                                     draft_policy=config.draft_policy)
            except BaseException:
                llm.close()
                raise

        def __call__(self, model: Optional[str] = None):
            if model is not None and config.strict_model and model not in self._model_settings_dict:
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
