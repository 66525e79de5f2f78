"""Soak: many mixed requests against `eagle3-gguf serve` (over HTTP, several clients at once) or against one
`Eagle3Llama` in this process, recording memory (RSS) and open handles (file descriptors, threads) over time
and checking every answer against the answer a plain `llama_cpp.Llama` gives the same request alone.

    python scripts/soak.py serve --requests 1000            # SmolLM2 + the shipped head, 4 clients
    python scripts/soak.py serve --requests 1000 --parallel 4   # the same, 4 requests at once in one batch
    python scripts/soak.py llama --requests 1000
    python scripts/soak.py serve -m T.gguf --draft H.gguf --requests 120 --json out.json

The mix: completions and chats, streaming and not, greedy, max_tokens from 1 to past the context (the answer
then stops at the context's end), stop strings, and a few streams dropped part way (their answers are not
compared; the model must be released and the next answers unaffected). Requests are drawn from a pool of
distinct requests whose alone-answers are computed first, by a plain Llama with the same exactness settings
(flash attention, bf16 V cache), in this process before the soak starts.

Memory held = RSS after glibc's malloc_trim(0) (the server trims after every request itself; in llama mode
this process collects garbage and trims before each sample): decoding allocates and frees many numpy buffers of varying sizes and
glibc keeps freed heap pages, so raw RSS creeps without it although nothing is live (the same 1,000 requests
with a trim every 100 return to the same RSS each time). Raw RSS is reported too.

Pass criteria (exit 0 only if all hold): every compared answer equals its alone-answer; memory held at the
floor (the lowest sample) in the second half of the run after warm-up (every distinct request once, or the
first --warmup fraction of the requests if more) is within --rss-tolerance (5%) of its floor in the first half
(a swing between samples does not move a floor; a leak lifts it); open fds
and threads do not grow after warm-up (medians of three samples; against serve by at most two: the server's
worker threads and connections come and go with how requests overlap). Samples are taken between requests: the
clients pause until the ones in flight have finished. Figures go to stdout and, with --json, to a file.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serving import free_port, stop, wait_ready  # scripts/serving.py (this script's folder is on the path)

PROMPTS = [
    "The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
    "The three primary colours are", "Write a haiku about the sea.", "Explain what a hash table is.",
    "List five fruits.", "In 1969, the first", "Translate 'good morning' into French.",
    "What is 17 times 23?", "The quick brown fox", "Give me a short motivational quote.",
]
MAX_TOKENS = [1, 4, 16, 32, 64, 96]
STOPS = [None, ["\n"], [".", "!"], ["the"]]
EXACT = dict(temperature=0.0, repeat_penalty=1.0)


@dataclass(frozen=True)
class Request:
    kind: str  # completion | chat
    stream: bool
    prompt: str
    max_tokens: int
    stop: tuple[str, ...] | None = None
    drop_after: int = 0  # > 0: a streaming client that disconnects after this many chunks

    def body(self) -> dict:
        b = {"max_tokens": self.max_tokens, "stream": self.stream, **EXACT}
        if self.stop:
            b["stop"] = list(self.stop)
        if self.kind == "chat":
            b["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            b["prompt"] = self.prompt
        return b


def request_pool(seed: int, n_ctx: int) -> list[Request]:
    """Distinct requests: every prompt in both kinds, mixed lengths and stops; some run to the context's end."""
    rng = random.Random(seed)
    pool = []
    for i, prompt in enumerate(PROMPTS):
        for kind in ("completion", "chat"):
            stream = rng.random() < 0.5
            stop = STOPS[rng.randrange(len(STOPS))]
            max_tokens = 4 * n_ctx if (i + (kind == "chat")) % 6 == 0 else rng.choice(MAX_TOKENS)
            pool.append(Request(kind, stream, prompt, max_tokens, tuple(stop) if stop else None))
    return pool


def draw(pool: list[Request], n: int, seed: int, drop_rate: float) -> list[Request]:
    """n requests: the warm-up (every pool request once, shuffled), then draws from the pool (the long ones
    less often), a few of which become dropped streams."""
    rng = random.Random(seed + 1)
    out = rng.sample(pool, len(pool))[:n]
    weights = [0.25 if r.max_tokens > max(MAX_TOKENS) else 1.0 for r in pool]
    for r in rng.choices(pool, weights, k=n - len(out)):
        if rng.random() < drop_rate:
            r = Request(r.kind, True, r.prompt, max(r.max_tokens, 64), None, drop_after=rng.randint(1, 8))
        out.append(r)
    return out


def alone_answers(model: str, pool: list[Request], n_ctx: int, threads: int) -> dict[Request, str]:
    import llama_cpp

    from eagle3_gguf.native import CACHE_TYPES

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, type_v=CACHE_TYPES["bf16"], verbose=False)
    try:
        return {r: answer_from_llama(llm, r) for r in pool}
    finally:
        llm.close()


def answer_from_llama(llm, r: Request) -> str:
    """The answer of a llama_cpp.Llama (plain or Eagle3Llama), consuming a stream like a client does."""
    kw = dict(max_tokens=r.max_tokens, stop=list(r.stop) if r.stop else None, stream=r.stream, **{
        "temperature": 0.0, "repeat_penalty": 1.0})
    if r.kind == "chat":
        out = llm.create_chat_completion([{"role": "user", "content": r.prompt}], **kw)
        if r.stream:
            return "".join(c["choices"][0]["delta"].get("content") or "" for c in _take(out, r.drop_after))
        return out["choices"][0]["message"]["content"]
    out = llm.create_completion(r.prompt, **kw)
    if r.stream:
        return "".join(c["choices"][0]["text"] for c in _take(out, r.drop_after))
    return out["choices"][0]["text"]


def _take(chunks, drop_after: int):
    """All chunks, or only the first drop_after (then the generator is closed, as a dropped client's is)."""
    if not drop_after:
        yield from chunks
        return
    for i, c in enumerate(chunks):
        yield c
        if i + 1 >= drop_after:
            break
    chunks.close()


# ------------------------------------------------------------------------------------------------
# Resources of a process
# ------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    done: int  # requests finished
    seconds: float
    rss_mib: float  # as the system sees it
    held_mib: float  # after glibc's malloc_trim(0): memory the process holds, freed heap pages given back
    fds: int
    threads: int


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def sample(pid: int, done: int, t0: float) -> Sample:
    """The process's resources now. For this process (llama mode) `held_mib` is measured after a full garbage
    collection and a heap trim;
    the server trims after every request itself (eagle3_gguf.server.trim_heap), so there both are the same."""
    rss = _rss_mib(pid)
    held = rss
    if pid == os.getpid():
        from eagle3_gguf.server import trim_heap

        gc.collect()  # garbage in reference cycles waits for the next full collection; count only what is live
        trim_heap()
        held = _rss_mib(pid)
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(status.split("Threads:")[1].split()[0])
    return Sample(done, round(time.monotonic() - t0, 2), round(rss, 2), round(held, 2),
                  len(os.listdir(f"/proc/{pid}/fd")), threads)


# ------------------------------------------------------------------------------------------------
# Clients
# ------------------------------------------------------------------------------------------------

def ask_server(port: int, alias: str, r: Request) -> str:
    path = "/v1/chat/completions" if r.kind == "chat" else "/v1/completions"
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=600)) as c:
        c.request("POST", path, body=json.dumps({"model": alias, **r.body()}),
                  headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        if not r.stream:
            out = json.loads(resp.read())
            choice = out["choices"][0]
            return choice["message"]["content"] if r.kind == "chat" else choice["text"]
        parts, n = [], 0
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            parts.append((choice.get("delta") or {}).get("content") or "" if r.kind == "chat" else choice["text"])
            n += 1
            if r.drop_after and n >= r.drop_after:
                c.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
                break
        return "".join(parts)


@dataclass
class Report:
    mode: str
    model: str
    draft: str
    requests: int
    compared: int
    dropped: int
    equal: int
    mismatches: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    completion_chars: int = 0
    seconds: float = 0.0
    rss_warm_mib: float = 0.0  # held memory (see Sample): the lowest sample of the first half after warm-up
    # (rss_end_mib: of the second half)
    rss_end_mib: float = 0.0
    rss_max_after_warm_mib: float = 0.0
    rss_growth: float = 0.0  # (end - warm) / warm, of held memory: the pass criterion
    raw_rss_warm_mib: float = 0.0  # RSS as the system saw it before each trim
    raw_rss_end_mib: float = 0.0
    raw_rss_max_after_warm_mib: float = 0.0
    fds_warm: int = 0
    fds_end: int = 0
    threads_warm: int = 0
    threads_end: int = 0
    samples: list[Sample] = field(default_factory=list)
    passed: bool = False


def run_requests(reqs: list[Request], answer, want: dict[Request, str], pid: int, clients: int, n_warm: int,
                 every: int, report: Report) -> None:
    """Send reqs through `answer(r) -> str` from `clients` threads, sampling process `pid`; the baseline is
    taken after the first n_warm requests. A sample waits for the requests in flight to finish (the clients
    pause meanwhile), so what they hold for the moment (several at once with serve --parallel) is not
    counted as memory held."""
    cond = threading.Condition()
    todo = list(enumerate(reqs))
    todo.reverse()
    t0 = time.monotonic()
    state = {"done": 0, "busy": 0, "sample_due": False}
    report.samples.append(sample(pid, 0, t0))

    def worker() -> None:
        while True:
            with cond:
                while state["sample_due"]:
                    if state["busy"] == 0:
                        report.samples.append(sample(pid, state["done"], t0))
                        state["sample_due"] = False
                        cond.notify_all()
                    else:
                        cond.wait()
                if not todo:
                    return
                i, r = todo.pop()
                state["busy"] += 1
            try:
                got = answer(r)
                err = None
            except Exception as e:  # recorded; the soak fails on any
                got, err = None, f"request {i} {r}: {type(e).__name__}: {e}"
            with cond:
                if err is not None:
                    report.errors.append(err)
                elif r.drop_after:
                    report.dropped += 1
                else:
                    report.compared += 1
                    report.completion_chars += len(got)
                    if got == want[r]:
                        report.equal += 1
                    elif len(report.mismatches) < 10:
                        report.mismatches.append({"request": asdict(r), "got": got, "want": want[r]})
                state["busy"] -= 1
                state["done"] += 1
                done = state["done"]
                if done == n_warm or done % every == 0 or done == len(reqs):
                    state["sample_due"] = True
                cond.notify_all()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.seconds = round(time.monotonic() - t0, 1)
    after = [s for s in report.samples if s.done >= n_warm]
    warm, end = after[:3], after[-3:]  # medians of three samples: fds and threads come and go between samples
    # memory: the floor (lowest sample) of each half after warm-up: a leak lifts the floor, a swing between
    # samples (garbage waiting for a collection, caches filling) does not.
    first, second = after[:max(1, len(after) // 2)], after[len(after) // 2:]

    def median(samples: list[Sample], what: str) -> float:
        return sorted(getattr(s, what) for s in samples)[len(samples) // 2]

    def floor(samples: list[Sample], what: str) -> float:
        return min(getattr(s, what) for s in samples)

    report.rss_warm_mib, report.rss_end_mib = floor(first, "held_mib"), floor(second, "held_mib")
    report.rss_max_after_warm_mib = max(s.held_mib for s in after)
    report.rss_growth = round((report.rss_end_mib - report.rss_warm_mib) / report.rss_warm_mib, 4)
    report.raw_rss_warm_mib, report.raw_rss_end_mib = floor(first, "rss_mib"), floor(second, "rss_mib")
    report.raw_rss_max_after_warm_mib = max(s.rss_mib for s in after)
    report.fds_warm, report.fds_end = median(warm, "fds"), median(end, "fds")
    report.threads_warm, report.threads_end = median(warm, "threads"), median(end, "threads")


def soak_serve(args, reqs, want, report: Report) -> None:
    port = free_port()
    alias = "soak"
    cmd = [sys.executable, "-m", "eagle3_gguf.cli.main", "serve", "-m", args.model, "--draft", args.draft, "--port",
           str(port), "-c", str(args.ctx * args.parallel), "-t", str(args.threads), "--alias", alias,
           "--parallel", str(args.parallel)]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_ready(proc, port, timeout=180.0, log=Path(args.server_log) if args.server_log else None)
        run_requests(reqs, lambda r: ask_server(port, alias, r), want, proc.pid, args.clients, args.n_warm,
                     args.sample_every, report)
        if proc.poll() is not None:
            report.errors.append(f"the server died (exit {proc.returncode})")
    finally:
        stop(proc)
        if log is not subprocess.DEVNULL:
            log.close()


def soak_llama(args, reqs, want, report: Report) -> None:
    from eagle3_gguf.llama import Eagle3Llama

    llm = Eagle3Llama(model_path=args.model, draft_model_path=args.draft, n_ctx=args.ctx, n_threads=args.threads,
                      n_threads_batch=args.threads, verbose=False)
    try:
        run_requests(reqs, lambda r: answer_from_llama(llm, r), want, os.getpid(), 1, args.n_warm, args.sample_every,
                     report)
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["serve", "llama"])
    p.add_argument("-m", "--model", help="target GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="head GGUF (default: the shipped head)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=4, help="concurrent HTTP clients (serve)")
    p.add_argument("--parallel", type=int, default=1, help="serve --parallel: slots of -c tokens each (serve)")
    p.add_argument("-c", "--ctx", type=int, default=384)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drop-rate", type=float, default=0.03, help="share of streams dropped part way")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the requests before the RSS baseline (at least "
                   "one pass over the distinct requests)")
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--server-log", help="write the server's stderr here (serve)")
    p.add_argument("--json", help="write the report (with every sample) here")
    args = p.parse_args(argv)
    if args.model is None or args.draft is None:
        from eagle3_gguf.assets import default_head_path, smollm2_path

        args.model = args.model or str(smollm2_path())
        args.draft = args.draft or str(default_head_path())
    pool = request_pool(args.seed, args.ctx)
    reqs = draw(pool, args.requests, args.seed, args.drop_rate)
    args.n_warm = min(len(reqs), max(len(pool), int(args.warmup * len(reqs))))
    t0 = time.monotonic()
    want = alone_answers(args.model, pool, args.ctx, args.threads)
    print(f"{len(pool)} distinct requests answered alone in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    report = Report(args.mode, args.model, args.draft, len(reqs), 0, 0, 0)
    (soak_serve if args.mode == "serve" else soak_llama)(args, reqs, want, report)
    # serve: the server's worker threads and connections come and go with how requests overlap (a leak grows
    # with the requests; a full test run once ended 100 requests with 9 threads against 7 warm)
    slack = 2 if args.mode == "serve" else 0
    report.passed = (not report.errors and report.equal == report.compared
                     and report.compared + report.dropped == len(reqs)
                     and abs(report.rss_growth) <= args.rss_tolerance
                     and report.fds_end <= report.fds_warm + slack
                     and report.threads_end <= report.threads_warm + slack)
    summary = {k: v for k, v in asdict(report).items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", "scripts/soak.py", *(argv or sys.argv[1:])]),
                                               **asdict(report)}, indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
