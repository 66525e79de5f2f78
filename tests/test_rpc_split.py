"""--tensor-split: llama.cpp's proportions, or 'head' (rpc.head_split): each layer input the head reads made on an
rpc-server of its own and none on the last, so that reading the features overlaps the last server's work."""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from llama_cpp.llama_cpp import llama_max_devices

from eagle3_gguf.errors import Eagle3Error
from eagle3_gguf.rpc import head_split, parse_tensor_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_rpc import _generate, _one_error_line, needs_rpc, running_servers  # noqa: E402


def _made(head_layers: list[int]) -> set[int]:
    return {lid - 1 for lid in head_layers if lid > 0}  # the layer whose output is that layer's input


def _valid(counts: tuple[int, ...], n_layer: int, head_layers: list[int]) -> bool:
    ends = list(itertools.accumulate(counts))
    if ends[-1] != n_layer + 1 or min(counts) < 1:
        return False
    per_server = [sum(1 for m in _made(head_layers) if start <= m < end) for start, end in zip([0] + ends, ends)]
    return per_server[-1] == 0 and max(per_server) <= 1


def test_smollm2_head_split_keeps_the_heads_layers_apart():
    assert head_split(30, [2, 15, 27], 4) == (9, 9, 9, 4)  # made on layers 1 / 14 / 26: servers 1, 2, 3
    assert head_split(30, [2, 15, 27], 5) == (6, 7, 7, 7, 4)
    assert head_split(30, [2, 15, 30], 4) == (10, 10, 10, 1)  # the final hidden state: the last holds only the output


@pytest.mark.parametrize("n_layer,head_layers", [(6, [1, 3, 5]), (8, [0, 4, 7]), (9, [2, 5, 8]), (11, [2, 6, 9])])
def test_head_split_is_the_most_balanced_valid_split(n_layer, head_layers):
    for n_servers in range(len(_made(head_layers)) + 1, 6):
        got = head_split(n_layer, head_layers, n_servers)
        assert _valid(got, n_layer, head_layers), got
        best = min(max(c) for c in itertools.product(range(1, n_layer + 2), repeat=n_servers)
                   if _valid(c, n_layer, head_layers))
        assert max(got) == best, (got, best)


def test_head_split_needs_a_server_more_than_the_heads_layers():
    with pytest.raises(Eagle3Error) as e:
        head_split(30, [2, 15, 27], 3)
    assert str(e.value) == ("--tensor-split head: the head reads 3 of the target's layers, so it needs 4 to 31 "
                            "rpc-servers (got 3): add servers or give proportions")


def test_parse_tensor_split():
    assert parse_tensor_split("head") == "head"
    assert parse_tensor_split("3,1") == (3.0, 1.0) and parse_tensor_split("0,1.5") == (0.0, 1.5)
    for bad in ("0,0", "x", "-1,2", "nan", "inf", ""):
        with pytest.raises(Eagle3Error) as e:
            parse_tensor_split(bad)
        assert str(e.value) == (f"--tensor-split: '{bad}' is neither 'head' nor non-negative proportions per device, "
                                "not all 0 (e.g. --tensor-split 3,1)")


@pytest.mark.parametrize("args,message", [
    (["--tensor-split", "head"], "--tensor-split head places the target's layers on rpc-servers: add --rpc"),
    (["--tensor-split", "1,x"], "--tensor-split: '1,x' is neither 'head' nor non-negative proportions per device, "
                                "not all 0 (e.g. --tensor-split 3,1)"),
    (["--tensor-split", ",".join(["1"] * 300)], "--tensor-split: 300 proportions, but llama.cpp places layers on "
                                                f"{llama_max_devices()} devices at most"),
])
def test_bad_tensor_split_flags(args, message):
    assert _one_error_line(_generate("-n", "8", *args)) == f"error: {message}"


@pytest.fixture(scope="module")
def four_servers():
    yield from running_servers(4)


@needs_rpc
def test_head_split_needs_enough_servers_and_every_layer(four_servers):
    two = ",".join(four_servers.split(",")[:2])
    assert _one_error_line(_generate("-n", "8", "--rpc", two, "--tensor-split", "head")) == (
        "error: --tensor-split head: the head reads 3 of the target's layers, so it needs 4 to 31 rpc-servers (got 2): "
        "add servers or give proportions")
    assert _one_error_line(_generate("-n", "8", "--rpc", four_servers, "--tensor-split", "head", "-ngl", "20")) == (
        "error: --tensor-split head needs every layer offloaded: -ngl all (got -ngl 20)")


@needs_rpc
def test_head_split_over_four_servers_is_target_only(four_servers):
    flags = ["-n", "48", "--draft-policy", "fixed", "--draft-max", "4", "--baseline", "--json", "-v"]
    res = _generate(*flags, "--rpc", four_servers, "--tensor-split", "head")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["stats"]["target_on"].count("RPC") == 4 and out["stats"]["target_on"].endswith("31/31 layers offloaded")
    assert out["identical"] and out["stats"]["n_accepted"] > 0
    layers = Counter(ln.split("assigned to device ")[1].split(",")[0] for ln in res.stderr.splitlines()
                     if "assigned to device RPC" in ln)  # llama.cpp's log: the target's layers, then its output
    assert list(layers.values()) == [9, 9, 9, 4], layers
