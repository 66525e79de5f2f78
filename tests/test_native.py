"""The binding, exercised for real: extraction on a target decode, a head on ctx_other, llama_process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from llama_cpp import llama_cpp as C

from eagle3_gguf import keys, native
from eagle3_gguf.batch import Batch, BatchExt
from eagle3_gguf.context import LLAMA_PROCESS_TYPE_DECODE, LLAMA_PROCESS_TYPE_ENCODE, Context
from eagle3_gguf.errors import Eagle3Error, NativeError
from eagle3_gguf.native import CACHE_TYPES, Model, batch_invariant_cache


def test_staging_symbols_resolve_by_mangled_name():
    lib = native._lib
    for name, mangled in keys.MANGLED_SYMBOLS.items():
        assert hasattr(lib, mangled), name
    assert native._missing == []


def test_missing_symbol_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(native, "_missing", ["llama_set_embeddings_layer_inp"])
    with pytest.raises(NativeError) as e:
        native.require_ext()
    assert str(e.value).startswith("the loaded libllama lacks llama_set_embeddings_layer_inp")
    assert "llama-cpp-python==0.3.36" in str(e.value)


def test_a_context_symbol_missing_is_caught_before_context_is_imported():
    """require_ext() checks every staging symbol, context.py's too, even where only native.py was imported (a
    fresh process: the bindings are made on import). The symbol is made missing by naming a mangled name that
    no library exports."""
    import subprocess
    import sys

    code = ("from eagle3_gguf import keys\n"
            "keys.MANGLED_SYMBOLS['llama_get_embeddings_nextn_ith'] = '_Z_no_such_symbol'\n"
            "from eagle3_gguf import native\n"
            "try:\n    native.require_ext()\nexcept native.NativeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("the loaded libllama lacks llama_get_embeddings_nextn_ith"), r.stdout


def test_owners_close_idempotently_and_work_as_context_managers(tiny_target):
    with Model(tiny_target) as m:
        with Context(m, n_ctx=64, n_batch=16) as c:
            b = BatchExt(c)
            b.close()
            b.close()
            assert b.ptr is None
        assert c.ptr is None
        c.close()
    assert m.ptr is None
    m.close()
    with pytest.raises(Eagle3Error, match="Model is closed"):
        _ = m.n_embd


def test_model_load_failure_is_an_error_not_an_abort(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(Eagle3Error, match="llama.cpp could not load it"):
        Model(bad)


def test_target_extraction_head_encode_decode(tiny_target, tiny_head):
    with Model(tiny_target) as tm, Model(tiny_head) as hm:
        assert hm.arch == "eagle3" and hm.target_layer_ids() == [1, 3, 5]
        assert tm.target_layer_ids() == []
        with Context(tm, n_ctx=128, n_batch=32) as tc, Context(hm, n_ctx=128, n_batch=32, ctx_other=tc) as hc:
            for lid in hm.target_layer_ids():
                tc.set_layer_inp(lid)
            hc.set_nextn(True, masked=True)
            tokens = [1, 17, 300, 4000, 12, 9, 77]
            with Batch(32) as b:
                b.set(tokens, 0, logits="all")
                tc.decode(b)
            feats = [tc.layer_inp(lid, len(tokens)).copy() for lid in hm.target_layer_ids()]
            for f in feats:
                assert f.shape == (len(tokens), tm.n_embd)  # [n_tokens, n_embd_tgt]
                assert np.isfinite(f).all() and np.abs(f).sum() > 0
            assert not np.allclose(feats[0], feats[1])
            x = np.concatenate(feats, axis=1)  # [n_tokens, 3 * n_embd_tgt]
            with BatchExt(hc) as be:
                for i, row in enumerate(x):
                    be.add_embd(row, i)
                hc.process(LLAMA_PROCESS_TYPE_ENCODE, be)
                g = hc.nextn(len(tokens)).copy()  # [n_tokens, n_embd]
                assert g.shape == (len(tokens), hm.n_embd) and np.isfinite(g).all()
                be.clear()
                for k in range(len(tokens) - 1):
                    be.add_token(tokens[k + 1], k, g[k], output=k == len(tokens) - 2)
                hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
                logits = hc.logits_ith(len(tokens) - 2)
                assert logits.shape == (tm.n_vocab,) and np.isfinite(logits).all()
                h = hc.nextn_ith(len(tokens) - 2)
                assert h.shape == (hm.n_embd,) and np.isfinite(h).all()
            assert hc.pos_max() == len(tokens) - 2


def test_layer_inp_guarded_before_extraction(tiny_target):
    with Model(tiny_target) as tm, Context(tm, n_ctx=64, n_batch=16) as tc:
        with pytest.raises(Eagle3Error, match="layer 2 input was not extracted"):
            tc.layer_inp(2, 1)
        with pytest.raises(Eagle3Error, match="layer id 6 out of range for a 6-layer model"):
            tc.set_layer_inp(6)


def test_a_failed_decode_says_what_its_rc_means(tiny_target):
    """llama.h's return codes: -1 a batch it refuses (here a token id outside the vocabulary: the drop-in's prompt of
    ids), 1 no room left in the KV cache; neither leaves the context unusable."""
    with Model(tiny_target) as tm, Context(tm, n_ctx=256, n_batch=16) as tc, Batch(16) as b:
        b.set([1, 2, -1], 0)
        with pytest.raises(Eagle3Error) as e:
            tc.decode(b)
        assert str(e.value) == ("llama_decode refused the batch (rc=-1): a token id outside the vocabulary, a "
                                "position out of order or a sequence id past the context's")
        for pos in range(0, 256, 16):
            b.set([1] * 16, pos)
            tc.decode(b)
        b.set([1], 256)
        with pytest.raises(Eagle3Error) as e:
            tc.decode(b)
        assert str(e.value) == "llama_decode found no room in the KV cache (rc=1): the context is full: raise -c"


def test_greedy_sampling_in_the_graph_picks_the_argmax_of_every_row(smollm2_path):
    """Backend greedy sampling on a verify-shaped batch (every row an output, as many as a verify sends) gives
    numpy's argmax of the same rows, leaves the extracted layer inputs as they were, and hides the logits
    it no longer copies out: not even as the sampled rows' logits, which llama.cpp's own greedy sampler hands back."""
    tokens = [1, 504, 3458, 314, 260, 1345, 28, 198]
    with Model(smollm2_path) as tm, Context(tm, n_ctx=64, n_batch=16, n_threads=2) as tc, Batch(16) as b:
        tc.set_layer_inp(3)

        def run() -> np.ndarray:
            tc.clear()
            b.set(tokens, 0, logits="all")
            tc.decode(b)
            return tc.layer_inp(3, len(tokens)).copy()  # [n, n_embd]

        feats = run()
        want = [int(np.argmax(tc.logits_ith(i))) for i in range(len(tokens))]
        with pytest.raises(Eagle3Error, match="no sampled token for batch row 0"):
            tc.sampled_token(0)
        assert tc.set_greedy_sampling(True) and tc.greedy_sampling
        assert np.array_equal(run(), feats)
        assert [tc.sampled_token(i) for i in range(len(tokens))] == want
        assert [C.llama_get_sampled_logits_count_ith(tc.ptr, i) for i in range(len(tokens))] == [0] * len(tokens)
        with pytest.raises(Eagle3Error, match="chooses tokens in the graph"):
            tc.logits_ith(0)
        with pytest.raises(Eagle3Error, match="chooses tokens in the graph"):
            tc.logits(len(tokens))
        tc.set_greedy_sampling(False)
        run()
        assert [int(np.argmax(tc.logits_ith(i))) for i in range(len(tokens))] == want
        with pytest.raises(Eagle3Error, match="needs a context eagle3-gguf made"):
            Context(tm, borrowed=tc.ptr).set_greedy_sampling(True)


@pytest.mark.parametrize("k", [1, 4])
def test_the_graph_chooses_a_rows_likeliest_tokens_with_their_probabilities(smollm2_path, k):
    """set_graph_choice(k, probs=True), as a head's draft step reads a row: the k likeliest tokens of every output
    row and their probabilities under a softmax over the whole row, as numpy finds them in the logits; no logits
    handed back; and back to the logits when asked."""
    tokens = [1, 504, 3458, 314, 260, 1345]
    with Model(smollm2_path) as tm, Context(tm, n_ctx=64, n_batch=16, n_threads=2) as tc, Batch(16) as b:
        def run() -> None:
            tc.clear()
            b.set(tokens, 0, logits="all")
            tc.decode(b)

        run()
        z = tc.logits(len(tokens)).astype(np.float64)  # [n, n_vocab]
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want = [np.argsort(-row, kind="stable")[:k] for row in p]
        with pytest.raises(Eagle3Error, match=r"set_graph_choice\(k, probs=True\)"):
            tc.sampled_top(0)
        assert tc.set_graph_choice(k, probs=True)
        run()
        for i in range(len(tokens)):
            ids, probs = tc.sampled_top(i)
            order = np.argsort(probs)[::-1]
            assert [ids[j] for j in order] == want[i].tolist()
            assert np.allclose([probs[j] for j in order], p[i, want[i]], rtol=1e-4, atol=1e-7)
            assert C.llama_get_sampled_logits_count_ith(tc.ptr, i) == 0
        with pytest.raises(Eagle3Error, match="chooses tokens in the graph"):
            tc.logits_ith(0)
        assert not tc.set_graph_choice(0)
        run()
        assert np.array_equal(tc.logits(len(tokens)), z.astype(np.float32))


def test_greedy_sampling_the_backend_refuses_leaves_the_logits(smollm2_path, monkeypatch):
    """Where llama.cpp cannot run the sampler on the context's backend, set_greedy_sampling says so and the
    context keeps handing back logits: a Runner then takes numpy's argmax, with the same tokens."""
    from eagle3_gguf import decode
    from eagle3_gguf.decode import GenerateConfig, Runner

    monkeypatch.setattr(decode, "greedy_in_graph", lambda target: True)  # as on a GPU
    prompt = [1, 504, 3458, 314, 260]
    with Model(smollm2_path) as tm, Context(tm, n_ctx=128, n_batch=16, n_threads=2) as tc, Runner(tc) as d:
        want = d.generate(prompt, GenerateConfig(n_predict=12), speculative=False).tokens
        assert tc.greedy_sampling
        tc.set_greedy_sampling(False)
        monkeypatch.setattr(native.C, "llama_set_sampler", lambda ctx, seq, smpl: smpl is None)
        assert tc.set_greedy_sampling(True) is False and not tc.greedy_sampling
        assert d.generate(prompt, GenerateConfig(n_predict=12), speculative=False).tokens == want
        assert not tc.greedy_sampling
        tc.logits_ith(0)


def test_head_with_d2t_scatters_into_target_vocab(tiny_target, tiny_head_d2t):
    from gguf import GGUFReader

    d2t = next(t for t in GGUFReader(tiny_head_d2t).tensors if t.name == "d2t").data.astype(np.int64)
    with Model(tiny_target) as tm, Model(tiny_head_d2t) as hm:
        with Context(tm, n_ctx=64, n_batch=16) as tc, Context(hm, n_ctx=64, n_batch=16, ctx_other=tc) as hc:
            hc.set_nextn(True)
            with BatchExt(hc) as be:
                be.add_token(5, 0, np.ones(hm.n_embd, np.float32))
                hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
            logits = hc.logits_ith(0)
            finite = np.flatnonzero(np.isfinite(logits))
            assert np.array_equal(finite, np.sort(d2t))


def test_eagle3_decoder_ignores_the_output_mask_at_the_pin(tiny_target, tiny_head):
    """The pinned eagle3 decoder graph has no output-row selection: with outputs on a subset of rows,
    llama.cpp returns the first rows' logits. Eagle3Session marks every row of a multi-row draft batch
    as an output because of this; if this test fails, upstream fixed it and the marks can go."""
    rng = np.random.default_rng(0)
    with Model(tiny_target) as tm, Model(tiny_head) as hm:
        with Context(tm, n_ctx=64, n_batch=16) as tc, Context(hm, n_ctx=64, n_batch=16, ctx_other=tc) as hc:
            hc.set_nextn(True)
            g = rng.standard_normal((3, hm.n_embd)).astype(np.float32)  # [3, n_embd]
            rows = {}
            for mask in ((True, True, True), (False, False, True)):
                hc.clear()
                with BatchExt(hc) as be:
                    for i in range(3):
                        be.add_token(100 + i, i, g[i], output=mask[i])
                    hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
                rows[mask] = hc.logits_ith(2).copy()
            all_rows = (True, True, True)
            hc.clear()
            with BatchExt(hc) as be:
                for i in range(3):
                    be.add_token(100 + i, i, g[i], output=True)
                hc.process(LLAMA_PROCESS_TYPE_DECODE, be)
                first = hc.logits_ith(0).copy()
            assert not np.allclose(rows[(False, False, True)], rows[all_rows])
            np.testing.assert_array_equal(rows[(False, False, True)], first)


@pytest.mark.parametrize("threads, ctx_len, type_v, same", [
    (2, 250, "f16", True), (2, 280, "f16", False), (1, 280, "f16", True),
    (2, 280, "bf16", True), (2, 700, "bf16", True), (2, 280, "q8_0", None)])
def test_single_row_decode_vs_batched_rows_at_the_pin(tiny_target, threads, ctx_len, type_v, same):
    """Why greedy identity with target-only decoding needs the bf16 V cache (PairConfig's default):
    with llama.cpp's default f16/f16 cache, ggml-cpu's flash attention takes a split-KV path (KV
    chunks per thread, then a reduction) for a single query row once the KV view reaches 512 cells,
    and a per-row path for batches. With one thread there is no split and the two agree bit for bit;
    with a bf16 V cache every row takes the per-row path at any length. If this test fails, upstream
    changed that path: revisit native.batch_invariant_cache and docs/exactness.md."""
    assert batch_invariant_cache(CACHE_TYPES["f16"], CACHE_TYPES[type_v]) == (type_v != "f16")
    if same is None:  # q8_0 needs head sizes in 32-blocks: the tiny target's 16 is refused, with one line
        with Model(tiny_target) as tm, pytest.raises(Eagle3Error, match=r"could not create a context "
                                                     r"\(n_ctx=1024, KV cache f16/q8_0; -v shows why\)"):
            Context(tm, n_ctx=1024, type_v=CACHE_TYPES[type_v])
        return
    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(100, 40000, size=ctx_len)]
    with Model(tiny_target) as tm, Context(tm, n_ctx=1024, n_batch=64, n_threads=threads,
                                           type_v=CACHE_TYPES[type_v]) as tc, Batch(64) as b:
        rows = {}
        for n in (1, 2):
            tc.clear()
            head = seq[:len(seq) - n]
            for i in range(0, len(head), 32):
                b.set(head[i:i + 32], i, logits="none")
                tc.decode(b)
            b.set(seq[len(seq) - n:], len(head), logits="all")
            tc.decode(b)
            rows[n] = tc.logits_ith(n - 1).copy()
    assert np.array_equal(rows[1], rows[2]) == same


def test_batch_invariant_cache_pairs():
    variant = {(k, v) for k in CACHE_TYPES for v in CACHE_TYPES
               if not batch_invariant_cache(CACHE_TYPES[k], CACHE_TYPES[v])}
    assert variant == {("f16", "f16"), ("f16", "f32"), ("f32", "f16"), ("f32", "f32")}  # f32 is cast to f16
    with pytest.raises(Eagle3Error) as e:
        native.cache_type("fp8")
    assert str(e.value) == "unknown KV cache type 'fp8' (one of: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1)"


def test_the_v_cache_is_bf16_on_a_cpu_and_f16_where_layers_are_on_a_gpu(monkeypatch, tiny_target, tiny_head):
    """-ctv auto (PairConfig's, Eagle3Llama's and serve's default): bf16 keeps ggml-cpu's attention batch-invariant;
    on a GPU it buys nothing and costs a conversion to f16 every decode (pair.default_type_v). A registered RPC
    backend (llama_supports_gpu_offload says yes for it) is no GPU of this machine's."""
    from eagle3_gguf import pair, rpc
    if not rpc.local_devices():  # this machine: the CPU whatever -ngl says
        assert [pair.default_type_v(n) for n in (0, -1, 30)] == ["bf16"] * 3
        with pair.load_pair(tiny_target, tiny_head, pair.PairConfig(n_ctx=256, n_gpu_layers=-1)) as p:
            assert p.target.kv_types == (CACHE_TYPES["f16"], CACHE_TYPES["bf16"])
    monkeypatch.setattr(rpc, "local_devices", lambda: [1])
    assert [pair.default_type_v(0), pair.default_type_v(-1), pair.default_type_v(30),
            pair.default_type_v(-1, remote=True)] == ["bf16", "f16", "f16", "bf16"]
    assert pair.default_type_v(-1, offload_kqv=False) == "bf16"  # the cache and attention stay on the CPU


def test_where_a_model_runs(tiny_target, tiny_head):
    """Each model's offload reaches llama.cpp's model parameters (the head's follows the target's unless given),
    and its placement names the GPU devices llama.cpp gave it and the layers on them; none here: the CPU."""
    from eagle3_gguf.pair import PairConfig, load_pair

    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=64, n_gpu_layers=3, n_gpu_layers_draft=1)) as pair:
        assert (pair.target_model.n_gpu_layers, pair.head_model.n_gpu_layers) == (3, 1)
        n = pair.target_model.n_layer + 1  # llama.cpp counts the output layer
        assert native.llama_model_n_devices(pair.target_model.ptr) == 0  # a CPU-only build
        assert pair.target_model.placement == native.Placement((), 0, n) and str(pair.target_model.placement) == "CPU"
    with load_pair(tiny_target, tiny_head, PairConfig(n_ctx=64, n_gpu_layers=-1)) as pair:
        assert pair.head_model.n_gpu_layers == -1 and str(pair.head_model.placement) == "CPU"
    gpu = native.Placement(("CUDA0 (NVIDIA H100 80GB HBM3)",), 31, 31)
    assert str(gpu) == "CUDA0 (NVIDIA H100 80GB HBM3): 31/31 layers offloaded"
    assert str(native.Placement(("CUDA0 (NVIDIA H100 80GB HBM3)",), 0, 31)) == "CPU"


def test_without_a_compiler_the_graph_does_not_choose_and_the_logits_are_read(tmp_path, smollm2_path):
    """choice.c is built once with the system compiler; where none is, greedy decoding reads the logits as
    llama-cpp-python does (set_greedy_sampling says False) instead of failing: no compiler is needed to decode."""
    code = f"""
from eagle3_gguf.native import Model
from eagle3_gguf.context import Context
from eagle3_gguf.batch import Batch
with Model({str(smollm2_path)!r}) as m, Context(m, n_ctx=64, n_batch=16, n_threads=2) as c, Batch(16) as b:
    assert not c.set_greedy_sampling(True) and not c.greedy_sampling
    b.set([1, 504, 3458], 0, logits="all")
    c.decode(b)
    print(int(c.logits_ith(2).argmax()))
"""
    env = {**os.environ, "EAGLE3_GGUF_CACHE": str(tmp_path), "CC": str(tmp_path / "no-cc")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr[-2000:]
