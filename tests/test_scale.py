"""Issue 54: the replayed head (scripts/replay.py) keeps its stated acceptance through the real verification, and
the lent call's dry run (scripts/gpu_scale.sh --dry-run: synthetic tiny models, scripts/bench_scale.py) writes the
table and JSON the GPU run will."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench_scale
import exact_variants
import replay
import synthetic
from eagle3_gguf.decode import GenerateConfig, Runner
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.pair import PairConfig, load_pair
from eagle3_gguf.costs import CostCurve

ROOT = Path(__file__).resolve().parent.parent
VLLM = replay.PROFILES["vllm-8b"]
N_PREDICT = 160
made_pairs: list[synthetic.Made] = []  # the pair fixture's files (test_a_budget_... measures them again)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm2_path):
    made = synthetic.make_pair(tmp_path_factory.mktemp("scale"), "tiny", "q4_0", smollm2_path, jobs=2)
    made_pairs.append(made)
    # probes and cost curves of their own; one thread: two on two busy cores spin at llama.cpp's barriers
    with pytest.MonkeyPatch.context() as mp, \
            load_pair(made.target, made.head, PairConfig(n_ctx=1024, n_threads=1, n_seq_max=9)) as p:
        mp.setenv("EAGLE3_GGUF_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield p


@pytest.fixture(scope="module")
def prompts(pair):
    """Four prompts and target-only's continuation of each: (prompt, its truth)."""
    out = []
    with Runner(pair.target) as plain:
        for p in bench_scale.prompt_tokens(Path(pair.target_model.path), 4, 24, seed=5):
            out.append((p, p + plain.generate(p, GenerateConfig(n_predict=N_PREDICT), speculative=False).tokens))
    return out


def replayed(pair, prompts, config: GenerateConfig, profile=VLLM, costs: CostCurve | None = None, resync=None):
    """Every prompt run with a ReplaySession on `profile`: (results, their truths)."""
    out = []
    with replay.ReplaySession(pair.target, pair.head, truth=[], profile=profile, resync=resync) as s, \
            Runner(pair.target, s) as dec:
        if costs is not None:
            dec.spec.costs = costs
        for i, (p, truth) in enumerate(prompts):
            s.replay(truth, seed=i)
            out.append((dec.generate(p, config), s.resyncs))
    return out


def conditional(runs) -> tuple[list[float], list[int]]:
    """P(draft i kept | drafts before it kept) over all runs, and the trials at each position."""
    drafted = [sum(r.stats.drafted_by_pos[i] for r, _ in runs) for i in range(len(runs[0][0].stats.drafted_by_pos))]
    kept = [sum(r.stats.accepted_by_pos[i] for r, _ in runs) for i in range(len(drafted))]
    trials = [drafted[0]] + [min(d, k) for d, k in zip(drafted[1:], kept)]
    return [k / n if n else 0.0 for k, n in zip(kept, trials)], trials


def test_profiles():
    assert VLLM.tau(4) == pytest.approx(3.09, abs=0.005)  # 1 + .8 + .6 + .42 + .273
    assert replay.PROFILES["shipped"].tau(4) == pytest.approx(1.69, abs=0.01)
    assert replay.parse_profile("0.5/0.25").chain == (0.5, 0.25) and replay.parse_profile("0.5").p(7) == 0.5
    for bad in ("fast", "0.5/1.5", ""):
        with pytest.raises(Eagle3Error):
            replay.parse_profile(bad)


def test_chains_keep_the_profile_and_the_text(pair, prompts):
    """Fixed K=4: each position kept at the profile's conditional rate (within 4 sigma), tau near 3.09, every text
    target-only's: the target verified every draft."""
    runs = replayed(pair, prompts, GenerateConfig(n_predict=N_PREDICT, draft_policy="fixed", draft_max=4))
    assert all(r.tokens == truth[len(p):] for (r, _), (p, truth) in zip(runs, prompts))
    rates, trials = conditional(runs)
    for i, (rate, n) in enumerate(zip(rates, trials)):
        p = VLLM.p(i)
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n) + 0.01, (i, rate, n)
    cycles = sum(r.stats.n_target_forwards - 1 for r, _ in runs)
    tau = sum(r.stats.n_generated - 1 for r, _ in runs) / cycles
    assert abs(tau - VLLM.tau(4)) < 4 * 1.5 / math.sqrt(cycles)  # a cycle's tokens vary by 1.49 at this profile


def test_every_contender_meets_the_same_easy_and_hard_positions(pair, prompts):
    """A replay's draw belongs to a target position, not to the order of draws: fixed K=2 and K=4 runs of the same
    prompt and seed propose the same first draft wherever both draft from the same position (so contenders' ratios
    compare them on the same luck), and tokens after a draft the judge cut do not shift the draws."""
    class Recording(replay.ReplaySession):
        def draft(self, id_last, n_max, judge=None, p_min=0.0, sampler=None, n_alt=0, native=None):
            out = super().draft(id_last, n_max, judge, p_min, sampler, n_alt, native)
            self.first[self.pending_pos + self.shift + 2] = out.tokens[:1]  # the first draft's target position
            return out

    seen = []
    for k in (2, 4):
        with Recording(pair.target, pair.head, truth=[], profile=VLLM) as s, Runner(pair.target, s) as dec:
            s.first = {}
            for i, (p, truth) in enumerate(prompts[:2]):
                s.replay(truth, seed=i)
                dec.generate(p, GenerateConfig(n_predict=N_PREDICT, draft_policy="fixed", draft_max=k))
                seen.append((k, i, dict(s.first)))
                s.first.clear()
    for i in range(2):
        two, four = (f for k, j, f in seen if j == i)
        common = set(two) & set(four)
        assert len(common) >= 10 and all(two[q] == four[q] for q in common)
        assert any(two[q] != [prompts[i][1][q]] for q in common)  # some positions are wrong for both


def test_trees_keep_runner_ups_and_the_text(pair, prompts):
    """EAGLE-2's tree: a runner-up is right where the likeliest token is not, at the profile's rate: some cycles
    keep a branch; the text stays target-only's."""
    config = GenerateConfig(n_predict=N_PREDICT, draft_policy="fixed", draft_max=4, draft_topk=4, draft_nodes=8)
    runs = replayed(pair, prompts, config, replay.Profile("branchy", (0.6,), (0.9,)))
    assert all(r.tokens == truth[len(p):] for (r, _), (p, truth) in zip(runs, prompts))
    assert sum(r.stats.tree_branch_kept for r, _ in runs) > 0
    assert sum(r.stats.n_accepted for r, _ in runs) > sum(r.stats.n_drafted for r, _ in runs) * 0.3


def test_the_adaptive_policy_drafts_for_a_calibrated_head_where_rows_are_cheap(pair, prompts):
    """With a GPU's cost curve (17 rows cost about one) and the head reporting the profile as its confidence, the
    default policy drafts, with runner-ups beside its chains, and keeps what the profile says."""
    one = 0.01
    costs = CostCurve([one * (1 + 0.02 * n) for n in range(17)], 0.05 * one, 0.05 * one, "given", frozen=True)
    runs = replayed(pair, prompts, GenerateConfig(n_predict=N_PREDICT, draft_topk=4, draft_nodes=8), costs=costs)
    assert all(r.tokens == truth[len(p):] for (r, _), (p, truth) in zip(runs, prompts))
    drafted = sum(r.stats.n_drafted - r.stats.lookup_drafted for r, _ in runs)
    assert drafted > 3 * N_PREDICT  # it drafts nearly every cycle, several tokens each
    rates, trials = conditional(runs)
    assert abs(rates[0] - VLLM.p(0)) < 4 * math.sqrt(0.16 / trials[0]) + 0.05


def test_a_text_that_parts_from_the_truth_is_followed_again(pair, prompts):
    """Where the run's text leaves the truth (as at a GPU's near-tie), the replay asks target-only's text after it
    and goes on at the profile."""
    config = GenerateConfig(n_predict=N_PREDICT, draft_policy="fixed", draft_max=4)
    bent = []
    for p, truth in prompts:
        wrong = list(truth)
        at = len(p) + 20
        wrong[at:] = [(t + 7) % pair.target_model.n_vocab for t in truth[at:]]  # a truth that parts at token 20
        bent.append((p, wrong))
    resync = bench_scale.Resync(pair, 1024, 1)
    asked: list[int] = []

    def counted(tokens: list[int], n: int) -> list[int]:
        asked.append(n)
        return resync(tokens, n)
    try:
        runs = replayed(pair, bent, config, resync=counted)
    finally:
        resync.close()
    assert all(r.tokens == truth[len(p):] for (r, _), (p, truth) in zip(runs, prompts))
    assert all(n >= 1 for _, n in runs)
    # target-only's text after a part is asked as the run reads it, a chunk at a time, not all of the rest at once
    assert max(asked) == replay.RESYNC_CHUNK and len(asked) > sum(n for _, n in runs)
    rates, _ = conditional(runs)
    assert rates[0] > 0.6  # without the resync nothing after token 20 would be kept


def test_the_policy_learns_the_heads_time_not_the_replays(pair, prompts):
    """A resync (target-only's text decoded on a second context, ~130 ms at 8B's shape) runs inside the replay's
    draft: the run's statistics keep that time (a benchmark takes it out), the policy must not learn it as the
    draft's cost. On the H200 it did, and the default stopped drafting after the first resync (9 of 628 cycles)."""
    bent = []
    for p, truth in prompts:
        wrong = list(truth)
        wrong[len(p) + 20:] = [(t + 7) % pair.target_model.n_vocab for t in truth[len(p) + 20:]]
        bent.append((p, wrong))
    resync = bench_scale.Resync(pair, 1024, 1)

    def slow(tokens: list[int], n: int) -> list[int]:
        time.sleep(0.2)
        return resync(tokens, n)
    # a curve of nearly free verify rows, learning from the run's timings
    curve = CostCurve([0.01, 0.0105, 0.011, 0.0115, 0.012], 0.0005, 0.0005, "given")
    try:
        runs = replayed(pair, bent, GenerateConfig(n_predict=N_PREDICT), costs=curve, resync=slow)
    finally:
        resync.close()
    assert all(n >= 1 and r.stats.t_draft >= 0.2 for r, n in runs)  # the run's statistics keep the resyncs
    # what the policy learnt a drafting cycle's fixed cost to be, in rows: 1-2 here; with the resyncs learnt 100-200
    assert all(r.stats.policy.draft_fixed_cost < 20.0 for r, _ in runs)
    assert all(r.stats.policy.draft_step_cost < 20.0 for r, _ in runs)  # nor as a draft step's


def test_the_frozen_default_prices_cycles_as_the_physics_measured():
    """FROZEN's curve is the physics' (seconds from milliseconds), switch included, and learns no timing."""
    ph = bench_scale.Physics([4.0, 5.0, 6.0], 0.5, 0.25, 1.0, 1, 3, 0.1, 0.2, capture_ms=0.75)
    curve = bench_scale.frozen_curve(ph)
    assert curve.verify_s == [0.004, 0.005, 0.006] and curve.draft_step_s == 0.0005 and curve.draft_fixed_s == 0.00025
    assert curve.switch_s == 0.001 and curve.capture_s == 0.00075 and curve.frozen and curve.source == "given"
    curve.observe_verify(2, 1.0)
    assert curve.verify(2) == 0.005


def test_the_bound_is_the_best_chain_on_the_curve():
    """At vllm-8b (tau 1.8 at K=1, 2.4 at K=2) on a 4 / 5 / 6 ms curve: free, K=2 gives 2.4 x 4 / 6; at a 0.5 ms
    step and a 0.25 ms catch-up, 2.4 x 4 / 7.25 beats K=1's 1.8 x 4 / 5.75."""
    ph = bench_scale.Physics([4.0, 5.0, 6.0], 0.5, 0.25, 1.0, 1, 3, 0.1, 0.2)
    b = bench_scale.bound(ph, VLLM)
    assert (b.free_k, b.head_k) == (2, 2)
    assert abs(b.free - 2.4 * 4 / 6) < 1e-9 and abs(b.head - 2.4 * 4 / 7.25) < 1e-9
    dear = bench_scale.bound(bench_scale.Physics([4.0, 8.0, 12.0], 0.5, 0.25, 1.0, 1, 3, 0.1, 0.2), VLLM)
    assert (dear.free, dear.free_k, dear.head, dear.head_k) == (1.0, 0, 1.0, 0)  # no draft pays: target-only


def test_the_benchmark_drafts_with_the_head_type_convert_writes():
    from eagle3_gguf.convert.convert import DEFAULT_OUTTYPE

    assert bench_scale.HEAD_TYPES[0] == DEFAULT_OUTTYPE
    assert f"head_types={','.join(bench_scale.HEAD_TYPES)}\n" in (ROOT / "scripts" / "gpu_scale.sh").read_text()


def test_bench_scale_refuses_bad_inputs_in_one_line():
    for argv in (["--shapes", "huge:q4_k_m"], ["--target", "x.gguf"], ["--profiles", "0.5/2"], ["-n", "2"],
                 ["--head-types", "q8_0,q8_0"], ["--head-types", "q5_1"], ["--emulate", "results.json"],
                 ["--emulate", "bench/scale-gpu/results.json:tiny:q4_0"], ["--emulate-slowdown", "2"],
                 ["--emulate", "bench/scale-gpu/results.json:llama-8b:q4_0", "--emulate-slowdown", "0.5"]):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), *argv],
                           capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_a_budget_ends_the_run_with_what_finished(pair, tmp_path):
    """--budget: the first prompt runs however short the budget, no prompt starts past it, a shape that would not
    reach its first prompt is not begun; results.md says how many prompts were measured and why not more."""
    made = made_pairs[0]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_scale.py"), "--tiny", "--work",
                        str(made.target.parent), "--shapes", "tiny:q4_0,tiny:q4_k_m", "--profiles", "vllm-8b",
                        "--budget", "0.001", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny q4_k_m: not measured" in r.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    [shape] = data["shapes"]
    assert shape["prompts"] == 1 and shape["stopped"] == "time limit: 1 of 4 prompts measured"
    assert all(len(o["speedup"]) == 1 for o in shape["outcomes"])
    assert "- prompts measured: 1 (time limit: 1 of 4 prompts measured)" in (tmp_path / "results.md").read_text()


def test_the_lent_calls_scripts_load_llama_cpp_before_numpy():
    """On the lent GPU's image a process that loaded numpy before llama.cpp's library segfaulted at model load."""
    for script in ("bench_scale.py", "bench_parallel.py"):
        r = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "scripts" / script), "--help"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        done = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
        assert done.index("llama_cpp.llama_cpp") < done.index("numpy"), script


def test_the_pack_and_the_image_hold_what_the_lent_call_imports():
    """The lent machine's image (pack_scale.IMAGE_HAS) and the wheels the pack carries cover what llama-cpp-python,
    gguf and eagle3-gguf require (llama-cpp-python itself is built there)."""
    import pack_scale
    from importlib import metadata
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    have = {canonicalize_name(n) for n in (*pack_scale.IMAGE_HAS, *pack_scale.WHEELS, "llama-cpp-python")}
    for dist in ("eagle3-gguf", "llama-cpp-python", *pack_scale.WHEELS):
        for text in metadata.requires(dist) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                assert canonicalize_name(req.name) in have, f"{dist} requires {req.name}: add it to WHEELS"


def test_the_cuda_build_travels_with_each_library_once(tmp_path, monkeypatch):
    """cuda_wheel.pack_tree keeps llama_cpp/ and its dist-info from the wheel, each library's bytes once under its
    longest name and its other names symlinks to it; the wheel's top-level lib/ stays behind. Unpacked as the lent
    call unpacks it (tar -xJf), every name reads the library's bytes."""
    import tarfile
    import zipfile

    import cuda_wheel

    lib, other = os.urandom(4096), os.urandom(1024)
    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llama_cpp/__init__.py", "__version__ = '0.3.36'\n")
        for name in ("libggml-cuda.so", "libggml-cuda.so.0", "libggml-cuda.so.0.25.3"):
            z.writestr(f"llama_cpp/lib/{name}", lib)
            z.writestr(f"lib/{name}", lib)
        z.writestr("llama_cpp/lib/libllama.so.0.5.0", other)
        z.writestr("llama_cpp_python-0.3.36.dist-info/METADATA", "Name: llama_cpp_python\nVersion: 0.3.36\n")
    monkeypatch.setattr(cuda_wheel, "OUT", tmp_path)
    tree = cuda_wheel.pack_tree(wheel)
    with tarfile.open(tree) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"llama_cpp/__init__.py", "llama_cpp/lib/libggml-cuda.so", "llama_cpp/lib/libggml-cuda.so.0",
                            "llama_cpp/lib/libggml-cuda.so.0.25.3", "llama_cpp/lib/libllama.so.0.5.0",
                            "llama_cpp_python-0.3.36.dist-info/METADATA"}
    assert members["llama_cpp/lib/libggml-cuda.so.0.25.3"].isfile()
    assert all(members[f"llama_cpp/lib/{n}"].issym() and members[f"llama_cpp/lib/{n}"].linkname ==
               "libggml-cuda.so.0.25.3" for n in ("libggml-cuda.so", "libggml-cuda.so.0"))
    site = tmp_path / "site"
    site.mkdir()
    subprocess.run(["tar", "-xJf", str(tree), "-C", str(site)], check=True)
    assert all((site / "llama_cpp" / "lib" / n).read_bytes() == lib
               for n in ("libggml-cuda.so", "libggml-cuda.so.0", "libggml-cuda.so.0.25.3"))
    assert (site / "llama_cpp" / "lib" / "libllama.so.0.5.0").read_bytes() == other


def test_a_built_cuda_wheel_is_kept_for_the_next_clone(tmp_path, monkeypatch, capsys):
    """cuda_wheel.py keeps its TREE and BUILT in the pin's cache folder once built; a later run (another clone's .gpu,
    empty) copies them instead of building, byte for byte, and a run of a changed script does not take them."""
    import zipfile

    import cuda_wheel

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["cuda_wheel.py"])
    monkeypatch.setattr(cuda_wheel, "OUT", tmp_path / "clone1")
    builds = []

    def build(_cu):
        builds.append(cuda_wheel.OUT)
        cuda_wheel.OUT.mkdir()
        wheel = cuda_wheel.OUT / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llama_cpp/lib/libggml-cuda.so", os.urandom(2048))
        (cuda_wheel.OUT / cuda_wheel.BUILT).write_text("the pin, CUDA 13.0.88, sm_90-real\n")
        return wheel

    monkeypatch.setattr(cuda_wheel, "toolkit", lambda: tmp_path)
    monkeypatch.setattr(cuda_wheel, "build", build)
    assert cuda_wheel.main() == 0
    assert "kept in" in capsys.readouterr().out
    tree = (tmp_path / "clone1" / cuda_wheel.TREE).read_bytes()
    assert (cuda_wheel.kept() / cuda_wheel.TREE).read_bytes() == tree
    assert not list(cuda_wheel.kept().glob(".*.part"))

    monkeypatch.setattr(cuda_wheel, "OUT", tmp_path / "clone2")
    assert cuda_wheel.main() == 0
    assert builds == [tmp_path / "clone1"]  # the second clone built nothing
    assert (tmp_path / "clone2" / cuda_wheel.TREE).read_bytes() == tree
    assert (tmp_path / "clone2" / cuda_wheel.BUILT).read_text() == "the pin, CUDA 13.0.88, sm_90-real\n"
    assert "the build kept in" in capsys.readouterr().out

    script = tmp_path / "cuda_wheel.py"  # the same script, one byte changed: another recipe, another key
    script.write_bytes(Path(cuda_wheel.__file__).read_bytes() + b"\n")
    monkeypatch.setattr(cuda_wheel, "__file__", str(script))
    assert cuda_wheel.restore() is None


def test_the_lent_calls_dry_run(tmp_path, smollm2_path):
    """The GPU call's very script on this CPU: it makes the tiny models, runs the benchmark and writes results.md and
    results.json: a cost curve of 17 rows, the exact widths, every text target-only's, drafts kept at the profile."""
    pack = tmp_path / "pack"
    pack.mkdir()
    synthetic.write_vocab(pack / "smollm2-vocab.gguf", smollm2_path)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SCALE_PACK": str(pack), "PYTHON": sys.executable,
           "EAGLE3_GGUF_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_scale.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    back = sorted(str(f.relative_to(out)) for f in out.rglob("*") if f.is_file())  # a lent call brings 8 files back
    assert back == ["exact-variants.md", "profile-tiny-q4_k_m.txt", "results.json", "results.md", "scale.log"]
    profiled = (out / "profile-tiny-q4_k_m.txt").read_text().split("\n## ")  # the first shape's one more prompt
    assert [part.splitlines()[0] for part in profiled[1:]] == ["target-only", "vllm-8b | adaptive (default)",
                                                               "vllm-8b | fixed K=4"]
    assert all("context.py" in part and "(_call)" in part for part in profiled[1:]) and "session.py" in profiled[3]
    variants = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in
                (out / "exact-variants.md").read_text().splitlines() if line.startswith("| ") and "---" not in line}
    assert list(variants) == ["variant", *(v.name for v in exact_variants.VARIANTS)]  # the first shape's target
    assert variants[exact_variants.VARIANTS[-1].name][0] == "1..17 of 1..17"  # n_ubatch 1: every row alone
    off = variants["flash attention off"]  # the attention products through sgemm from 2 rows
    assert off[0] == "1 of 1..17" and off[1].startswith("kq-0: MUL_MAT of F16 ") and off[1].endswith(" at depth 8")
    table = (out / "results.md").read_text()
    assert "## tiny q4_k_m on CPU" in table and "## tiny q4_0 on CPU" in table and "| vllm-8b | fixed K=4 |" in table
    data = json.loads((out / "results.json").read_text())
    assert [(s["shape"], s["qtype"]) for s in data["shapes"]] == [("tiny", "q4_k_m"), ("tiny", "q4_0")]
    for s in data["shapes"]:
        ph = s["physics"]
        assert len(ph["verify_ms"]) == 17 and all(t > 0 for t in ph["verify_ms"])
        assert ph["probed"] == 17 and 1 <= ph["exact_widths"] <= 17 and ph["draft_step_ms"] > 0 and ph["switch_ms"] >= 0
        assert (ph["parts_at"] != "") == (ph["exact_widths"] < 17)  # where the first inexact width parts, named
        types = ph["parts"].pop("head_types")  # the head's decoder in each type, the run's own first
        assert len(ph["parts"]) == 13 and all(ms > 0 for ms in ph["parts"].values())  # each graph timed, both orders
        # on a CPU the verify's graph runs inside llama_decode: llama_synchronize finds it done
        assert ph["parts"]["target_verify5_return_ms"] > ph["parts"]["target_verify5_wait_ms"]
        assert s["head_type"] == "q8_0" and [t["head_type"] for t in types] == list(bench_scale.HEAD_TYPES)
        assert all(t["decode_ms"] > 0 and t["mib"] > 0 for t in types)
        runs = {(o["profile"], o["contender"]): o for o in s["outcomes"]}
        assert {("", "target-only"), ("vllm-8b", "adaptive (default)"), ("vllm-8b", bench_scale.FROZEN),
                ("shipped", "tree 4x4x8")} <= set(runs)
        n = len(runs["", "target-only"]["speedup"])
        assert n == 4 and all(o["identical"] == n for key, o in runs.items() if "--exact off" not in key[1])
        if ph["exact_widths"] < 9:  # the probe caps the default's trees: speculating past it is measured beside
            assert len(runs["vllm-8b", "adaptive (default), --exact off"]["speedup"]) == n
        k2 = runs["vllm-8b", f"fixed K=2{bench_scale.IN_GRAPH}"]  # the head's tokens chosen in its graph
        assert ("vllm-8b", f"{bench_scale.GOAL_CONTENDER}{bench_scale.IN_GRAPH}") in runs and k2["tau"] > 1.5
        assert any(g.startswith("the curve bounds any chain at vllm-8b to ") for g in s["goals"])
        k4 = runs["vllm-8b", "fixed K=4"]
        assert abs(k4["acceptance"][0] - VLLM.p(0)) < 0.2 and k4["tau"] > 2.0 and k4["ceiling"] > 0
