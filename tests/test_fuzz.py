"""Seeded fuzzing of every format we read: GGUF headers and tensor tables (heads and targets), safetensors
headers, config.json, sharded indexes, d2t maps out of range; and heads whose geometry the eagle3 graph cannot run.

Each mutated input goes through the CLI in-process (typer's CliRunner: `info`, `convert`) and must end one
of two ways: exit 0 (the mutation left a valid file), or exit 2 with exactly one `error: ...` line on
stderr and no output or temporary file left behind — never a traceback, a hang or a partial file. Inputs
that reach llama.cpp's loader (`generate` on a mutated head, target or d2t map) run in one child process,
case after case, so that a GGML abort would show as that process dying (the Python checks in
gguf_file.py / pair.py have to stop every such file first)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT
from typer.testing import CliRunner

from checkpoints import write_checkpoint
from eagle3_gguf import keys
from eagle3_gguf.cli.main import app
from eagle3_gguf.gguf_file import KeyValue, read_gguf_metadata
from eagle3_gguf.speculator import MEASURING_COSTS, MEASURING_EXACT
from model_factory import HeadSpec, rewrite_gguf, write_random_head

SEED = 18
MAX_CASE_SECONDS = 20.0  # a hang shows as a case this slow
runner = CliRunner()


# ------------------------------------------------------------------------------------------------
# Where the structure of a GGUF lives (an independent parser: offsets of every structural field)
# ------------------------------------------------------------------------------------------------

@dataclass
class Field:
    offset: int
    size: int
    kind: str  # header | kv | array_len | element_len | tensor_info


_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(raw: bytes) -> tuple[list[Field], int]:
    """The structural fields of a valid GGUF and the end of its tensor table."""
    fields = [Field(0, 4, "header"), Field(4, 4, "header"), Field(8, 8, "header"), Field(16, 8, "header")]
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    pos = 24

    def string(kind: str) -> None:
        nonlocal pos
        fields.append(Field(pos, 8, kind))
        (n,) = struct.unpack_from("<Q", raw, pos)
        pos += 8 + n

    for _ in range(n_kv):
        string("kv")
        fields.append(Field(pos, 4, "kv"))
        (vtype,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if vtype == 8:
            string("kv")
        elif vtype == 9:
            fields.append(Field(pos, 4, "array_len"))
            fields.append(Field(pos + 4, 8, "array_len"))
            sub, n = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            if sub == 8:
                for _ in range(n):
                    string("element_len")
            else:
                if n <= 16:  # small arrays (target_layers): their values are structure too
                    fields += [Field(pos + i * _SCALAR_SIZE[sub], _SCALAR_SIZE[sub], "kv") for i in range(n)]
                pos += n * _SCALAR_SIZE[sub]
        else:
            fields.append(Field(pos, _SCALAR_SIZE[vtype], "kv"))
            pos += _SCALAR_SIZE[vtype]
    for _ in range(n_tensors):
        string("tensor_info")
        fields.append(Field(pos, 4, "tensor_info"))
        (n_dims,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        fields += [Field(pos + 8 * i, 8, "tensor_info") for i in range(n_dims)]
        pos += 8 * n_dims
        fields += [Field(pos, 4, "tensor_info"), Field(pos + 4, 8, "tensor_info")]
        pos += 12
    return fields, pos


def mutate_field(raw: bytes, f: Field, rng: random.Random) -> bytes:
    fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[f.size]
    (old,) = struct.unpack_from(fmt, raw, f.offset)
    top = 2 ** (8 * f.size) - 1
    new = rng.choice([0, 1, top, top >> 1, old ^ (1 << rng.randrange(8 * f.size)), (old + 1) & top,
                      (old - 1) & top, rng.randrange(top + 1), (old * 1000) & top, old + 7 & top])
    if new == old:
        new = old ^ 1
    out = bytearray(raw)
    struct.pack_into(fmt, out, f.offset, new)
    return bytes(out)


def gguf_mutants(raw: bytes, n: int, rng: random.Random) -> list[tuple[str, bytes]]:
    """n mutated copies: truncations, structural field rewrites (weighted towards the fields that are not
    token strings), and byte flips in the header."""
    fields, table_end = gguf_fields(raw)
    by_kind: dict[str, list[Field]] = {}
    for f in fields:
        by_kind.setdefault(f.kind, []).append(f)
    kinds = [k for k in ("header", "kv", "array_len", "element_len", "tensor_info") if k in by_kind]
    weights = {"header": 1, "kv": 3, "array_len": 1, "element_len": 1, "tensor_info": 4}
    out = []
    for i in range(n):
        r = i % 10
        if r < 2:
            cut = rng.choice([rng.randrange(1, table_end), rng.randrange(table_end, len(raw) - 1)])
            out.append((f"truncate@{cut}", raw[:cut]))
        elif r < 9:
            kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
            f = rng.choice(by_kind[kind])
            out.append((f"{kind}@{f.offset}", mutate_field(raw, f, rng)))
        else:
            b = bytearray(raw)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(table_end)] ^= 1 << rng.randrange(8)
            out.append(("byteflips", bytes(b)))
    return out


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------

def check_result(case: str, exit_code: int, stderr: str, output: str, leftovers: list[Path]) -> str:
    """'ok' or 'error' for a well-behaved outcome; an AssertionError naming the case otherwise."""
    assert "Traceback" not in output + stderr, f"{case}: traceback\n{output}{stderr}"
    if exit_code == 0:
        return "ok"
    assert exit_code == 2, f"{case}: exit {exit_code}\n{output}{stderr}"
    # what a first run measures is said before it (a head that fails there: the error follows the note)
    lines = [line for line in stderr.strip().splitlines() if line not in (MEASURING_EXACT, MEASURING_COSTS)]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: not one error line: {stderr!r}"
    assert not leftovers, f"{case}: left {leftovers}"
    return "error"


def run_cli(case: str, args: list[str], out_dir: Path | None = None) -> str:
    t0 = time.monotonic()
    res = runner.invoke(app, args)
    assert time.monotonic() - t0 < MAX_CASE_SECONDS, f"{case}: took {time.monotonic() - t0:.1f} s"
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"{case}: {type(res.exception).__name__}: {res.exception}") from res.exception
    leftovers = sorted(out_dir.iterdir()) if out_dir is not None and res.exit_code != 0 else []
    outcome = check_result(case, res.exit_code, res.stderr, res.stdout, leftovers)
    if out_dir is not None:
        for p in out_dir.iterdir():
            p.unlink()
    return outcome


# ------------------------------------------------------------------------------------------------
# GGUF: info in-process, llama.cpp loading in a child process
# ------------------------------------------------------------------------------------------------

CHILD = r"""
import json, sys
from typer.testing import CliRunner
from eagle3_gguf.cli.main import app
from eagle3_gguf.errors import Eagle3Error
runner = CliRunner()
for line in sys.stdin:
    case = json.loads(line)
    print(json.dumps({"case": case["name"], "start": True}), flush=True)
    if case.get("api") == "Eagle3Llama":
        from eagle3_gguf.llama import Eagle3Llama
        try:
            Eagle3Llama(model_path=case["target"], draft_model_path=case["head"], n_ctx=64, verbose=False).close()
            exit_code, stderr, exc = 0, "", None
        except Eagle3Error as e:
            exit_code, stderr, exc = 2, f"error: {e}\n", None
        except Exception as e:
            exit_code, stderr, exc = 1, "", repr(e)
    else:
        res = runner.invoke(app, ["generate", "-m", case["target"], "--draft", case["head"], "-p", "Hello", "-n", "4",
                                  "-c", "64", "-t", "1", "--draft-policy", "fixed"])
        exit_code, stderr = res.exit_code, res.stderr
        exc = None if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)
    print(json.dumps({"case": case["name"], "exit": exit_code, "stderr": stderr, "exception": exc}), flush=True)
"""


def load_in_child(cases: list[dict], timeout: float) -> list[dict]:
    """Run `generate` on each (target, head) pair in one child process (or construct Eagle3Llama on it, where
    the case says "api": "Eagle3Llama": an Eagle3Error reads as exit 2 and its line); fail if the child dies."""
    feed = "".join(json.dumps(c) + "\n" for c in cases)
    r = subprocess.run([sys.executable, "-c", CHILD], input=feed, capture_output=True, text=True, timeout=timeout)
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    done = [e for e in events if "exit" in e]
    if r.returncode != 0 or len(done) != len(cases):
        started = [e["case"] for e in events if e.get("start")]
        raise AssertionError(f"the child died (exit {r.returncode}) at case {started[-1] if started else None}: "
                             f"{r.stderr[-2000:]}")
    return done


def fuzz_gguf(path: Path, n: int, tmp: Path, rng: random.Random) -> tuple[dict[str, int], list[Path]]:
    """`info` on n mutants of `path`; returns the outcome counts and the mutants that passed (for loading)."""
    counts = {"ok": 0, "error": 0}
    passed = []
    for i, (name, data) in enumerate(gguf_mutants(path.read_bytes(), n, rng)):
        f = tmp / f"{path.stem}-{i}.gguf"
        f.write_bytes(data)
        outcome = run_cli(f"{path.name} {name}", ["info", str(f)])
        counts[outcome] += 1
        if outcome == "ok":
            passed.append(f)
        elif i % 7 == 0:
            passed.append(f)  # a sample of refused ones goes through generate too (refused before llama.cpp)
        if f not in passed:
            f.unlink()
    return counts, passed


def d2t_mutants(head: Path, tmp: Path, rng: random.Random, n: int) -> list[Path]:
    """Copies of a d2t head whose d2t map points outside the target vocabulary."""
    from eagle3_gguf.gguf_file import read_gguf_metadata

    meta = read_gguf_metadata(head)
    t = meta.tensor("d2t")
    count = t.shape[0]
    raw = head.read_bytes()
    out = []
    for i in range(n):
        values = np.frombuffer(raw, dtype="<i8", count=count, offset=t.offset).copy()
        j = rng.randrange(count)
        values[j] = rng.choice([-1, -2 ** 63, 49152, 49153, 2 ** 31, 2 ** 62, rng.randrange(49152, 2 ** 40)])
        b = bytearray(raw)
        b[t.offset:t.offset + 8 * count] = values.tobytes()
        f = tmp / f"d2t-{i}.gguf"
        f.write_bytes(bytes(b))
        out.append(f)
    return out


@pytest.mark.slow
def test_fuzz_gguf(tmp_path, tiny_target, tiny_head, tiny_head_d2t):
    """240 mutated heads and targets through `info`; those it accepts, a sample of those it refuses and
    d2t maps out of range through `generate` (llama.cpp's loader) in a child process."""
    rng = random.Random(SEED)
    head_counts, heads = fuzz_gguf(tiny_head_d2t, 120, tmp_path, rng)
    head2_counts, heads2 = fuzz_gguf(tiny_head, 50, tmp_path, rng)
    target_counts, targets = fuzz_gguf(tiny_target, 70, tmp_path, rng)
    d2t = d2t_mutants(tiny_head_d2t, tmp_path, rng, 12)
    cases = ([{"name": h.name, "target": str(tiny_target), "head": str(h)} for h in heads + heads2 + d2t]
             + [{"name": t.name, "target": str(t), "head": str(tiny_head)} for t in targets])
    results = load_in_child(cases, timeout=600)
    loaded = {"ok": 0, "error": 0}
    for r in results:
        assert r["exception"] is None, r
        loaded[check_result(r["case"], r["exit"], r["stderr"], "", [])] += 1
    d2t_names = {p.name for p in d2t}
    assert all(r["exit"] == 2 and "d2t" in r["stderr"] for r in results if r["case"] in d2t_names), results
    print(f"\ninfo: heads {head_counts} {head2_counts}, targets {target_counts}; generate: {loaded}")
    assert head_counts["error"] + head2_counts["error"] + target_counts["error"] >= 180


# ------------------------------------------------------------------------------------------------
# Head geometry: numbers the eagle3 graph cannot run, each one error line before llama.cpp sees them
# ------------------------------------------------------------------------------------------------

@dataclass
class GeometryCase:
    name: str
    head: Path
    line: str  # the one error line (after "error: ") a head like it must get


def geometry_mutants(tmp: Path, head: Path, head_d2t: Path, target: Path) -> list[GeometryCase]:
    """Heads whose numbers disagree with what the pinned eagle3 graph assumes, each with its error line. Without
    the checks in gguf_file.HeadGeometry / pair.check_pair, llama.cpp aborts on those marked "abort" (GGML_ASSERT:
    the process dies) and refuses the others with "could not load it"."""
    a = lambda template: keys.arch_key(template, keys.ARCH_EAGLE3)  # noqa: E731
    rng = np.random.default_rng(SEED)

    def kv(template: str, value, vtype: VT = VT.UINT32) -> dict[str, KeyValue]:
        return {a(template): KeyValue(a(template), value, vtype)}

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)  # numpy order: [rows, row length]

    def mutant(name: str, src: Path = head, **changes) -> Path:
        return rewrite_gguf(src, tmp / f"{name}.gguf", **changes)

    fix = "convert the head again"
    q, k, v = (keys.blk(t) for t in (keys.T_ATTN_Q, keys.T_ATTN_K, keys.T_ATTN_V))
    second_layer = {t.name.replace("blk.0.", "blk.1."): w(*reversed(t.shape))
                    for t in read_gguf_metadata(head).tensors if t.name.startswith("blk.0.")}
    narrow = write_random_head(tmp / "narrow.gguf", HeadSpec(64, (1, 3, 5), n_embd=32, n_head=2, n_head_kv=1),
                               tokenizer_from=target)
    cases = [  # (case, head, the line after "{head}: ")
        ("kv heads 3 (abort)", mutant("kv3", kvs=kv(keys.KEY_HEAD_COUNT_KV, 3), tensors={k: w(48, 128), v: w(48, 128)}),
         "4 attention heads are not a multiple of 3 KV heads, which llama.cpp's grouped-query attention needs "
         "(it aborts)"),
        ("value length 8 (abort)", mutant("vlen", kvs={**kv(keys.KEY_KEY_LENGTH, 16), **kv(keys.KEY_VALUE_LENGTH, 8)},
                                          tensors={v: w(16, 128)}),
         "value head size 8 differs from key head size 16; the pinned eagle3 graph needs them equal"),
        ("0 layers (abort)", mutant("blocks0", kvs=kv(keys.KEY_BLOCK_COUNT, 0)),
         "0 decoder layers; the pinned llama.cpp eagle3 graph runs exactly one"),
        ("2 layers (abort)", mutant("blocks2", kvs=kv(keys.KEY_BLOCK_COUNT, 2), tensors=second_layer),
         "2 decoder layers; the pinned llama.cpp eagle3 graph runs exactly one"),
        ("rope 18 dims (abort)", mutant("rot18", kvs=kv(keys.KEY_ROPE_DIMENSION_COUNT, 18)),
         "RoPE turns 18 dimensions of each 16-wide head; llama.cpp needs an even number, at most the head size "
         "(it aborts)"),
        ("rope 15 dims (abort)", mutant("rot15", kvs=kv(keys.KEY_ROPE_DIMENSION_COUNT, 15)),
         "RoPE turns 15 dimensions of each 16-wide head; llama.cpp needs an even number, at most the head size "
         "(it aborts)"),
        ("rope scaling type (abort)", mutant("ropetype", kvs=kv(keys.KEY_ROPE_SCALING_TYPE, "llama3", VT.STRING)),
         "RoPE scaling type 'llama3' is not one llama.cpp knows (none, linear, yarn, longrope)"),
        ("d2t I32 (abort)", mutant("d2t-i32", head_d2t, tensors={keys.T_D2T: np.zeros(512, dtype=np.int32)}),
         "d2t is I32 [512]; the eagle3 graph needs a non-empty 1-D I64 map"),
        ("token_embd 1000 rows (abort)", mutant("embd-rows", tensors={keys.T_TOKEN_EMBD: w(1000, 64)}),
         "tensor 'token_embd.weight' is [64, 1000], expected [64, 49152] = [hidden 64, vocab 49152]"),
        ("rope_freqs F16 (abort)", mutant("freqs-f16", tensors={keys.T_ROPE_FREQS: np.ones(8, dtype=np.float16)}),
         "rope_freqs.weight is F16; the eagle3 graph needs F32"),
        ("fc I32 (segfault)", mutant("fc-i32", tensors={keys.T_FC: np.zeros((64, 192), dtype=np.int32)}),
         "tensor 'fc.weight' is I32; the eagle3 graph's weights are floats or quantized blocks"),
        ("attn_q F64 (segfault)", mutant("q-f64", tensors={q: w(64, 128).astype(np.float64)}),
         "tensor 'blk.0.attn_q.weight' is F64; the eagle3 graph's weights are floats or quantized blocks"),
        ("q rows", mutant("q96", tensors={q: w(96, 128)}),
         "tensor 'blk.0.attn_q.weight' is [128, 96], expected [128, 64] = [2 x hidden 64, 4 heads x head_dim 16]"),
        ("kv heads 0", mutant("kv0", kvs=kv(keys.KEY_HEAD_COUNT_KV, 0)),
         "KV head count is 0; the eagle3 graph needs at least 1"),
        ("ffn width", mutant("ff96", kvs=kv(keys.KEY_FEED_FORWARD_LENGTH, 96)),
         "tensor 'blk.0.ffn_gate.weight' is [64, 128], expected [64, 96] = [hidden 64, feed-forward 96]"),
        ("fc input", mutant("fc190", tensors={keys.T_FC: w(64, 190)}),
         "tensor 'fc.weight' is [190, 64], expected [192, 64] = [3 target layers x target hidden 64, hidden 64]"),
        ("target hidden 96", mutant("tgt96", kvs=kv(keys.KEY_TARGET_HIDDEN_SIZE, 96)),
         "tensor 'fc.weight' is [192, 64], expected [288, 64] = [3 target layers x target hidden 96, hidden 64]"),
        ("d2t 500 vs lm_head 512", mutant("d2t500", head_d2t, tensors={
            keys.T_D2T: np.sort(rng.choice(49152, 500, replace=False)).astype(np.int64)}),
         "tensor 'output.weight' is [64, 512], expected [64, 500] = [hidden 64, draft vocab 500 (d2t)]"),
        ("no ffn_up", mutant("no-up", tensors={keys.blk(keys.T_FFN_UP): None}),
         "lacks tensor 'blk.0.ffn_up.weight', which the eagle3 graph needs"),
        ("norm_before_fc, no norm", mutant("nbf", kvs=kv(keys.KEY_NORM_BEFORE_FC, True, VT.BOOL)),
         "lacks tensor 'enc.output_norm.weight', which the eagle3 graph needs"),
        ("stray tensor", mutant("stray", tensors={"blk.0.attn_q_norm.weight": w(16)}),
         "tensor 'blk.0.attn_q_norm.weight' has no place in the eagle3 graph (llama.cpp refuses a file holding it)"),
    ]
    out = [GeometryCase(name, path, f"{path}: {line}: {fix}") for name, path, line in cases]
    borrow = f"but {target.name}'s are 64 wide: this head was trained for another model"
    out.append(GeometryCase("narrow head, borrowed token_embd (abort)", narrow,
                            f"narrow.gguf: head has hidden size 32 and no token_embd.weight (token embeddings) of "
                            f"its own, {borrow}"))
    for name, value in (("nan", float("nan")), ("negative", -1.0)):  # ggml_rms_norm asserts eps >= 0
        eps = mutant(f"eps-{name}", kvs=kv(keys.KEY_RMS_EPS, value, VT.FLOAT32))
        out.append(GeometryCase(f"rms epsilon {name} (abort)", eps,
                                f"{eps}: corrupt GGUF (metadata eagle3.attention.layer_norm_rms_epsilon is {value}, "
                                "where llama.cpp's norms need a finite epsilon of at least 0): download or convert it "
                                "again"))
    own_embd = mutant("narrow-own-embd", narrow, tensors={keys.T_TOKEN_EMBD: w(49152, 32)})
    out.append(GeometryCase("narrow head, borrowed lm_head (abort)", own_embd,
                            f"narrow-own-embd.gguf: head has hidden size 32 and no output.weight (lm_head) of its "
                            f"own, {borrow}"))
    return out


def test_head_geometry_refused_in_one_line(tmp_path, tiny_target, tiny_head, tiny_head_d2t):
    """Issue 52: every head geometry the eagle3 graph cannot run is refused by `generate` and by Eagle3Llama in one
    line (exit 2), never a GGML abort: all in one child process, which an abort would kill."""
    mutants = geometry_mutants(tmp_path, tiny_head, tiny_head_d2t, tiny_target)
    cases = [{"name": m.name, "target": str(tiny_target), "head": str(m.head)} for m in mutants]
    first = mutants[0]  # the issue's own: attention heads that are not whole groups of KV heads
    cases.append({"name": f"Eagle3Llama {first.name}", "target": str(tiny_target), "head": str(first.head),
                  "api": "Eagle3Llama"})
    expected = {m.name: m.line for m in mutants} | {f"Eagle3Llama {first.name}": first.line}
    key = keys.arch_key(keys.KEY_RMS_EPS, "llama")  # the target's norms too
    target = rewrite_gguf(tiny_target, tmp_path / "target-eps.gguf", kvs={key: KeyValue(key, -0.5, VT.FLOAT32)})
    cases.append({"name": "target rms epsilon -0.5 (abort)", "target": str(target), "head": str(tiny_head)})
    expected["target rms epsilon -0.5 (abort)"] = (f"{target}: corrupt GGUF (metadata {key} is -0.5, where llama.cpp's "
                                                   "norms need a finite epsilon of at least 0): download or convert "
                                                   "it again")
    for r in load_in_child(cases, timeout=300):
        assert r["exception"] is None, r
        assert (r["exit"], r["stderr"]) == (2, f"error: {expected[r['case']]}\n"), r


# ------------------------------------------------------------------------------------------------
# Checkpoints: convert in-process
# ------------------------------------------------------------------------------------------------

def _json_mutation(value, rng: random.Random):
    """A replacement for one JSON value: wrong types, extremes, nonsense."""
    return rng.choice([None, -1, 0, 2 ** 63, 10 ** 30, -(2 ** 40), 1.5, float("nan"), "x", "", [], {}, [1, 2], True,
                       [value], {"v": value}, [-1, -1], [0, 2 ** 62], "F32", "BF16", "Q4_0", 7])


def _paths_in(obj, prefix=()):
    """Every path (tuple of keys/indexes) into a JSON object."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths_in(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths_in(v, prefix + (i,))


def _set(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def _delete(obj, path):
    obj = json.loads(json.dumps(obj))
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    del cur[path[-1]]
    return obj


def json_mutants(text: str, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n mutated JSON texts: a value replaced or deleted, or the text truncated or byte-flipped."""
    obj = json.loads(text)
    paths = list(_paths_in(obj))
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.55:
            p = rng.choice(paths)
            cur = obj
            for k in p:
                cur = cur[k]
            out.append((f"set {'/'.join(map(str, p))}", json.dumps(_set(obj, p, _json_mutation(cur, rng)))))
        elif r < 0.75 and len(paths) > 1:
            p = rng.choice(paths[1:])
            out.append((f"delete {'/'.join(map(str, p))}", json.dumps(_delete(obj, p))))
        elif r < 0.9:
            cut = rng.randrange(len(text))
            out.append((f"truncate@{cut}", text[:cut]))
        else:
            b = bytearray(text.encode())
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(("byteflips", b.decode("utf-8", "replace") if rng.random() < 0.5 else b.decode("latin-1")))
    return out


def safetensors_header_mutants(path: Path, n: int, rng: random.Random) -> list[tuple[str, bytes]]:
    raw = path.read_bytes()
    (hn,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8:8 + hn].decode(), raw[8 + hn:]
    out = []
    for name, text in json_mutants(header, n - n // 5, rng):
        h = text.encode("utf-8", "surrogateescape")
        out.append((name, struct.pack("<Q", len(h)) + h + data))
    for i in range(n // 5):  # the length prefix itself, or a truncation in the header or the data
        if i % 2:
            cut = rng.randrange(1, len(raw))
            out.append((f"truncate@{cut}", raw[:cut]))
        else:
            b = bytearray(raw)
            struct.pack_into("<Q", b, 0, rng.choice([0, 1, hn - 1, hn + 1, 2 ** 63, rng.randrange(2 ** 64)]))
            out.append(("header length", bytes(b)))
    return out


def convert_case(case: str, src: Path, target: Path, out_dir: Path) -> str:
    return run_cli(case, ["convert", str(src), "--target", str(target), "-o", str(out_dir / "head.gguf")], out_dir)


@pytest.mark.slow
def test_fuzz_checkpoints(tmp_path, tiny_target):
    """~300 mutated checkpoints through `convert`: safetensors headers, config.json (all four layouts),
    sharded indexes, the target's HF config.json, and d2t maps out of range. The target is described by an HF
    config (no tokenizer to copy: the valid mutants convert in a tenth of the time); the d2t cases use the
    target GGUF."""
    rng = random.Random(SEED + 1)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target_cfg = tmp_path / "target" / "config.json"
    target_cfg.parent.mkdir()
    target_text = json.dumps({"model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 49152})
    target_cfg.write_text(target_text)
    counts: dict[str, dict[str, int]] = {}

    def tally(kind: str, outcome: str) -> None:
        counts.setdefault(kind, {"ok": 0, "error": 0})[outcome] += 1

    # safetensors headers
    src = write_checkpoint(tmp_path / "st", "safeai")
    good = (src / "model.safetensors").read_bytes()
    for name, data in safetensors_header_mutants(src / "model.safetensors", 80, rng):
        (src / "model.safetensors").write_bytes(data)
        tally("safetensors", convert_case(f"safetensors {name}", src, target_cfg, out_dir))
    (src / "model.safetensors").write_bytes(good)

    # the target's config.json
    for name, mutated in json_mutants(target_text, 30, rng):
        target_cfg.write_text(mutated, encoding="utf-8", errors="surrogateescape")
        tally("target config", convert_case(f"target config {name}", src, target_cfg, out_dir))
    target_cfg.write_text(target_text)

    # config.json, every layout
    for layout in ("safeai", "speculators", "modelopt", "specforge"):
        src = write_checkpoint(tmp_path / layout, layout)
        text = (src / "config.json").read_text()
        for name, mutated in json_mutants(text, 30, rng):
            (src / "config.json").write_text(mutated, encoding="utf-8", errors="surrogateescape")
            tally("config", convert_case(f"{layout} config {name}", src, target_cfg, out_dir))

    # sharded index
    src = write_checkpoint(tmp_path / "sharded", "speculators", fmt="sharded")
    index = src / "model.safetensors.index.json"
    text = index.read_text()
    for name, mutated in json_mutants(text, 40, rng):
        index.write_text(mutated, encoding="utf-8", errors="surrogateescape")
        tally("index", convert_case(f"index {name}", src, target_cfg, out_dir))

    # d2t offsets that land outside the target vocabulary
    src = write_checkpoint(tmp_path / "d2t", "safeai")
    f = src / "model.safetensors"
    good = f.read_bytes()
    (hn,) = struct.unpack("<Q", good[:8])
    entry = json.loads(good[8:8 + hn])["d2t"]
    begin, end = (8 + hn + x for x in entry["data_offsets"])
    for i in range(20):
        raw = bytearray(good)
        d2t = np.frombuffer(bytes(raw[begin:end]), dtype="<i8").copy()
        j = rng.randrange(d2t.size)
        d2t[j] = rng.choice([-j - 1, -(2 ** 62), 49152 - j, 2 ** 40, 2 ** 63 - 1])
        raw[begin:end] = d2t.tobytes()
        f.write_bytes(bytes(raw))
        outcome = convert_case(f"d2t[{j}] = {d2t[j]}", src, tiny_target if i % 2 else target_cfg, out_dir)
        assert outcome == "error", f"d2t[{j}] = {d2t[j]} was accepted"
        tally("d2t", outcome)

    print("\n" + json.dumps(counts))
    assert sum(c["error"] for c in counts.values()) >= 200
    assert list(out_dir.iterdir()) == []
