#!/usr/bin/env python
"""What `serve --parallel N` could gain on this machine: aggregate decoding throughput with N sequences in
one target batch (one row per sequence per step, each its own KV sequence) against one sequence alone.

    python scripts/bench_parallel.py                      # SmolLM2 Q4_1, N = 1..4, 2 threads
    python scripts/bench_parallel.py --ns 1,2,4,8 --out bench/parallel-cpu
    python scripts/bench_parallel.py --slots 4 --out bench/parallel-cpu   # serve --parallel's slot pool (eagle3_gguf/slots.py)
    python scripts/bench_parallel.py --serve 4 --out bench/parallel-cpu   # serve --parallel 4 against --parallel 1

Plain greedy decoding, no head: the question is only whether llama.cpp decodes N rows of N sequences for
less than N times one row (on a CPU verification is compute-bound, on a GPU nearly free). Every round runs
each N once, interleaved, from the same prompts (our own, not benchmark text); a setting's figure is the
median over rounds. Aggregate tok/s = N * steps / seconds; per-sequence tok/s = steps / seconds.

--slots N: the whole path instead (Eagle3Llama + the shipped head, adaptive policy, chat completions of
--steps tokens at temperature 0): the requests one after another on the Eagle3Llama, against the same
requests at once from N threads on a SlotPool of N slots, interleaved per round. Reports aggregate tok/s
of both, their ratio per round, whether every answer equals its alone-answer, and how many sequences the
shared batches held.

Every round's figures are eagle3_gguf.bench's records (a PromptRun per setting and round: the round's requests
as one prompt) and the ratios its per_prompt_ratio (the median over rounds of each round's ratio), as
`eagle3-gguf bench` computes a contender's; what is measured here (several sequences at once) it does not.

--serve N: `eagle3-gguf serve --parallel N` against `serve --parallel 1`, the same N chat requests sent to
each at once (every other one streamed), interleaved per round: aggregate tok/s of both and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from typing import Callable
from pathlib import Path

import llama_cpp  # noqa: F401,I001  before numpy: see scripts/bench_scale.py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3_gguf.assets import smollm2_path  # noqa: E402
from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.bench import PromptRun, per_prompt_ratio  # noqa: E402
from eagle3_gguf.context import Context  # noqa: E402
from eagle3_gguf.native import CACHE_TYPES, Model, install_log_callback  # noqa: E402
from eagle3_gguf.tokens import chat_tokens  # noqa: E402

PROMPTS = [
    "Explain how a bicycle's gears make pedaling easier uphill.",
    "Write a short poem about a cat watching the rain.",
    "What are three tips for writing a clear email?",
    "Write a Python function that checks whether all elements of a list are unique.",
    "Describe the water cycle to a ten-year-old.",
    "List the planets of the solar system with one fact each.",
    "How does a refrigerator keep food cold?",
    "Give me a recipe for a simple tomato soup.",
]


def run(ctx: Context, batch: Batch, prompts: list[list[int]], steps: int) -> float:
    """Prefill each prompt into its own sequence, then `steps` steps of one greedy row per sequence in one
    batch. Returns the seconds the steps took."""
    ctx.clear()
    last = []
    for s, p in enumerate(prompts):
        batch.set_rows(np.asarray(p, np.int32), np.arange(len(p), dtype=np.int32), np.full(len(p), s, np.int32),
                       np.arange(len(p)) == len(p) - 1)
        ctx.decode(batch)
        last.append(int(np.argmax(ctx.logits_ith(len(p) - 1))))
    n = len(prompts)
    pos = np.asarray([len(p) for p in prompts], np.int32)  # [n]
    seqs = np.arange(n, dtype=np.int32)  # [n]
    t = time.perf_counter()
    for _ in range(steps):
        batch.set_rows(np.asarray(last, np.int32), pos, seqs, np.ones(n, bool))
        ctx.decode(batch)
        logits = ctx.logits(n)  # [n, n_vocab]
        last = [int(np.argmax(logits[i])) for i in range(n)]
        pos += 1
    return time.perf_counter() - t


def at_once(one: Callable[[int], tuple[str, int]], n: int) -> tuple[float, list]:
    """one(0), ..., one(n - 1) from n threads started together: the seconds until all are done, and their
    answers (text, tokens) in order."""
    got: list = [None] * n

    def run_one(i: int) -> None:
        got[i] = one(i)

    threads = [threading.Thread(target=run_one, args=(i,)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t, got


def record(setting: str, rnd: int, tokens: int, seconds: float) -> PromptRun:
    """One round of one setting, as the benchmark runner records a run: the round's requests are one prompt."""
    return PromptRun("parallel", "all", setting, rnd, 0, tokens, seconds, 0)


def interleave(first, second, keys: tuple[str, str], rounds: int) -> tuple[list[PromptRun], bool]:
    """first() then second() (each: seconds, answers) every round, recorded under their keys with the tokens of
    first's answers; and whether they always agreed."""
    out, equal = [], True
    for r in range(rounds):
        (t_first, want), (t_second, got) = first(), second()
        equal = equal and got == want
        tokens = sum(k for _, k in want)
        out += [record(keys[0], r, tokens, t_first), record(keys[1], r, tokens, t_second)]
        print(f"round {r + 1}/{rounds}: {t_first / t_second:.2f}x", file=sys.stderr)
    return out, equal


def of(runs: list[PromptRun], setting: str) -> list[PromptRun]:
    return [r for r in runs if r.contender == setting]


def contest_lines(runs: list[PromptRun], keys: tuple[str, str], labels: tuple[str, str], column: str,
                  versus: str, agreed: str, equal: bool) -> list[str]:
    """The table of both settings' median aggregate tok/s and the sentence on their per-round ratios (the second
    against the first)."""
    second, first = of(runs, keys[1]), of(runs, keys[0])
    ratio = per_prompt_ratio(second, first)["all"]
    per_round = [b.tok_s / a.tok_s for a, b in zip(first, second)]
    return [f"|{f' {column}' if column else ''} | aggregate tok/s (median) |", "|---|---|",
            *(f"| {label} | {statistics.median(r.tok_s for r in of(runs, key)):.1f} |"
              for key, label in zip(keys, labels)),
            "", f"{versus}, median of per-round ratios: **{ratio:.2f}x** "
            f"(rounds: {', '.join(format(x, '.2f') for x in per_round)}). Every answer {agreed}: "
            f"{'yes' if equal else 'NO'}."]


def payload(runs: list[PromptRun]) -> list[dict]:
    return [{"setting": r.contender, "round": r.round, "tokens": r.tokens, "seconds": r.seconds, "tok_s": r.tok_s}
            for r in runs]


def publish(args, name: str, lines: list[str], payload: dict) -> None:
    """Print the report; with --out, write it as NAME.md and the figures as NAME.json."""
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        (args.out / f"{name}.json").write_text(json.dumps(payload, indent=1))


def command() -> str:
    return "python scripts/bench_parallel.py " + " ".join(sys.argv[1:])


def run_slots(args) -> None:
    from eagle3_gguf.assets import default_head_path
    from eagle3_gguf.llama import Eagle3Llama
    from eagle3_gguf.slots import Engine, SlotPool

    target = args.target or smollm2_path()
    n = args.slots
    engine = Engine()  # every graph of both contenders on one thread: ggml's OpenMP team is per thread
    llm = engine.call(lambda: Eagle3Llama(str(target), default_head_path(), n_ctx=1024, n_threads=args.threads,
                                          verbose=False))
    pool = SlotPool(llm, n, engine)
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:n]]

    def ask(model, m) -> tuple[str, int]:
        out = model.create_chat_completion(m, max_tokens=args.steps, temperature=0.0, repeat_penalty=1.0)
        return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]

    def in_turn() -> tuple[float, list]:
        t = time.perf_counter()
        got = [ask(llm, m) for m in msgs]
        return time.perf_counter() - t, got

    def on_a_slot(i: int) -> tuple[str, int]:
        slot = pool.acquire()
        try:
            return ask(slot, msgs[i])
        finally:
            pool.release(slot)

    in_turn()  # warm-up: graphs for each batch shape, the cost curve
    at_once(on_a_slot, n)
    pool.joint.stats = type(pool.joint.stats)()
    keys = ("in_turn_tok_s", "at_once_tok_s")
    rounds, equal = interleave(in_turn, lambda: at_once(on_a_slot, n), keys, args.rounds)
    st = pool.joint.stats
    lines = [f"# A slot pool against one request at a time: `{command()}`", "",
             f"{platform.machine()}, {args.threads} threads, {target.name} + the shipped head (adaptive), {n} chat "
             f"requests of up to {args.steps} tokens at temperature 0, {args.rounds} interleaved rounds.", "",
             *contest_lines(rounds, keys, ("one after another (Eagle3Llama)", f"at once ({n} slots, one shared batch)"),
                            "", "At once against one after another", "equal to its alone-answer", equal), "",
             f"Shared batches: {st.decodes} decodes of {st.rows} rows, {st.sequences / max(st.decodes, 1):.2f} "
             f"sequences per decode (decodes by sequences: {dict(sorted(st.by_sequences.items()))}); "
             f"{st.seconds:.2f} s in them."]
    publish(args, "slots", lines, {"command": command(), "rounds": payload(rounds), "equal": equal,
                                   "joint": vars(st)})
    pool.close()
    engine.call(llm.close)
    engine.close()


def run_serve(args) -> None:
    """--serve N: `eagle3-gguf serve` with --parallel 1 and with --parallel N, the same N chat requests sent
    at once to each (half of them streamed), interleaved per round."""
    import http.client
    import subprocess
    from contextlib import ExitStack, closing

    from serving import free_port, stop, wait_ready

    from eagle3_gguf.assets import default_head_path

    target = args.target or smollm2_path()
    n = args.serve
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS[:n]]

    def ask(port: int, i: int) -> tuple[str, int]:
        body = {"messages": msgs[i], "max_tokens": args.steps, "temperature": 0, "repeat_penalty": 1.0,
                "stream": i % 2 == 1}
        with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=600)) as c:
            c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            data = c.getresponse().read().decode()
        if not body["stream"]:
            answer = json.loads(data)
            return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
        parts = [json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in data.splitlines()
                 if line.startswith("data: {")]
        return "".join(parts), sum(1 for x in parts if x)

    def server(par: int):
        return lambda: at_once(lambda i: ask(ports[par], i), n)

    with ExitStack() as stack:
        ports = {}
        for par in (1, n):
            port = free_port()
            cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", str(target), "--draft",
                   str(default_head_path()), "--port", str(port), "-t", str(args.threads), "-c", str(1024 * par),
                   "--parallel", str(par)]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(stop, proc)
            wait_ready(proc, port)
            ports[par] = port
        for par in ports:  # warm-up
            server(par)()
        keys = ("parallel_1_tok_s", f"parallel_{n}_tok_s")
        rounds, equal = interleave(server(1), server(n), keys, args.rounds)
    lines = [f"# serve --parallel {n} against --parallel 1: `{command()}`", "",
             f"{platform.machine()}, {args.threads} threads, {target.name} + the shipped head (adaptive), {n} chat "
             f"requests of up to {args.steps} tokens at temperature 0 sent at once (every other one streamed), "
             f"{args.rounds} interleaved rounds; a slot's context is 1,024 either way.", "",
             *contest_lines(rounds, keys, ("--parallel 1 (requests queue)", f"--parallel {n}"), "server",
                            f"--parallel {n} against --parallel 1", "the same from both", equal)]
    publish(args, "serve", lines, {"command": command(), "rounds": payload(rounds), "equal": equal})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=None, help="target GGUF (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--ns", default="1,2,3,4", help="sequences per batch")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write results.md and results.json here")
    ap.add_argument("--slots", type=int, default=0, help="measure a SlotPool of this many slots instead")
    ap.add_argument("--serve", type=int, default=0, help="measure serve --parallel N against --parallel 1 instead")
    args = ap.parse_args()
    install_log_callback()
    if args.slots:
        run_slots(args)
        return
    if args.serve:
        run_serve(args)
        return
    ns = sorted({1, *(int(x) for x in args.ns.split(","))})  # one sequence alone: what the others are against
    target = args.target or smollm2_path()
    model = Model(target)
    # one KV stream of 1024 cells per sequence (a slot), the V cache in bf16 as serve has it
    ctx = Context(model, n_ctx=1024 * max(ns), n_batch=512, n_threads=args.threads, n_seq_max=max(ns),
                  kv_unified=False, type_v=CACHE_TYPES["bf16"])
    batch = Batch(512)
    prompts = [chat_tokens(model, p) for p in PROMPTS]
    runs: list[PromptRun] = []
    try:
        for n in ns:  # warm-up: llama.cpp sizes its graphs for each batch shape once
            run(ctx, batch, prompts[:n], 4)
        for r in range(args.rounds):
            for n in ns:
                t = run(ctx, batch, [prompts[(r + i) % len(prompts)] for i in range(n)], args.steps)
                runs.append(record(f"{n} sequences", r, n * args.steps, t))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    finally:
        batch.close()
        ctx.close()
        model.close()
    one = of(runs, "1 sequences")
    rows = []
    for n in ns:
        mine = of(runs, f"{n} sequences")
        per_seq = statistics.median(r.tok_s / n for r in mine)
        aggregate_vs_one = per_prompt_ratio(mine, one)["all"]
        rows.append({"n": n, "per_sequence_tok_s": per_seq, "aggregate_tok_s": n * per_seq,
                     "aggregate_vs_one": aggregate_vs_one, "step_cost_vs_one": n / aggregate_vs_one})
    lines = [f"# Parallel sequences in one batch: `{command()}`", "",
             f"{platform.machine()}, {args.threads} threads, {target.name}, {args.steps} greedy steps, "
             f"{args.rounds} interleaved rounds: tok/s the median over rounds, ratios to one sequence the median of "
             f"per-round ratios.", "",
             "| sequences | step cost (x one) | per sequence tok/s | aggregate tok/s | aggregate (x one) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['n']} | {r['step_cost_vs_one']:.2f} | {r['per_sequence_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} "
              f"| {r['aggregate_vs_one']:.2f}x |" for r in rows]
    publish(args, "results", lines, {"command": command(), "rows": rows, "rounds": payload(runs)})


if __name__ == "__main__":
    main()
