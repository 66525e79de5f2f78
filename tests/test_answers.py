"""train.answers: llama.cpp answers prompts into the same resumable file the torch target writes, so that a file
begun on one machine is finished on another, by either answerer."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from model_factory import write_tiny_target  # noqa: E402

from eagle3_gguf import tokens  # noqa: E402
from eagle3_gguf.errors import Eagle3Error  # noqa: E402
from eagle3_gguf.native import Model  # noqa: E402
from eagle3_gguf.train import answers  # noqa: E402
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


def _records(recs) -> list[np.ndarray]:
    return [recs.record(j)[0] for j in range(recs.n_records)]


def test_llama_answers_resume_and_hand_over(tmp_path, tiny_target):
    """llama.cpp's greedy answers, one sequence in flight or several, come back in answer order (shortest prompt
    first), each its prompt then at most max_new tokens ending at the first end-of-generation token; a call out
    of time writes nothing; a file cut short is finished by either answerer; a file of another target is refused
    whatever its name, and a file that is not an answers file in one line."""
    prompts = _prompts([9, 5, 12, 7, 5, 10])
    order = answer_order(prompts)
    assert order == [1, 4, 3, 0, 5, 2]
    one, finished = llama_answers(tiny_target, prompts, tmp_path / "one.npz", 6, n_seq=1, n_threads=2)
    assert finished and one.n_records == len(prompts)
    with Model(tiny_target) as model:
        for j, p in enumerate(prompts[i] for i in order):
            t, m = one.record(j)
            answer = t[len(p):]
            assert np.array_equal(t[:len(p)], p) and not m[:len(p)].any() and m[len(p):].all()
            assert 1 <= len(answer) <= 6 and (len(answer) == 6 or tokens.is_eog(model, int(answer[-1])))
            assert not any(tokens.is_eog(model, int(a)) for a in answer[:-1])
    many, finished = llama_answers(tiny_target, prompts, tmp_path / "many.npz", 6, n_seq=4, n_threads=2)
    assert finished and np.array_equal(many.tokens, one.tokens) and np.array_equal(many.starts, one.starts)
    none, finished = llama_answers(tiny_target, prompts, tmp_path / "none.npz", 6, max_seconds=0.0)
    assert none.n_records == 0 and not finished and not (tmp_path / "none.npz").exists()

    _cut(tmp_path / "one.npz", tmp_path / "cut.npz", 2)  # llama.cpp's first two answers, then the torch target
    target = TorchTarget.from_gguf(tiny_target, [1, 3, 5], CPU)
    both, finished = self_distilled(target, prompts, tmp_path / "cut.npz", 6, batch_rows=4, batch_tokens=256)
    assert finished
    for j, i in enumerate(order):
        torch_made = np.concatenate([prompts[i], target.generate([prompts[i]], 6)[0]])
        assert np.array_equal(both.record(j)[0], one.record(j)[0] if j < 2 else torch_made)
    _cut(tmp_path / "cut.npz", tmp_path / "back.npz", 3)  # and back: the torch target's third, then llama.cpp
    back, finished = llama_answers(tiny_target, prompts, tmp_path / "back.npz", 6, n_seq=2, n_threads=2)
    expect = _records(both)[:3] + _records(one)[3:]
    assert finished and back.n_records == 6 and all(np.array_equal(a, b) for a, b in zip(_records(back), expect))

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
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(Eagle3Error, match=r"bad.npz: not an answers file \(.*\): delete it, or use another --out"):
        self_distilled(target, prompts, tmp_path / "bad.npz", 6, 2, 64)
    with np.load(tmp_path / "one.npz") as z:  # an order one record short of the records
        np.savez(tmp_path / "short.npz", **{k: z[k] for k in z.files if k != "order"}, order=z["order"][:-1])
    with pytest.raises(Eagle3Error, match=r"short.npz: not an answers file \(6 records, 5 in its order\)"):
        llama_answers(tiny_target, prompts, tmp_path / "short.npz", 6)


def test_llama_answers_in_flight_finish_out_of_order(tmp_path, tiny_target, monkeypatch):
    """With answers of uneven lengths (an end-of-generation check that ends some early), streams finish out of
    order and take new prompts while others are mid-answer: the answers are those of one stream at a time, and a
    call stopped mid-run keeps only a finished prefix, which a rerun completes to the same file."""
    ends = lambda model: (lambda token: token % 3 == 0)  # noqa: E731
    monkeypatch.setattr(tokens, "eog_check", ends)
    prompts = _prompts([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], seed=3)
    alone, finished = llama_answers(tiny_target, prompts, tmp_path / "alone.npz", 12, n_seq=1, n_threads=2)
    answered = [t[m] for t, m in (alone.record(j) for j in range(alone.n_records))]
    assert finished and len({len(a) for a in answered}) > 2  # uneven: streams finish out of order
    for a in answered:
        assert all(t % 3 != 0 for t in a[:-1]) and (len(a) == 12 or a[-1] % 3 == 0)
    crowd, finished = llama_answers(tiny_target, prompts, tmp_path / "crowd.npz", 12, n_seq=3, n_threads=2)
    assert finished and np.array_equal(crowd.tokens, alone.tokens) and np.array_equal(crowd.starts, alone.starts)
    monkeypatch.setattr(answers, "SAVE_EVERY_S", 0.0)  # save the finished prefix after every decode
    clock = itertools.count()  # answers.py's clock steps by one a reading: max_seconds counts its loop's turns
    monkeypatch.setattr(answers, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    seen = []
    part, finished = llama_answers(tiny_target, prompts, tmp_path / "part.npz", 12, n_seq=3, n_threads=2,
                                   max_seconds=60, progress=lambda n, total, _s: seen.append(n))
    assert not finished and 0 < part.n_records < len(prompts) and seen == sorted(seen) and seen[-1] == part.n_records
    assert all(np.array_equal(a, b) for a, b in zip(_records(part), _records(alone)))
    rest, finished = llama_answers(tiny_target, prompts, tmp_path / "part.npz", 12, n_seq=3, n_threads=2)
    assert finished and np.array_equal(rest.tokens, alone.tokens) and np.array_equal(rest.starts, alone.starts)
