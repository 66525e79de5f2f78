"""train.answers: llama.cpp answers prompts into the same resumable file the torch target writes, so that a file
begun on one machine is finished on another, by either answerer."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from model_factory import write_tiny_target  # noqa: E402

from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.native import Model  # noqa: E402
from eagle3_gguf.tokens import is_eog  # noqa: E402
from eagle3_gguf.train.answers import answer_order, gguf_identity, llama_answers, self_distilled  # noqa: E402
from eagle3_gguf.train.torch_target import TorchTarget  # noqa: E402

CPU = torch.device("cpu")


def _prompts(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40000, n).astype(np.int32) for n in lengths]


def _cut(path: Path, out: Path, n_records: int) -> None:
    """`path`'s first n_records answers alone, as a call that stopped there leaves them."""
    with np.load(path) as z:
        n = int(z["starts"][n_records])
        np.savez(out, tokens=z["tokens"][:n], starts=z["starts"][:n_records + 1], mask=z["mask"][:n],
                 order=z["order"][:n_records], max_new=z["max_new"], target=z["target"])


def test_llama_answers_in_flight_resume_and_hand_over(tmp_path, tiny_target):
    """llama.cpp's greedy answers are the same with one sequence in flight or several (each in its own KV stream,
    a finished one replaced at once); each ends at max_new tokens or with its end-of-generation token; the
    records come back in the prompts' order; a call out of time writes nothing; a file cut short is finished by
    either answerer, and a file of another target is refused whatever its name."""
    prompts = _prompts([9, 5, 12, 7, 5, 10])
    one, finished = llama_answers(tiny_target, prompts, tmp_path / "one.npz", 6, n_seq=1, n_threads=2)
    assert finished and one.n_records == len(prompts)
    with Model(tiny_target) as model:
        for i, p in enumerate(prompts):
            t, m = one.record(i)
            answer = t[len(p):]
            assert np.array_equal(t[:len(p)], p) and not m[:len(p)].any() and m[len(p):].all()
            assert 1 <= len(answer) <= 6 and (len(answer) == 6 or is_eog(model, int(answer[-1])))
            assert not any(is_eog(model, int(a)) for a in answer[:-1])
    seen = []
    many, finished = llama_answers(tiny_target, prompts, tmp_path / "many.npz", 6, n_seq=4, n_threads=2,
                                   progress=lambda n, total, _s: seen.append((n, total)))
    assert finished and np.array_equal(many.tokens, one.tokens) and np.array_equal(many.starts, one.starts)
    assert seen[-1] == (6, 6)
    none, finished = llama_answers(tiny_target, prompts, tmp_path / "none.npz", 6, max_seconds=0.0)
    assert none.n_records == 0 and not finished and not (tmp_path / "none.npz").exists()

    order = answer_order(prompts)
    assert order == [1, 4, 3, 0, 5, 2]
    _cut(tmp_path / "one.npz", tmp_path / "cut.npz", 2)  # llama.cpp's first two answers, then the torch target
    target = TorchTarget.from_gguf(tiny_target, [1, 3, 5], CPU)
    both, finished = self_distilled(target, prompts, tmp_path / "cut.npz", 6, batch_rows=4, batch_tokens=256)
    assert finished
    for i in range(len(prompts)):
        kept = i in order[:2]
        t = both.record(i)[0]
        assert np.array_equal(t, one.record(i)[0] if kept else np.concatenate([prompts[i], target.generate(
            [prompts[i]], 6)[0]]))
    _cut(tmp_path / "cut.npz", tmp_path / "back.npz", 3)  # and back: the torch target's third, then llama.cpp
    back, finished = llama_answers(tiny_target, prompts, tmp_path / "back.npz", 6, n_seq=2, n_threads=2)
    assert finished
    for i in range(len(prompts)):
        assert np.array_equal(back.record(i)[0], (both if i in order[:3] else one).record(i)[0])

    renamed = tmp_path / "renamed.gguf"  # the same file under another name: the same target
    renamed.write_bytes(Path(tiny_target).read_bytes())
    again, finished = llama_answers(renamed, prompts, tmp_path / "one.npz", 6)
    assert finished and np.array_equal(again.tokens, one.tokens)
    other = write_tiny_target(tmp_path / "other.gguf", seed=7, tokenizer_from=tiny_target)
    with pytest.raises(Eagle3Error, match=re.escape(
            f"one.npz: answers of another target ({gguf_identity(tiny_target)}, not {gguf_identity(other)}): "
            "delete it, or use another --out")):
        llama_answers(other, prompts, tmp_path / "one.npz", 6)
    with pytest.raises(Eagle3Error, match="one.npz: answers to other prompts or of another length: delete it"):
        llama_answers(tiny_target, prompts, tmp_path / "one.npz", 7)
