"""The long-context knobs: the sequence-tiled MLP, host-offloaded remat residuals and the
optimizer state in host memory. Each must leave the loss and the gradients unchanged."""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from models.config import REMAT_POLICIES
from train.config import parse_args

CONFIG = models.TINY.replace(num_layers=2, mlp_tile=0)
SEQ = 128


def _loss(params, config, ids):
    hidden = models.hidden_states(config, params, ids)
    head, vocab_major = models.lm_head_table(config, params)
    return models.chunked_cross_entropy(hidden, head, ids, chunk_size=64, vocab_major=vocab_major)[
        0
    ]


@pytest.fixture(scope="module")
def setup():
    params = models.init_params(CONFIG, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, SEQ), 0, CONFIG.vocab_size)
    grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)
    # f32 matmuls in f32 on GPUs too (their default may round the operands to TF32), so
    # that tiled and whole MLPs differ by the order of additions only.
    with jax.default_matmul_precision("highest"):
        return params, ids, grad, grad(params, CONFIG, ids)


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_tiled_mlp_and_offload_keep_loss_and_gradients(setup, remat):
    params, ids, grad, want = setup
    for tile in (0, 32):
        with jax.default_matmul_precision("highest"):
            got = grad(params, CONFIG.replace(remat=remat, mlp_tile=tile), ids)
        _assert_same(got, want)


def _forward_residuals(remat: str, mlp_tile: int = 0) -> list[str]:
    """The abstract values the layer scan's forward hands to its backward."""
    params = models.abstract_params(CONFIG)
    ids = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    config = CONFIG.replace(remat=remat, mlp_tile=mlp_tile)
    jaxpr = jax.make_jaxpr(jax.grad(_loss), static_argnums=1)(params, config, ids).jaxpr
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    return [str(v.aval) for v in scan.outvars[1:]]


def test_offload_policies_keep_no_layer_residual_on_the_device():
    """The CPU backend lowers no host transfer (the compiled HLO holds no memory-space
    annotation there; benchmarks/long_context.sh checks `S(5)` on a GPU), so this reads
    the differentiated program: the stacked per-layer residuals are host arrays."""
    layers, d, heads = CONFIG.num_layers, CONFIG.hidden_size, CONFIG.num_heads
    x = f"[{layers},1,{SEQ},{d}]"
    attn = f"[{layers},1,{SEQ},{heads},{CONFIG.head_dim}]"
    assert sorted(_forward_residuals("save_attn")) == sorted([f"float32{attn}", f"float32{x}"])
    assert _forward_residuals("full") == [f"float32{x}"]
    assert sorted(_forward_residuals("offload_attn")) == sorted(
        [f"float32<host>{attn}", f"float32<host>{x}"]
    )
    assert _forward_residuals("offload_full") == [f"float32<host>{x}"]


def test_tiled_mlp_holds_no_whole_sequence_intermediate():
    """With the MLP tiled, no [.., T, F] array is a residual of the layer scan (without
    remat `none` saves the MLP's intermediates for the whole sequence)."""
    f = CONFIG.intermediate_size
    whole = f"{SEQ},{f}]"
    assert any(whole in r for r in _forward_residuals("none", mlp_tile=0))
    tiled = _forward_residuals("none", mlp_tile=32)
    # Not even per tile: the backward recomputes each tile's MLP from the tile's input.
    assert not any(r.endswith(f",{f}]") for r in tiled), tiled


def test_mlp_tile_choice_and_errors():
    auto = models.TINY  # mlp_tile=-1
    assert auto.mlp_tile == -1
    assert auto.mlp_tile_for(131072) == 0  # short shares run the MLP whole
    assert auto.mlp_tile_for(262144) == 8192 and auto.mlp_tile_for(524288) == 8192
    assert auto.mlp_tile_for(3 * 131072) == 8192 and auto.mlp_tile_for(40960 * 8) == 8192
    assert auto.mlp_tile_for(36864 * 8) == 8192
    assert auto.mlp_tile_for(9 * 36864) == 6912  # the largest divisor up to 8192
    assert models.TINY.replace(mlp_tile=0).mlp_tile_for(1 << 20) == 0
    assert models.TINY.replace(mlp_tile=512).mlp_tile_for(4096) == 512
    assert models.TINY.replace(mlp_tile=4096).mlp_tile_for(4096) == 0  # one tile: whole
    with pytest.raises(ValueError, match="mlp_tile=300 must divide the 4096 tokens"):
        models.TINY.replace(mlp_tile=300).mlp_tile_for(4096)
    with pytest.raises(ValueError, match="mlp_tile=-2"):
        models.TINY.replace(mlp_tile=-2)
    with pytest.raises(ValueError, match="--mlp_tile=-3"):
        parse_args(["--mlp_tile", "-3"])
    assert parse_args([]).model.mlp_tile == -1 and parse_args([]).optim.optimizer_offload is False


def _trainer_args(tmp_path, *extra, mesh="data=-1,fsdp=2,seq=2"):
    return [
        "--model_name_or_path", "tiny", "--data_path", "sample", "--model_max_length", "64",
        "--sample_num_examples", "16", "--learning_rate", "3e-3", "--lr_scheduler_type",
        "constant", "--logging_steps", "1",
        "--progress", "false", "--max_steps", "3", "--export_hf", "false", "--bf16", "false",
        "--report_to", "none", "--mesh", mesh, "--output_dir", str(tmp_path), *extra,
    ]  # fmt: skip


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_trainer_knobs_train_as_without(tmp_path):
    """Ring attention over seq=2 with FSDP: the tiled MLP (tiles of each shard), the
    offloaded residuals and the host optimizer state give the same losses; the stored
    moments are in pinned host memory, and a run saved with them resumes."""
    from train.build import build
    from train.loop import run

    plain = run(parse_args(_trainer_args(tmp_path / "a", "--save_strategy", "no")))["losses"]
    knobs = ["--mlp_tile", "16", "--remat_policy", "offload_attn", "--optimizer_offload"]
    cfg = parse_args(_trainer_args(tmp_path / "b", *knobs, "--save_steps", "2"))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(build(cfg).state["opt_state"])}
    assert kinds == {"pinned_host"}
    np.testing.assert_allclose(run(cfg)["losses"], plain, rtol=1e-5)
    step_2 = str(tmp_path / "b" / "checkpoints" / "2")
    resumed = parse_args(_trainer_args(tmp_path / "c", *knobs, "--resume_from_checkpoint", step_2))
    np.testing.assert_allclose(run(resumed)["losses"], plain[2:], rtol=1e-5)


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_tiled_mlp_keeps_the_sequence_sharded(tmp_path):
    """Under seq=2 the tiles split each device's share: the step's compiled program
    gathers no [.., T, D] activation across the sequence shards."""
    from train.build import model_config, plan_step

    def gathers(tile: str) -> list[str]:
        cfg = parse_args(_trainer_args(tmp_path, "--mlp_tile", tile, mesh="data=1,fsdp=1,seq=2"))
        plan = plan_step(cfg, model_config(cfg), jax.devices()[:2])
        with jax.set_mesh(plan.mesh):
            text = plan.step_fn.lower(plan.abstract_state, plan.abstract_batch(1, 1, 64))
            text = text.compile().as_text()
        return re.findall(r"\[1,64,128\][^\n]*all-gather\(", text)

    assert gathers("0") == [] and gathers("16") == []


def _norm_and_mlp_avals(jaxpr) -> set[str]:
    """The intermediates of the norms and MLPs in a jaxpr and the jaxprs inside it."""
    out = set()
    for eqn in jaxpr.eqns:
        stack = str(eqn.source_info.name_stack)
        if "rmsnorm" in stack or "mlp" in stack:
            out.update(str(v.aval) for v in eqn.outvars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out |= _norm_and_mlp_avals(sub)
    return out


def test_tiled_step_has_no_whole_sequence_f32_or_ffn_intermediate():
    """bf16 compute: the norms' float32 `[T, D]` and the MLP's `[T, F]` exist for one
    tile only, forward and backward (the final norm included). Outside them, the fused
    loss scales its saved `[T, D]` gradient in float32 (one elementwise fusion)."""
    config = CONFIG.replace(dtype="bfloat16", remat="save_attn")
    params = models.abstract_params(config)
    ids = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    d, f = config.hidden_size, config.intermediate_size

    def avals(tile):
        c = config.replace(mlp_tile=tile)
        jaxpr = jax.make_jaxpr(jax.grad(_loss), static_argnums=1)(params, c, ids).jaxpr
        return _norm_and_mlp_avals(jaxpr)

    whole = {f"float32[1,{SEQ},{d}]", f"bfloat16[1,{SEQ},{f}]"}
    assert whole <= avals(0)
    tiled = avals(32)
    assert not whole & tiled, whole & tiled
    assert f"bfloat16[1,32,{f}]" in tiled and f"float32[1,32,{d}]" in tiled


def test_trainer_refuses_a_tile_that_does_not_divide_the_share(tmp_path):
    from train.build import model_config, plan_step
    from train.errors import TrainingError

    cfg = parse_args(_trainer_args(tmp_path, "--mlp_tile", "24", mesh="data=1,fsdp=1,seq=1"))
    with pytest.raises(TrainingError, match="--mlp_tile: mlp_tile=24 must divide the 64 tokens"):
        plan_step(cfg, model_config(cfg), jax.devices()[:1])


@pytest.mark.multi_device(4)
def test_the_tile_check_counts_the_hybrid_strategys_share(tmp_path):
    """The hybrid strategy splits a row over seq x seq_a2a: a device holds 16 of 64
    tokens. The check divided by seq alone (32): it refused a tile of 24, which the
    model runs whole, and passed one that the model then refused after the plan line."""
    from train.build import model_config, plan_step
    from train.errors import TrainingError

    hybrid = ("--ring_strategy", "hybrid")
    mesh = "data=1,fsdp=1,seq=2,seq_a2a=2"
    cfg = parse_args(_trainer_args(tmp_path, "--mlp_tile", "24", *hybrid, mesh=mesh))
    plan_step(cfg, model_config(cfg), jax.devices()[:4])  # 24 >= 16: the MLP runs whole
    for tile, length in (("16", "96"), ("32", "192")):
        cfg = parse_args(
            _trainer_args(
                tmp_path, "--mlp_tile", tile, "--model_max_length", length, *hybrid, mesh=mesh
            )
        )
        share = int(length) // 4
        with pytest.raises(
            TrainingError, match=f"^--mlp_tile: mlp_tile={tile} must divide the {share} tokens"
        ):
            plan_step(cfg, model_config(cfg), jax.devices()[:4])


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_a_tile_as_long_as_the_share_is_said_to_run_the_mlp_whole(tmp_path, capsys):
    from train.loop import run

    run(parse_args(_trainer_args(tmp_path, "--mlp_tile", "48", mesh="data=1,fsdp=-1,seq=2")))
    assert (
        "--mlp_tile 48: a device holds 32 tokens of a row, one tile at most, so the MLP runs "
        "whole (no memory saved); give a divisor of it to tile"
    ) in capsys.readouterr().out


@pytest.mark.multi_device(2)
def test_sequence_tiles_keep_an_explicit_seq_sharding():
    """Under an Explicit-axes mesh the tiled function's output and gradient keep the
    input's `seq` sharding (each tile takes a slice of every shard)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from models.llama import _seq_tiled

    mesh = jax.make_mesh(
        (2,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2]
    )
    x = jax.random.normal(jax.random.key(0), (1, 64, 8))

    def fn(v):
        return jnp.sin(v) * v

    with jax.set_mesh(mesh):
        on_seq = NamedSharding(mesh, PartitionSpec(None, "seq"))
        xs = jax.device_put(x, on_seq)
        y = jax.jit(lambda v: _seq_tiled(fn, v, 8, 2))(xs)
        g = jax.jit(jax.grad(lambda v: _seq_tiled(fn, v, 8, 2).sum()))(xs)
    assert y.sharding.spec == g.sharding.spec == PartitionSpec(None, "seq", None)
    np.testing.assert_allclose(y, fn(x), rtol=1e-6)
    np.testing.assert_allclose(g, jax.grad(lambda v: fn(v).sum())(x), rtol=1e-6)


@pytest.mark.parametrize("optim", [pytest.param("adamw", marks=pytest.mark.slow), "adafactor"])
def test_offloaded_update_equals_the_whole_tree_update(optim):
    """One parameter at a time through host memory: the same new parameters and state
    as `tx.update` on the whole tree, clipping by the global norm included."""
    import types

    from jax.sharding import SingleDeviceSharding

    from train.config import OptimArgs
    from train.optim import optimizer
    from train.step import offloaded_update

    args = OptimArgs(optim=optim, weight_decay=0.1, max_grad_norm=0.5, learning_rate=1e-2)
    tx = optimizer(args, 10)
    params = models.init_params(CONFIG, jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 100))
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
    state = tx.update(grads, tx.init(params), params)[1]  # moments that are not zero
    updates, want_state = tx.update(grads, state, params)
    want = optax.apply_updates(params, updates)

    device = jax.devices()[0]
    on_device = jax.tree.map(lambda _: SingleDeviceSharding(device), state)
    on_host = jax.tree.map(lambda _: SingleDeviceSharding(device, memory_kind="pinned_host"), state)
    spec = types.SimpleNamespace(opt_offload=(on_host, on_device, args.max_grad_norm))
    host_state = jax.device_put(state, on_host)
    got, got_state = jax.jit(lambda g, s, p: offloaded_update(tx, g, s, p, spec))(
        grads, host_state, params
    )
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got_state)} == {"pinned_host"}
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    leaves = zip(
        jax.tree.leaves((got, got_state)), jax.tree.leaves((want, want_state)), strict=True
    )
    for a, b in leaves:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
