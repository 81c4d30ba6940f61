"""`benchmarks/cp_model.py`: the context-parallel model's arithmetic and its picks."""

from __future__ import annotations

import json

import pytest

from benchmarks import cp_model

H200 = cp_model.Machine(
    kernel_tflops=510.0,
    short_call_tokens=200.0,
    ring_overhead_ns=18.0,
    intra_gbps=195.0,
    inter_gbps=50.0,
    latency_us=15.0,
    gpus_per_node=8,
)
SHAPE = cp_model.Shape(q_heads=32, kv_heads=8, head_dim=128)


def test_ideal_is_the_causal_flops_over_p():
    # 7 N D T^2 FLOPs forward+backward (3.5 x the causal forward's 2 N D T^2).
    t = 2 * 8192
    flops = 7 * 32 * 128 * t * t
    rate = 510e12 * t / (t + 200.0)
    assert cp_model.ideal_ms(2, 8192, SHAPE, H200) == pytest.approx(flops / rate * 1e3 / 2)


def test_ulysses_traffic_repeats_kv_heads_only_as_needed():
    per_head = 2 * 1024 * 128 * 2  # forward + backward, bf16, 1k tokens
    assert cp_model._ulysses_traffic(8, 1024, SHAPE) == per_head * (2 * 32 + 2 * 8)
    mqa = cp_model.Shape(q_heads=32, kv_heads=1, head_dim=128)
    assert cp_model._ulysses_traffic(8, 1024, mqa) == per_head * (2 * 32 + 2 * 8)


def test_picks_and_limits():
    by = {x.strategy: x for x in cp_model.predict(64, 2048, SHAPE, H200)}
    assert by["ulysses"].efficiency == 0 and "P > N" in by["ulysses"].note  # 64 > 32 heads
    assert max(by.values(), key=lambda x: x.efficiency).strategy == "hybrid"
    # Long contexts: the ring hides its transfers and wins.
    long = cp_model.predict(4, 131072, SHAPE, H200)
    assert max(long, key=lambda x: x.efficiency).strategy == "ring"
    assert long[0].exposed_ms == 0


def test_main_writes_json_and_checks_against_measurement(tmp_path):
    out = tmp_path / "model.json"
    cp_model.main(["--gpus", "2", "16", "--tokens-per-gpu", "8192", "--check", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["gpus"] for r in result["rows"]] == [2, 16]
    for row in result["check"]:  # within 5% of the 2-GPU ring measurements
        assert abs(row["predicted"] - row["measured"]) < 0.05


def test_each_collective_at_its_own_bandwidth():
    """The all-to-all (Ulysses, the hybrid's inner part) and the all-gather (and dK/dV's
    reduce-scatter) take their own measured GB/s; unset, the node's `intra_gbps`. On 4
    H100s a 256 MiB all-to-all ran at 289 GB/s against the ring's ppermute at 96."""
    import dataclasses

    def eff(m, p=4, tokens=8192):
        return {x.strategy: x.efficiency for x in cp_model.predict(p, tokens, SHAPE, m)}

    node = dataclasses.replace(H200, gpus_per_node=4)
    same = eff(dataclasses.replace(node, a2a_gbps=node.intra_gbps, gather_gbps=node.intra_gbps))
    assert same == eff(node)
    fast_a2a = eff(dataclasses.replace(node, a2a_gbps=3 * node.intra_gbps))
    assert fast_a2a["ulysses"] > same["ulysses"]
    assert fast_a2a["ring"] == same["ring"] and fast_a2a["allgather"] == same["allgather"]
    slow_gather = eff(dataclasses.replace(node, gather_gbps=node.intra_gbps / 2))
    assert slow_gather["allgather"] < same["allgather"]
    assert slow_gather["ulysses"] == same["ulysses"]
