"""`eagle3-gguf serve`: llama-cpp-python's OpenAI-compatible server with an EAGLE-3 head (eagle3_gguf.server)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Optional

import typer

from ..errors import Eagle3Error
from ..server import ServeConfig, build_app, configure_heap
from .common import (HEAD_FLAGS, SERVE_RPC_TIMEOUT_HELP, TERMINATION, cache_type_k_option, cache_type_v_option,
                     check_cache_types, check_context_flags, check_head_flag, check_rpc_timeout, ctx_option,
                     draft_option, drafting_from_flags, fail, gpu_layers, gpu_layers_option, rpc_backend_option,
                     rpc_option, rpc_servers, rpc_stalled, setup_logging)


MAX_PARALLEL = 64
MIN_SLOT_CTX = 64  # fewer tokens per slot than this cannot hold a chat prompt and an answer


def check_parallel(parallel: int, n_ctx: int, draft_max: int, interrupt_requests: bool) -> None:
    if not 1 <= parallel <= MAX_PARALLEL:
        raise Eagle3Error(f"--parallel must be in 1..{MAX_PARALLEL} (got {parallel})")
    if parallel == 1:
        return
    if interrupt_requests:
        raise Eagle3Error("--interrupt-requests ends one running stream for the next request: use it with --parallel 1")
    if draft_max < 1:
        raise Eagle3Error("--parallel runs the speculative cycle on every slot: give --draft-max 1 or more")
    if n_ctx // parallel < MIN_SLOT_CTX:
        raise Eagle3Error(f"-c {n_ctx} split over {parallel} slots leaves {n_ctx // parallel} tokens each: raise -c to "
                          f"at least {MIN_SLOT_CTX * parallel} or lower --parallel")


def check_listen(host: str, port: int) -> None:
    """--host and --port can be listened on (checked by binding them once), before the models load."""
    if not 0 < port < 65536:
        raise Eagle3Error(f"--port must be in 1..65535 (got {port})")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise Eagle3Error(f"--host {host}: not an address of this machine ({getattr(e, 'strerror', e)})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind(address)
        except OSError as e:
            raise Eagle3Error(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or --host") \
                from None


def read_api_key(key: str | None, path: Path | None) -> str | None:
    """--api-key or the first line of --api-key-file (not both); an empty key is refused."""
    if key is not None and path is not None:
        raise Eagle3Error("give the API key with --api-key or --api-key-file, not both")
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise Eagle3Error(f"{path}: cannot read the API key ({e.strerror if isinstance(e, OSError) else e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise Eagle3Error(f"{path}: the API key file's first line is empty")
    if key is not None and not key.strip():
        raise Eagle3Error("--api-key is empty")
    if key is not None and not (key.isascii() and key.isprintable()):
        raise Eagle3Error("the API key must be printable ASCII (what an HTTP Authorization header carries)")
    return key


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        model: Path = typer.Option(..., "-m", "--model", help="Target GGUF."),
        draft: Path = typer.Option(..., *HEAD_FLAGS, help="EAGLE-3 head GGUF."),
        host: str = typer.Option("127.0.0.1", "--host", help="Listen address (loopback by default)."),
        port: int = typer.Option(8000, "--port", help="Listen port."),
        draft_max: int = draft_option("draft_max"),
        draft_p_min: float = draft_option("draft_p_min"),
        n_ctx: int = ctx_option(),
        threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads."),
        cache_type_k: str = cache_type_k_option(),
        cache_type_v: str = cache_type_v_option(),
        n_gpu_layers: str = gpu_layers_option("The target", "-ngl", "--n-gpu-layers", "--gpu-layers"),
        n_gpu_layers_draft: str = gpu_layers_option("The head", "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft"),
        rpc: Optional[str] = rpc_option(),
        rpc_backend: Optional[Path] = rpc_backend_option(),
        rpc_timeout: float = typer.Option(60.0, "--rpc-timeout", help=SERVE_RPC_TIMEOUT_HELP),
        alias: Optional[str] = typer.Option(None, "--alias", help="Model name clients send (default: the target file name without .gguf)."),
        draft_policy: str = draft_option("draft_policy"),
        spec_sampling: str = draft_option("spec_sampling"),
        draft_temp_scale: Optional[float] = draft_option("draft_temp_scale", None),
        draft_lookup: str = draft_option("draft_lookup", "on"),
        draft_lookup_max: int = draft_option("draft_lookup_max"),
        exact: str = draft_option("exact"),
        strict_model: bool = typer.Option(False, "--strict-model", help="Answer 404 to requests naming another model (default: llama-cpp-python's rule, the served model answers)."),
        interrupt_requests: bool = typer.Option(False, "--interrupt-requests", help="llama-cpp-python's default: a new request ends the running stream early (its client gets a short answer). Default here: requests queue."),
        parallel: int = typer.Option(1, "--parallel", "-np", help="Requests served at once, their target decodes in one batch; -c is split among them. 1: one at a time."),
        api_key: Optional[str] = typer.Option(None, "--api-key", help="Requests must send this key (Authorization: Bearer KEY), as llama-server's and llama-cpp-python's --api-key; the rest get 401."),
        api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", help="Read the key from this file's first line (kept out of the process list)."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show llama.cpp's log and every request."),
        # generate's and bench's, refused by name (else click reads -ts as -t s)
        tensor_split: Optional[str] = typer.Option(None, "--tensor-split", "-ts", hidden=True),
    ) -> None:
        """Serve the target with the head through llama-cpp-python's OpenAI-compatible server (/v1/...)."""
        setup_logging(verbose)
        logging.getLogger("eagle3_gguf.server").setLevel(logging.INFO)  # queueing and dropped streams
        try:
            drafting = drafting_from_flags(draft_max, draft_p_min, draft_policy, spec_sampling, draft_temp_scale,
                                           draft_lookup, draft_lookup_max, exact=exact)
            check_context_flags(n_ctx, threads)
            if tensor_split is not None:
                raise Eagle3Error("serve places the target's layers as llama-cpp-python does (-ngl, --rpc): "
                                  "--tensor-split is generate's and bench's")
            check_cache_types(cache_type_k, cache_type_v)
            check_head_flag(draft)
            config = ServeConfig(model=model, draft=draft, drafting=drafting, host=host, port=port, n_ctx=n_ctx,
                                 n_threads=threads, alias=alias, strict_model=strict_model,
                                 interrupt_requests=interrupt_requests, parallel=parallel,
                                 n_gpu_layers=gpu_layers(n_gpu_layers, "-ngl"),
                                 n_gpu_layers_draft=gpu_layers(n_gpu_layers_draft, "-ngld"),
                                 cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                                 api_key=read_api_key(api_key, api_key_file), rpc_servers=rpc_servers(rpc, rpc_backend),
                                 rpc_backend=str(rpc_backend) if rpc_backend else None, rpc_timeout=rpc_timeout,
                                 on_stall=rpc_stalled)
            check_rpc_timeout(rpc_timeout)
            check_listen(host, port)
            check_parallel(parallel, n_ctx, draft_max, interrupt_requests)
            server = build_app(config)
        except Eagle3Error as e:
            fail(str(e))
        if not config.loopback and config.api_key is None:
            typer.echo(f"warning: serving on {host} without --api-key: anyone who reaches this port can use the model",
                       err=True)
        import uvicorn

        configure_heap()

        typer.echo(f"serving {config.model_alias} (+ {draft.name}, {draft_policy}, K={draft_max}, p_min {draft_p_min}, "
                   f"{spec_sampling} sampling at temperature > 0)"
                   f" on http://{host}:{port}/v1; concurrent requests "
                   f"{'interrupt the running stream' if interrupt_requests else 'queue'}"
                   f"{f', {parallel} at once' if parallel > 1 else ''}"
                   f"{'; requests need the API key' if config.api_key is not None else ''}", err=True)
        uvicorn.run(server, host=host, port=port, log_level="info" if verbose else "warning")
        if TERMINATION.received:  # uvicorn shut down gracefully on SIGTERM/SIGINT (running requests finished)
            raise typer.Exit(TERMINATION.code)
