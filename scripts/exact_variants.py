#!/usr/bin/env python3
"""Which set-up of a target computes verify batches bit for bit as lone rows: the exactness probe under variants.

    python scripts/exact_variants.py --target T.gguf [-ngl all] [-t N] [--out exact-variants.md]

The lent GPU call's question about CUDA (docs/exactness.md: ggml-cuda's flash attention takes its vector kernel for
one row and its MMA kernel for more, whatever the cache type; its quantized products change their warps at 5 rows
and their kernel at 9): each variant is one exactness probe (eagle3_gguf/exactness.py, widths 1..--rows, where it
parts named node by node) of the target alone, in a process of its own (ggml reads its GGML_* switches once a process),
feature extraction off. A table on stdout and in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eagle3_gguf, where it is not installed (a lent GPU)

ROWS = 17  # generate's widest default verify batch
VARIANT_TIMEOUT_S = 120  # one probe loads the target (an 8B in seconds from the page cache) and probes in ~0.1-2 s
ERROR_PREFIX = "eagle3_gguf.errors.Eagle3Error: "


@dataclass(frozen=True)
class Variant:
    name: str
    type_k: str = "f16"
    type_v: str = "auto"  # -ctv auto: bf16 on a CPU, f16 where the layers are on a GPU (pair.default_type_v)
    flash_attn: bool = True
    n_ubatch: int | None = None  # None: n_batch's
    env: dict[str, str] = field(default_factory=dict)


# most telling first: the run's own set-up, the V cache it no longer takes on a GPU, the quantized caches whose
# vector kernel serves 2 rows too (fattn.cu), with batches cut to 2 rows, the controls
VARIANTS = [Variant("as generate runs it"),
            Variant("-ctv bf16", type_v="bf16"),
            Variant("-ctk q8_0 -ctv q8_0", type_k="q8_0", type_v="q8_0"),
            Variant("-ctk q8_0 -ctv q8_0, n_ubatch 2", type_k="q8_0", type_v="q8_0", n_ubatch=2),
            Variant("GGML_CUDA_DISABLE_FUSION=1", env={"GGML_CUDA_DISABLE_FUSION": "1"}),
            Variant("flash attention off", flash_attn=False),
            Variant("n_ubatch 1 (every row alone: exact by construction)", n_ubatch=1)]


@dataclass
class Found:
    variant: str
    exact: int = 0
    probed: int = 0
    parts_at: str = ""
    seconds: float = 0.0
    error: str = ""


def probe_one(target: str, variant: Variant, ngl: int, threads: int, rows: int) -> Found:
    """One variant's probe, in this process."""
    from eagle3_gguf.batch import Batch
    from eagle3_gguf.context import Context
    from eagle3_gguf.exactness import probe
    from eagle3_gguf.gguf_file import TargetInfo, read_gguf
    from eagle3_gguf.native import Model, cache_type, flash_attn_type
    from eagle3_gguf.pair import default_type_v

    type_v = default_type_v(ngl) if variant.type_v == "auto" else variant.type_v
    repack = TargetInfo.from_gguf(read_gguf(target)).repack_exact  # as load_pair repacks
    with Model(target, n_gpu_layers=ngl, repack=repack) as model, \
            Context(model, n_ctx=1024, n_batch=512, n_ubatch=variant.n_ubatch, n_threads=threads,
                    type_k=cache_type(variant.type_k), type_v=cache_type(type_v),
                    flash_attn=flash_attn_type(variant.flash_attn)) as ctx, Batch(512) as batch:
        found = probe(ctx, lambda _on: None, rows, batch)
    return Found(variant.name, found.exact, found.probed, found.parts_at, found.seconds)


def run_all(target: str, ngl: int, threads: int, rows: int, out: Path | None) -> list[Found]:
    """Every variant in a process of its own; one that fails says why in its row. The table is written to `out`
    after each, so a run cut short (SIGINT) keeps what finished."""
    results: list[Found] = []
    for i, v in enumerate(VARIANTS):
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--target", target, "-ngl", str(ngl), "-t", str(threads),
                                "--rows", str(rows), "--one", str(i)], capture_output=True, text=True,
                               env={**os.environ, **v.env}, timeout=VARIANT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            results.append(Found(v.name, error=f"no answer in {VARIANT_TIMEOUT_S} s"))
        else:
            if r.returncode == 0:
                results.append(Found(**json.loads(r.stdout.splitlines()[-1])))
            else:
                tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                results.append(Found(v.name, error=f"exit {r.returncode}: {tail.removeprefix(ERROR_PREFIX)[:200]}"))
        print(f"{v.name}: {table_row(results[-1])} ({time.perf_counter() - t:.1f} s with the load)", flush=True)
        if out is not None:
            out.write_text(table(target, ngl, threads, results))
    return results


def table_row(f: Found) -> str:
    if f.error:
        return f"| {f.variant} | failed: {f.error} | | |"
    widths = f"1..{f.exact}" if f.exact > 1 else str(f.exact)
    return f"| {f.variant} | {widths} of 1..{f.probed} | {f.parts_at or 'none parts'} | {f.seconds:.2f} |"


def table(target: str, ngl: int, threads: int, results: list[Found]) -> str:
    return "\n".join([f"# Exact verify widths by set-up: {Path(target).name}, -ngl {ngl}, {threads} threads", "",
                      "| variant | exact widths | where the next parts | probe s |", "|---|---|---|---|",
                      *map(table_row, results)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target GGUF")
    ap.add_argument("-ngl", "--n-gpu-layers", default="0", help="the target's layers on the GPU: a number or 'all'")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rows", type=int, default=ROWS, help="the widest verify batch probed")
    ap.add_argument("--out", type=Path, help="write the table here too")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run_all's child: one variant, JSON on stdout
    args = ap.parse_args(argv)
    if not Path(args.target).is_file():
        print(f"error: {args.target}: no such file", file=sys.stderr)
        return 2
    if args.n_gpu_layers != "all" and not args.n_gpu_layers.isdigit():
        print(f"error: -ngl must be a number of layers or 'all' (got {args.n_gpu_layers})", file=sys.stderr)
        return 2
    from eagle3_gguf.config import MAX_THREADS
    if not 2 <= args.rows <= 512 or not 1 <= args.threads <= MAX_THREADS:
        print(f"error: --rows must be 2..512 and -t 1..{MAX_THREADS}", file=sys.stderr)
        return 2
    ngl = -1 if args.n_gpu_layers == "all" else int(args.n_gpu_layers)
    if args.one is not None:
        print(json.dumps(asdict(probe_one(args.target, VARIANTS[args.one], ngl, args.threads, args.rows))))
        return 0
    try:
        print(table(args.target, ngl, args.threads, run_all(args.target, ngl, args.threads, args.rows, args.out)))
    except KeyboardInterrupt:  # --out holds the variants that finished
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
