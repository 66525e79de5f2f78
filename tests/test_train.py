"""The training path on the tiny random target: data capture, the torch head against llama.cpp, and
`run_training` end to end (loss falls, the export converts, loads and drafts losslessly)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eagle3_gguf.batch import Batch  # noqa: E402
from eagle3_gguf.context import Context  # noqa: E402
from eagle3_gguf.decode import GenerateConfig, Runner  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.extract import TargetFeatures  # noqa: E402
from eagle3_gguf.gguf_file import TargetInfo, read_gguf  # noqa: E402
from eagle3_gguf.native import Model  # noqa: E402
from eagle3_gguf.pair import PairConfig, load_pair  # noqa: E402
from eagle3_gguf.session import Eagle3Session  # noqa: E402
from eagle3_gguf.train import PipelineConfig, run_training  # noqa: E402
from eagle3_gguf.tokens import chat_tokens, tokenize  # noqa: E402
from eagle3_gguf.train.data import DataConfig, generate_data, load_dataset, stored  # noqa: E402
from eagle3_gguf.train.export import convert_to_gguf, export_checkpoint, export_safeai, read_head_gguf, read_target, \
    read_token_embeddings  # noqa: E402
from eagle3_gguf.train.loop import TrainConfig  # noqa: E402
from eagle3_gguf.train.model import Eagle3Head, HeadConfig  # noqa: E402
from eagle3_gguf.train.prompts import build_prompts, source  # noqa: E402
from eagle3_gguf.train.vocab import answer_token_counts, build_draft_vocab  # noqa: E402

LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny_target):
    out = tmp_path_factory.mktemp("data")
    generate_data(tiny_target, build_prompts(7), out, DataConfig(layers=LAYERS, n_seq=3, max_new=20, n_threads=2))
    return load_dataset(out)


def test_prompts_are_ours_and_stable():
    a, b = build_prompts(300), build_prompts(120)
    assert a[:120] == b  # any prefix is the same set: resuming with another --prompts is safe
    assert len({p.text for p in a}) == 300
    assert {p.category for p in a} >= {"coding", "explain", "writing", "math", "reasoning", "roleplay", "extraction", "stub"}
    prose = build_prompts(3000, seed=1, mix="prose")
    assert prose[:500] == build_prompts(500, seed=1, mix="prose") and len({p.text for p in prose}) == 3000
    assert {p.category for p in prose} == {"prose"} and not {p.text for p in prose} & {p.text for p in a}
    with pytest.raises(ValueError, match="unknown prompt mix 'poetry'"):
        build_prompts(3, mix="poetry")


def test_batched_capture_matches_single_sequence(tiny_target, tiny_data):
    """Several sequences in one batch: every record's features are the ones a lone sequence gives, row
    for row (the unified KV cache keeps batch order). Batching changes the attention's float rounding
    a little, which this random model amplifies (~3e-4 relative on SmolLM2), so rows are compared by
    direction and relative size."""
    assert tiny_data.n_records == 7
    agree = total = 0
    with Model(tiny_target) as model, Context(model, n_ctx=512, n_batch=512, n_threads=2) as ctx, \
            Batch(512) as batch:
        feats = TargetFeatures(ctx, LAYERS)
        for r in range(tiny_data.n_records):
            tokens, f, n_prompt = tiny_data.record(r)
            ctx.clear()
            batch.set(tokens[:-1], 0, logits="all")
            ctx.decode(batch)
            single = feats.gather(len(tokens) - 1)  # [n - 1, 3 * n_embd]
            got = f[:-1].astype(np.float32)
            assert not f[-1].any()  # the last token was never decoded
            cos = (got * single).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(single, axis=1)
            rel = np.linalg.norm(got - single, axis=1) / np.linalg.norm(single, axis=1)
            assert cos.min() > 0.999 and rel.max() < 0.05, (r, cos.min(), rel.max())
            greedy = [int(np.argmax(ctx.logits_ith(i))) for i in range(n_prompt - 1, len(tokens) - 1)]
            agree += sum(a == b for a, b in zip(greedy, tokens[n_prompt:]))
            total += len(greedy)
    assert agree >= 0.9 * total  # the answers are the target's greedy ones (up to near-ties)


def test_data_resumes(tmp_path, tiny_target):
    cfg = DataConfig(layers=LAYERS, n_seq=2, max_new=8, shard_tokens=1, n_threads=2)
    first = generate_data(tiny_target, build_prompts(3), tmp_path, cfg)
    assert first.n_prompts_done == 3
    again = generate_data(tiny_target, build_prompts(5), tmp_path, cfg)
    assert again.n_prompts_done == 5 and load_dataset(tmp_path).n_records == 5


def test_raw_prompts_are_sent_as_generate_sends_them(tmp_path, tiny_target):
    """prompt format raw (a base model's): each record starts with the prompt as `generate` without --chat
    tokenizes it (BOS + text), not through the chat template; a resume in the other format is refused."""
    prompts = build_prompts(2)
    cfg = DataConfig(layers=LAYERS, n_seq=2, max_new=4, n_threads=2, chat=False)
    generate_data(tiny_target, prompts, tmp_path, cfg, prompts_source=source(chat=False))
    data = load_dataset(tmp_path)
    with Model(tiny_target) as model:
        for i, p in enumerate(prompts):
            tokens, _, n_prompt = data.record(i)
            assert list(tokens[:n_prompt]) == tokenize(model, p.text) != chat_tokens(model, p.text)
    with pytest.raises(Eagle3Error, match="existing data answers other prompts"):
        generate_data(tiny_target, build_prompts(3), tmp_path, dataclasses.replace(cfg, chat=True),
                      prompts_source=source())


def test_features_past_float16_are_kept_in_float32(tmp_path):
    """Gemma 3's residual stream passes float16's range at BOS (~1e5 in one channel): such rows are stored in
    float32, not as inf (which made every training loss NaN), and the data set loads as float32."""
    small = np.ones((2, 6), np.float32)  # [n_rows, 3 * n_embd_tgt]
    big = small.copy()
    big[0, 3] = 1.2e5
    assert stored(small).dtype == np.float16 and stored(big).dtype == np.float32
    assert stored(big)[0, 3] == np.float32(1.2e5)


def test_read_target_is_the_one_target_description(tiny_target, tiny_head):
    """The trainer's target is gguf_file.TargetInfo (what pair and convert read), with the llama hparams a
    head is sized by; a head passed as the target is refused."""
    tgt = read_target(tiny_target)
    assert tgt == TargetInfo.from_gguf(read_gguf(tiny_target))
    assert (tgt.n_layer, tgt.n_embd, tgt.n_head, tgt.n_head_kv, tgt.n_ff) == (6, 64, 4, 2, 128)
    assert tgt.token_embd is not None and tgt.token_embd.shape == [64, tgt.n_vocab]
    cfg = HeadConfig.for_target(tgt, 512)
    assert (cfg.n_ff, cfg.rms_eps, cfg.rope_theta, cfg.max_position) == (128, pytest.approx(1e-5), 10000.0, 2048)
    with pytest.raises(Eagle3Error) as e:
        read_target(tiny_head)
    assert str(e.value) == f"{tiny_head.name} is an EAGLE-3 head: pass the target model with -m"


def _head_for(tiny_target, vocab_size: int = 512, seed: int = 0):
    tgt = read_target(tiny_target)
    cfg = HeadConfig(n_embd=tgt.n_embd, n_ff=96, n_head=tgt.n_head, n_head_kv=tgt.n_head_kv, n_embd_tgt=tgt.n_embd,
                     n_vocab=tgt.n_vocab, draft_vocab=vocab_size, rms_eps=tgt.rms_eps, rope_theta=tgt.rope_theta)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, torch.from_numpy(read_token_embeddings(tiny_target)))
    with torch.no_grad():  # non-trivial norms so a wrong norm placement would show
        for norm in (head.input_layernorm, head.hidden_norm, head.post_attention_layernorm, head.norm):
            norm.weight.uniform_(0.5, 1.5)
        head.lm_head.weight.mul_(8.0)
    return tgt, head


def test_torch_head_matches_llama_cpp(tmp_path, tiny_target, tiny_data):
    """Same weights (f32 GGUF): encoder g, decoder logits/h on real pairs, and a 4-step draft chain."""
    tgt, head = _head_for(tiny_target)
    vocab = build_draft_vocab(answer_token_counts(tiny_data, tgt.n_vocab), 512)
    ckpt = export_safeai(head, vocab, LAYERS, tgt.n_layer, tmp_path / "ckpt")
    gguf_path = convert_to_gguf(ckpt, tiny_target, tmp_path / "head-f32.gguf", LAYERS, outtype="f32",
                                fc_type="f32").out
    tokens, _, _ = tiny_data.record(0)
    n = len(tokens) - 1
    with load_pair(tiny_target, gguf_path, PairConfig(n_ctx=512, n_batch=512, n_threads=2)) as pair, \
            Eagle3Session(pair.target, pair.head) as sess, Batch(512) as batch:
        batch.set(tokens[:n], 0, logits="last")
        pair.target.decode(batch)
        feats = sess.features(n)  # [n, 3 * n_embd]
        g_cpp = sess.encode(feats)  # [n, n_embd]
        ft = torch.from_numpy(feats)[None]
        with torch.no_grad():
            g_t = head.encode(ft)[0]
        np.testing.assert_allclose(g_cpp, g_t.numpy(), rtol=1e-4, atol=1e-4)

        # decoder on the real pairs (t[i+1], g_i) at positions i
        sess.reset()
        sess.dec_batch.set_embd(g_cpp[:n - 1], np.arange(n - 1, dtype=np.int32), tokens[1:n])
        pair.head.decode(sess.dec_batch)
        cpp_logits = np.stack([pair.head.logits_ith(i)[vocab.ids] for i in range(n - 1)])  # [n-1, V']
        cpp_h = np.stack([pair.head.nextn_ith(i) for i in range(n - 1)])
        with torch.no_grad():
            lt, ht = head(torch.from_numpy(tokens[1:n].astype(np.int64))[None], torch.from_numpy(g_cpp[:n - 1])[None])
        np.testing.assert_allclose(cpp_h, ht[0].numpy(), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(cpp_logits, lt[0].numpy(), rtol=1e-3, atol=1e-3 * np.abs(cpp_logits).max())

        # a draft chain: llama.cpp's KV semantics vs the training-time-test unroll
        sess.reset()
        sess.process(list(tokens[:n]), 0, feats)
        id_last = int(tokens[n])
        drafts = sess.draft(id_last, 4).tokens
    assert len(drafts) == 4
    chain = np.concatenate([tokens[1:n], [id_last]]).astype(np.int64)  # [n]: the token after each row
    # unroll over rows 0..n-1; row n-1 is the seed (id_last, g_{n-1}); its steps j feed drafts[j-1]
    toks = np.concatenate([chain, np.asarray(drafts[:3], np.int64)])  # [n + 3]
    with torch.no_grad():
        steps = head.unroll(ft, torch.from_numpy(toks)[None], 4)
    torch_chain = [int(vocab.ids[int(head.logits(h[0, n - 1]).argmax())]) for h in steps]
    assert torch_chain == drafts


def test_run_training_end_to_end(tmp_path, tiny_target):
    cfg = PipelineConfig(n_prompts=10, layer_ids=LAYERS, draft_vocab=512, n_ff=96, n_seq=4, max_new=32, n_threads=2,
                         train=TrainConfig(n_unroll=3, max_steps=40, batch_tokens=512, lr=3e-3, held_out=0.2,
                                           n_threads=2))
    losses = []
    res = run_training(tiny_target, tmp_path / "run", cfg,
                       on_event=lambda stage, p: losses.append(p.loss) if stage == "train" and p.eval is None else None)
    assert res.train.steps == 40 and len(res.train.evals) >= 1
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3])  # the loss falls
    assert (res.checkpoint / "model.safetensors").is_file() and res.gguf.is_file()
    assert 0.0 <= res.coverage[512] <= 1.0  # held-out (a random target answers with near-random tokens)

    # the converted head loads with the binding and drafts; greedy output is the target's own
    with load_pair(tiny_target, res.gguf, PairConfig(n_ctx=512, n_batch=512, n_threads=2)) as pair:
        assert pair.head_model.target_layer_ids() == LAYERS
        with Eagle3Session(pair.target, pair.head) as sess, Runner(pair.target, sess) as dec:
            prompt = chat_tokens(pair.target_model, "Write a Python function that adds two numbers.")
            spec = dec.generate(prompt, GenerateConfig(n_predict=24, draft_max=3, draft_policy="fixed"))
            base = dec.generate(prompt, GenerateConfig(n_predict=24, draft_max=3), speculative=False)
    assert spec.tokens == base.tokens
    assert spec.stats.n_drafted > 0


def test_resume_continues_training(tmp_path, tiny_target):
    base = dict(n_prompts=4, draft_vocab=256, n_ff=64, n_seq=2, max_new=16, n_threads=2)
    run_training(tiny_target, tmp_path / "run", PipelineConfig(**base, train=TrainConfig(
        n_unroll=2, max_steps=6, batch_tokens=256, held_out=0.25, n_threads=2)))
    with pytest.raises(Exception, match="--resume"):
        run_training(tiny_target, tmp_path / "run", PipelineConfig(**base))
    res = run_training(tiny_target, tmp_path / "run", PipelineConfig(**base, resume=True, train=TrainConfig(
        n_unroll=2, max_steps=10, batch_tokens=256, held_out=0.25, n_threads=2)))
    assert res.train.steps == 10


def test_fine_tune_from_a_checkpoint_on_two_data_folders(tmp_path, tiny_target):
    """load_dataset concatenates folders in order; init_from starts from a checkpoint's weights with a fresh
    optimizer (lr 0 keeps them exactly), and refuses a checkpoint of another shape."""
    from eagle3_gguf.train.loop import train_head
    from eagle3_gguf.train.vocab import DraftVocab

    first_dir, other = tmp_path / "balanced", tmp_path / "prose"
    cfg_data = DataConfig(layers=LAYERS, n_seq=3, max_new=12, n_threads=2)
    generate_data(tiny_target, build_prompts(4), first_dir, cfg_data)
    generate_data(tiny_target, build_prompts(3, seed=1, mix="prose"), other, cfg_data)
    one, two = load_dataset(first_dir), load_dataset(other)
    both = load_dataset([first_dir, other])
    n = one.n_records
    assert both.n_records == n + two.n_records and len(both.tokens) == len(one.tokens) + len(two.tokens)
    for i, (data, j) in {0: (one, 0), n - 1: (one, n - 1), n: (two, 0), both.n_records - 1: (two, -1)}.items():
        j = j % data.n_records
        assert all(np.array_equal(x, y) for x, y in zip(both.record(i), data.record(j)))
    elsewhere = tmp_path / "other-layers"
    generate_data(tiny_target, build_prompts(1), elsewhere, dataclasses.replace(cfg_data, layers=[0, 2, 5]))
    with pytest.raises(Eagle3Error) as e:
        load_dataset([first_dir, elsewhere])
    assert str(e.value) == (f"{elsewhere}: its data has layers [0, 2, 5] and hidden size 64, the first folder's "
                            f"{LAYERS} and 64: they cannot train one head")

    tgt, head = _head_for(tiny_target, 256)
    vocab = DraftVocab(np.arange(256, dtype=np.int64), tgt.n_vocab, 0.0)
    embed = head.embed.clone()
    cfg = TrainConfig(n_unroll=2, max_steps=2, batch_tokens=256, held_out=0.0, n_threads=2)
    first, _ = train_head(both, vocab, head.c, embed, tmp_path / "a", cfg)
    tuned, _ = train_head(both, vocab, head.c, embed, tmp_path / "b",
                          dataclasses.replace(cfg, lr=0.0, init_from=str(tmp_path / "a" / "ckpt.pt")))
    for (name, a), b in zip(first.state_dict().items(), tuned.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(Eagle3Error) as e:
        train_head(both, DraftVocab(np.arange(1, 257, dtype=np.int64), tgt.n_vocab, 0.0), head.c, embed,
                   tmp_path / "c", dataclasses.replace(cfg, init_from=str(tmp_path / "a" / "ckpt.pt")))
    assert str(e.value) == f"{tmp_path / 'a' / 'ckpt.pt'}: checkpoint was trained with another head config or draft vocab"


def test_a_head_gguf_reads_back_and_fine_tunes(tmp_path, tiny_target, tiny_data):
    """read_head_gguf undoes export + convert: an f32 GGUF gives back the head's config, draft vocab and exact
    weights (q/k rows back in rotate-half order), for an EAGLE 3.0 and an EAGLE 3.1 head; a quantized one
    gives back weights that convert again to the same bytes; train_head starts from a GGUF (lr 0 keeps it) and
    refuses one of another draft vocab."""
    from eagle3_gguf.train.loop import train_head

    tgt, head = _head_for(tiny_target)
    vocab = build_draft_vocab(answer_token_counts(tiny_data, tgt.n_vocab), 512)
    for eagle31 in (False, True):
        h = head
        if eagle31:
            h = Eagle3Head(dataclasses.replace(head.c, fc_norm=True, norm_output=True), head.embed)
            h.load_state_dict(head.state_dict(), strict=False)
            with torch.no_grad():
                for norm in h.fc_norm:
                    norm.weight.uniform_(0.5, 1.5)
        ckpt = export_checkpoint(h, vocab, LAYERS, tgt.n_layer, tmp_path / f"ckpt-{eagle31}")
        path = convert_to_gguf(ckpt, tiny_target, tmp_path / f"head-{eagle31}.gguf", LAYERS, outtype="f32",
                               fc_type="f32").out
        back = read_head_gguf(path)
        assert back.config == h.c and np.array_equal(back.vocab.ids, vocab.ids)
        want = {k: v.numpy() for k, v in h.state_dict().items()}
        assert sorted(back.state) == sorted(want)
        for name, w in want.items():
            assert np.array_equal(back.state[name], w), name

    quantized = convert_to_gguf(export_safeai(head, vocab, LAYERS, tgt.n_layer, tmp_path / "q"), tiny_target,
                                tmp_path / "q.gguf", LAYERS, outtype="q8_0", fc_type="q4_0").out
    back = read_head_gguf(quantized)
    again = Eagle3Head(back.config, head.embed)
    again.load_state_dict({k: torch.from_numpy(v) for k, v in back.state.items()})
    requantized = convert_to_gguf(export_safeai(again, back.vocab, LAYERS, tgt.n_layer, tmp_path / "q2"),
                                  tiny_target, tmp_path / "q2.gguf", LAYERS, outtype="q8_0", fc_type="q4_0").out
    one, two = read_gguf(quantized).raw, read_gguf(requantized).raw
    assert [t.name for t in one.tensors] == [t.name for t in two.tensors]
    for t in one.tensors:
        assert np.array_equal(one.tensor_data(t.name), two.tensor_data(t.name)), t.name

    cfg = TrainConfig(n_unroll=2, max_steps=1, batch_tokens=256, held_out=0.0, n_threads=2, lr=0.0,
                      init_from=str(quantized))
    tuned, _ = train_head(tiny_data, back.vocab, back.config, head.embed, tmp_path / "tune", cfg)
    for name, w in tuned.state_dict().items():
        assert np.array_equal(w.numpy(), back.state[name]), name
    other = type(vocab)(np.arange(512, dtype=np.int64), tgt.n_vocab, 0.0)
    with pytest.raises(Eagle3Error) as e:
        train_head(tiny_data, other, back.config, head.embed, tmp_path / "other", cfg)
    assert str(e.value) == f"{quantized}: head GGUF has another head config or draft vocab than this training"


def test_read_head_gguf_refuses_a_head_without_a_draft_vocab(tiny_head):
    with pytest.raises(Eagle3Error) as e:
        read_head_gguf(tiny_head)
    assert str(e.value) == (f"{tiny_head.name}: the head drafts over the target's vocab (no d2t or no output.weight); "
                            "only a head with its own draft vocab can be fine-tuned")


@pytest.mark.parametrize("native", [False, True])
def test_bf16_autocast_only_where_the_cpu_has_bf16_math(monkeypatch, native):
    """TrainConfig.bf16 on a CPU without AVX512-BF16 / AMX trains in fp32 (emulated bf16 was 3.2x slower)."""
    from eagle3_gguf.train.loop import _autocast

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: native, raising=False)
    x = torch.ones(4, 4)
    with _autocast(torch.device("cpu"), True):
        y = x @ x
    assert y.dtype == (torch.bfloat16 if native else torch.float32)
    with _autocast(torch.device("cpu"), False):
        assert (x @ x).dtype == torch.float32


def test_learning_rate_schedule_follows_a_time_budget():
    """By steps: warmup over the first 5%, the peak, cosine down to the floor at the end. Under a wall-time
    budget that ends the run after 20 of 1,000 steps, the warmup ends and the decay reaches the floor by
    the clock, not by the steps the run never takes."""
    from eagle3_gguf.train.loop import lr_at

    cfg, total = TrainConfig(lr=1e-3, warmup=0.05, min_lr_ratio=0.05), 1000
    assert lr_at(0.0, 0, total, cfg) == pytest.approx(1e-3 / 50)
    assert lr_at(0.049, 49, total, cfg) == pytest.approx(1e-3)
    assert lr_at(0.05, 50, total, cfg) == pytest.approx(1e-3)
    assert lr_at(1.0, total, total, cfg) == pytest.approx(5e-5)
    assert lr_at(0.03, 2, total, cfg) == pytest.approx(0.6e-3)  # the clock is 60% through the warmup
    assert lr_at(0.999, 20, total, cfg) == pytest.approx(5e-5, rel=0.01)  # the budget's end: the floor
