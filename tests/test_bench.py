"""`eagle3-gguf bench` and its library (eagle3_gguf/bench.py, benchreport.py): every contender's per-prompt runs in
--json, the plot, a user's prompts and pair, one-line errors, Ctrl-C keeping whole prompts, the ratio method, and
advice drawn from the figures. Nothing here depends on timings: the machine may be loaded."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eagle3_gguf import bench as lib
from eagle3_gguf.bench import PromptRun, Setup, per_prompt_ratio, whole_prompts
from eagle3_gguf.benchreport import Row, Spread, advice, summarize
from eagle3_gguf.cli import bench as cli_bench
from eagle3_gguf.cli.main import app

PNG = b"\x89PNG\r\n\x1a\n"
CONTENDERS = "default,k2,lookup,head,tree"


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def one_line_error(r, expected: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output)
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: {expected}"], r.stderr


@pytest.fixture(scope="module")
def user_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text('{"text": "Write a haiku about the sea.", "id": "sea"}\n\n"List three prime numbers."\n')
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory, tiny_target, tiny_head, user_prompts):
    """One bench run on the tiny pair: the user's two prompts and two edit prompts, every kind of contender."""
    png = tmp_path_factory.mktemp("plot") / "bench.png"
    r = invoke("-m", str(tiny_target), "--draft", str(tiny_head), "-f", str(user_prompts), "--workloads", "edit",
               "--limit", "2", "-n", "12", "--contenders", CONTENDERS, "--json", "--plot", str(png))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), png


def test_json_holds_every_contenders_runs_per_prompt(measured):
    out, _ = measured
    names = ["target", *CONTENDERS.split(",")]
    prompts = {("mine", "sea"), ("mine", "3"), ("edit", "HumanEval/0"), ("edit", "HumanEval/1")}
    runs = out["runs"]
    assert {(r["workload"], r["prompt_id"]) for r in runs} == prompts
    for w, pid in prompts:
        mine = [r for r in runs if (r["workload"], r["prompt_id"]) == (w, pid)]
        assert [r["contender"] for r in mine] == [*names, "target"]  # target-only first and last
        # greedy: every run after the first target-only run (the reference) gave its text
        assert [r["identical"] for r in mine] == [None] + [True] * (len(mine) - 1)
    assert all(r["tokens"] > 0 and r["seconds"] > 0 and r["forwards"] > 0 for r in runs)
    assert {(row["workload"], row["contender"]) for row in out["rows"]} == {(w, c) for w in ("mine", "edit")
                                                                            for c in names}
    assert all(row["identical"] == row["compared"] for row in out["rows"])
    setup = out["setup"]
    assert setup["target"] == "tiny-target.gguf" and setup["n_predict"] == 12
    assert set(setup["exact"]) == set(names[1:])
    assert setup["verify_cost"][0] == 1.0 and len(setup["verify_cost"]) >= 5
    assert out["advice"] and out["stopped"] == ""


def test_plot_is_a_png(measured):
    _, png = measured
    assert png.read_bytes()[:8] == PNG


def test_ctrl_c_keeps_the_prompts_measured_whole(tiny_target, tiny_head, user_prompts, monkeypatch):
    """Ctrl-C during the second prompt: the report holds the first prompt only, and the exit code is 130."""
    update = cli_bench.Progress.update

    def interrupt_second_prompt(self, run) -> None:
        if run.prompt_id != "sea":
            raise KeyboardInterrupt
        update(self, run)

    monkeypatch.setattr(cli_bench.Progress, "update", interrupt_second_prompt)
    r = invoke("-m", str(tiny_target), "--draft", str(tiny_head), "-f", str(user_prompts), "-n", "8",
               "--contenders", "k1", "--json")
    assert r.exit_code == 130, r.output
    out = json.loads(r.stdout)
    assert {r["prompt_id"] for r in out["runs"]} == {"sea"}
    assert [r["contender"] for r in out["runs"]] == ["target", "k1", "target"]
    assert out["stopped"] == "interrupted"


def test_bad_flags_and_files_are_one_line_exit_2(tmp_path, tiny_target):
    one_line_error(invoke("--workloads", "chat,poetry"),
                   "--workloads: unknown workload 'poetry' (valid: chat, code, edit, extract)")
    one_line_error(invoke("--contenders", "default,k0"),
                   "--contenders: unknown contender 'k0' (valid: target, default, lookup, head, tree, k1, k2, k4, or "
                   "kN for any fixed K from 1 to 32)")
    one_line_error(invoke("--contenders", " , "),
                   "--contenders names none: name one or more (e.g. default,k2), or leave it out for the defaults")
    missing = tmp_path / "missing.jsonl"
    one_line_error(invoke("-f", str(missing)), f"{missing}: no such prompt file")
    one_line_error(invoke("-f", str(tmp_path)), f"{tmp_path} is a directory: -f takes a text file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    one_line_error(invoke("-f", str(bad)), f"{bad}:2: not JSON (one object with \"text\", or a string, a line)")
    bad.write_text('{"prompt": "no text key"}\n')
    one_line_error(invoke("-f", str(bad)),
                   f"{bad}:1: no prompt text (a line is {{\"text\": \"...\"}} or a JSON string)")
    one_line_error(invoke("--plot", str(tmp_path / "out.jpg")),
                   f"--plot writes a PNG: give a path ending in .png (got {tmp_path / 'out.jpg'})")
    (tmp_path / "a.png").mkdir()
    one_line_error(invoke("--plot", str(tmp_path / "a.png")), f"--plot: {tmp_path / 'a.png'} is a folder: give a file's path")
    r = invoke("--plot", "/proc/out.png")  # (why, in the OS's words, varies: as root no folder's mode says no)
    assert r.exit_code == 2 and r.stderr.startswith("error: --plot: cannot write into /proc (") and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr
    one_line_error(invoke("--workloads", ""),
                   "no prompts to measure: name workloads (chat, code, edit, extract) or give -f")
    bad.write_text('{"text": "a", "id": 1}\n{"text": "b", "id": 1}\n')  # measured as one prompt, said "prompts 1"
    one_line_error(invoke("-f", str(bad)), f"{bad}:2: the id 1 is line 1's too: give each prompt its own id (a line "
                   "without one has its line number)")
    bad.write_text('{"text": "a", "id": 2}\n"b"\n')
    one_line_error(invoke("-f", str(bad)), f"{bad}:2: the id 2 is line 1's too: give each prompt its own id (a line "
                   "without one has its line number)")
    # llama.cpp's --draft N: bench has no --draft-max to point at (it pointed there, and bench said no such option)
    one_line_error(invoke("--draft", "2"), "--draft 2: no such file; --draft is the EAGLE-3 head's GGUF here "
                   "(llama.cpp's --draft N is --contenders k2, measured beside target-only)")
    one_line_error(invoke("--draft", "0"), "--draft 0: no such file; --draft is the EAGLE-3 head's GGUF here "
                   "(llama.cpp's --draft N is target-only, which bench always measures)")
    # a run's first token is the prompt's, chosen untimed: -n 1 timed nothing and said tens of thousands of tok/s
    one_line_error(invoke("-n", "1"), "-n must be at least 2: the speeds time the tokens after the first (got 1)")
    one_line_error(invoke("--exact", "maybe"), "--exact must be auto, strict, off (got maybe)")
    one_line_error(invoke("--repeat", "0"), "--repeat must be at least 1 (got 0)")
    one_line_error(invoke("--time-limit", "nan"), "--time-limit must be seconds, 0 or more (got nan)")
    one_line_error(invoke("-ngl", "many"), "-ngl must be a number of layers, 'auto' or 'all' (got many)")
    good = tmp_path / "ok.jsonl"
    good.write_text('"hi"\n')
    r = invoke("-m", str(tmp_path / "none.gguf"), "-f", str(good))
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "none.gguf" in r.stderr, r.output


def test_user_prompts_file(user_prompts):
    ps = lib.load_jsonl(user_prompts)
    assert [(p.workload, p.id, p.text) for p in ps] == [("mine", "sea", "Write a haiku about the sea."),
                                                        ("mine", "3", "List three prime numbers.")]
    assert len(lib.load_jsonl(user_prompts, limit=1)) == 1
    bom = user_prompts.with_name("bom.jsonl")  # as a Windows editor saves UTF-8
    bom.write_bytes(b"\xef\xbb\xbf" + user_prompts.read_bytes())
    assert [(p.id, p.text) for p in lib.load_jsonl(bom)] == [(p.id, p.text) for p in ps]


def _run(pid: str, contender: str, rnd: int, tok_s: float, workload: str = "chat") -> PromptRun:
    return PromptRun(workload, pid, contender, rnd, 10, 100, 100 / tok_s, 100)


def test_per_prompt_ratio_fastest_of_each_round_then_median():
    base = [_run("a", "target", 0, 100), _run("a", "target", 0, 80), _run("a", "target", 1, 50),
            _run("a", "target", 1, 50), _run("a", "target", 2, 100)]
    runs = [_run("a", "x", 0, 110), _run("a", "x", 1, 60), _run("a", "x", 2, 90)]
    # rounds: 110/100, 60/50, 90/100 -> median 1.1 (round 1's slow machine does not decide the prompt)
    assert per_prompt_ratio(runs, base) == {"a": pytest.approx(1.1)}


def test_whole_prompts_drops_a_prompt_cut_short():
    runs = [_run("a", "target", 0, 1), _run("a", "x", 0, 1), _run("a", "target", 0, 1), _run("b", "target", 0, 1)]
    assert [r.prompt_id for r in whole_prompts(runs, 3)] == ["a", "a", "a"]


SETUP = Setup("t.gguf", "h.gguf", "a CPU", "CPU", "CPU", 2, True, 128, {}, [1.0, 1.6, 2.1, 2.5, 2.9], 0.2, 0.3, 10.0)


def _row(workload: str, contender: str, q1: float, median: float, q3: float, tau: float = 1.2) -> Row:
    return Row(workload, contender, 5, Spread(q1 - 0.05, q1, median, q3, q3 + 0.05), 90.0, tau, [0.4, 0.2], 50, 5, 5)


def test_advice_names_the_best_contender_and_workload():
    rows = [_row("chat", "target", 0.97, 0.98, 0.99), _row("edit", "target", 0.97, 0.98, 0.99),
            _row("chat", "default", 0.95, 0.98, 1.01), _row("edit", "default", 1.08, 1.12, 1.2, tau=2.6),
            _row("chat", "k2", 0.7, 0.75, 0.8), _row("edit", "k2", 0.8, 0.85, 0.9)]
    flags = {"default": "generate's defaults", "k2": "--draft-policy fixed --draft-max 2"}
    text = advice(rows, SETUP, flags)
    assert text.startswith("use default (generate's defaults): 1.12x on edit, 0.98x on chat; "), text
    assert "2 verify rows cost 1.60x one row" in text and "kept over 80% of the time" in text
    assert "k2 kept 40% at position 1" in text  # the fixed policy's acceptance: it drafts every cycle

    # a gain on one workload only, overall a loss: speculate there only
    rows[2:4] = [_row("chat", "default", 0.8, 0.85, 0.9), _row("edit", "default", 1.05, 1.1, 1.2)]
    text = advice(rows, SETUP, flags)
    assert text.startswith("speculate on edit text only: default (generate's defaults) gains 1.10x there"), text
    assert "on chat nothing beats target-only" in text

    # nothing beyond the spread anywhere
    rows[2:4] = [_row("chat", "default", 0.95, 0.99, 1.02), _row("edit", "default", 0.97, 1.01, 1.04)]
    text = advice(rows, SETUP, flags)
    assert text.startswith("speculation does not pay here for this pair: the best, default, runs at 1.01x on edit, "
                           "0.99x on chat"), text
    assert "target-only (--draft-max 0) is fastest" in text and "caution" not in text

    # a busy machine (target-only's own runs 40% apart) and one prompt a workload: said, with the figures
    rows[:2] = [_row("chat", "target", 0.5, 0.6, 0.7), _row("edit", "target", 0.5, 0.6, 0.7)]
    rows[0].prompts = 1
    text = advice(rows, SETUP, flags)
    assert "caution: target-only's two runs of a prompt differed by 40% (a busy machine)" in text
    assert "1 prompt(s) a workload: raise --limit and --time-limit" in text

    # the best contender's text was not target-only's on a prompt (--exact off on inexact widths): said beside it
    assert "parted" not in text
    rows[3].identical = 4
    text = advice(rows, SETUP, flags)
    assert "caution: default parted from target-only's text on some prompts (verify widths that are not exact" in text

    # runs that ended at the context's end made fewer tokens than the header says (-c 64 is 256 cells, unsaid)
    assert "end of the context" not in text
    rows[0].context_full = rows[2].context_full = 1
    assert "; 2 run(s) ended at the end of the context, short of -n tokens: raise -c" in advice(rows, SETUP, flags)


def test_summary_rows_pool_acceptance_and_count_identity():
    runs = [_run("a", "target", 0, 100), _run("a", "x", 0, 120), _run("a", "target", 0, 90)]
    runs[1].drafted_by_pos, runs[1].accepted_by_pos, runs[1].drafted = [10, 5, 0, 0], [5, 1, 0, 0], 15
    runs[1].identical, runs[2].identical = True, True
    rows = summarize(runs, ["target", "x"])
    assert [(r.contender, r.prompts) for r in rows] == [("target", 1), ("x", 1)]
    assert rows[0].ratio.median == pytest.approx(0.9)  # target-only's slower run against its faster one
    assert rows[1].ratio.median == pytest.approx(1.2)
    assert rows[1].acceptance_by_pos == [0.5, 0.2]  # up to the last position drafted
    assert (rows[1].identical, rows[1].compared) == (1, 1)


@pytest.mark.slow
def test_default_bench_on_smollm2_prints_the_table_and_advice():
    r = invoke("--limit", "1", "-n", "32", "--time-limit", "0")  # every workload, however busy the machine
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("target ") and "SmolLM2" in lines[0]
    table = [ln.split()[:2] for ln in lines if ln.split()[:1] in (["chat"], ["code"], ["edit"], ["extract"])]
    assert table == [[w, c] for w in ("chat", "code", "edit", "extract")
                     for c in ("target", "default", "k2", "lookup", "head")]
    assert lines[-1].startswith("advice: ")
    identical = [ln.split()[-1].split("/") for ln in lines if ln.split()[:1] in (["chat"], ["edit"])]
    assert all(n == m != "0" for n, m in identical), identical  # greedy: every text target-only's


def test_bench_hooks_rotation_and_late_contenders(tiny_target, tiny_head):
    """Bench's hooks see every run in this process in order (target-only first and last, the contenders between,
    turned by one each prompt with rotate), after() decides what measure() yields; contenders join before
    prepare() and within the pair's sequences, else one-line errors."""
    from eagle3_gguf.errors import Eagle3Error
    from eagle3_gguf.pair import PairConfig

    seen: list[tuple[str, str, int]] = []

    class Hooks(lib.RunHooks):
        def before(self, c, p, index, reference):
            seen.append((p.id, c.name, len(reference)))

        def after(self, c, p, run, result):
            assert run.tokens == result.stats.n_generated
            return PromptRun(**{**run.__dict__, "seconds": run.seconds + 1.0})

    contenders = lib.contenders_from(["k1", "k2"], 8)
    with lib.Bench(tiny_target, tiny_head, PairConfig(n_ctx=256, n_threads=1), contenders[:1]) as b:
        with pytest.raises(Eagle3Error, match="needs 9 sequences"):
            b.add(lib.contenders_from(["tree"], 8))
        b.add(contenders[1:])
        prompts = [lib.BenchPrompt("w", str(i), "", [1, 2 + i, 3]) for i in range(2)]
        runs = list(b.measure(prompts, n_predict=8, hooks=Hooks(), rotate=True))
        with pytest.raises(Eagle3Error, match="before prepare"):
            b.add(lib.contenders_from(["k4"], 8))
    assert [(p, c) for p, c, _ in seen] == [("0", "target"), ("0", "k1"), ("0", "k2"), ("0", "target"),
                                            ("1", "target"), ("1", "k2"), ("1", "k1"), ("1", "target")]
    assert [n for _, _, n in seen] == [0, 8, 8, 8, 0, 8, 8, 8]  # the round's target-only tokens, once it ran
    assert all(r.seconds > 1.0 for r in runs) and [r.contender for r in runs][:4] == ["target", "k1", "k2", "target"]


def test_a_context_narrower_than_the_widest_default_draft_is_calibrated_to_fit(tiny_target, tiny_head, tmp_path,
                                                                                monkeypatch):
    """prepare() calibrates target-only's curve for the widest default draft (a lookup draft's 16 rows and id_last):
    a context of 16 cells holds a batch of 16 rows only, so the curve stops there ("batch of 17 tokens does not fit
    capacity 16" had ended `bench -c 16`)."""
    from eagle3_gguf.pair import PairConfig

    monkeypatch.setenv("EAGLE3_GGUF_CACHE", str(tmp_path))
    with lib.Bench(tiny_target, tiny_head, PairConfig(n_ctx=16, n_threads=1), lib.contenders_from(["k2"], 4)) as b:
        assert len(b.prepare(4).verify_cost) == 16  # 1..16 rows
