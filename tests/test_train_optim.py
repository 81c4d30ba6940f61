"""Learning-rate schedules against HF transformers' formulas (written out by hand) and the
three optimizers' first update against their update rules."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_oracle

from train.config import OptimArgs, parse_args
from train.mesh import parse_mesh
from train.optim import optimizer, schedule


def _lrs(total: int, **kw) -> np.ndarray:
    lr = schedule(OptimArgs(learning_rate=1.0, **kw), total)
    return np.array([float(lr(s)) for s in range(total + 1)])


def _hf_wsd(step, warm, stable, decay, decay_type, floor):
    """transformers' `_get_wsd_scheduler_lambda` (linear warmup, num_cycles 0.5)."""
    if step < warm:
        return max(0.0, step / max(1, warm) * (1 - floor) + floor)
    if step < warm + stable:
        return 1.0
    if step < warm + stable + decay:
        p = (step - warm - stable) / max(1, decay)
        f = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - p**0.5}
        return max(0.0, f[decay_type] * (1 - floor) + floor)
    return floor


def test_constant_schedules_match_transformers():
    # get_constant_schedule: 1 from step 0; get_constant_schedule_with_warmup: step / warmup.
    np.testing.assert_allclose(_lrs(20, lr_scheduler_type="constant"), 1.0)
    lrs = _lrs(20, lr_scheduler_type="constant_with_warmup", warmup_steps=4)
    np.testing.assert_allclose(lrs[:6], [0, 0.25, 0.5, 0.75, 1, 1], atol=1e-7)
    np.testing.assert_allclose(lrs[4:], 1.0)


def test_cosine_with_min_lr_matches_transformers():
    # get_cosine_with_min_lr_schedule_with_warmup(warmup=10, total=100, min_lr_rate=0.1):
    # 0.5 * (1 + cos(pi * progress)) * (1 - 0.1) + 0.1 after warmup.
    lrs = _lrs(100, lr_scheduler_type="cosine_with_min_lr", warmup_ratio=0.1, min_lr_rate=0.1)
    for step in (0, 5, 10, 37, 55, 99, 100):
        progress = (step - 10) / 90
        want = step / 10 if step < 10 else 0.5 * (1 + math.cos(math.pi * progress)) * 0.9 + 0.1
        assert abs(lrs[step] - want) < 1e-6, (step, lrs[step], want)
    assert abs(lrs[100] - 0.1) < 1e-6


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "1-sqrt"])
def test_wsd_matches_transformers(decay_type):
    # 100 steps, warmup 10, decay ceil(0.2 * 100) = 20: stable from 10 to 80.
    lrs = _lrs(
        100,
        lr_scheduler_type="wsd",
        warmup_steps=10,
        decay_ratio=0.2,
        decay_type=decay_type,
        min_lr_rate=0.05,
    )
    want = [_hf_wsd(s, 10, 70, 20, decay_type, 0.05) for s in range(101)]
    np.testing.assert_allclose(lrs, want, atol=1e-6)
    assert lrs[0] == pytest.approx(0.05) and lrs[79] == 1.0 and lrs[100] == pytest.approx(0.05)


ORACLE_SCHEDULES = """
import json, sys, torch
from transformers import get_scheduler
out = []
for c in json.load(open(sys.argv[1])):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=c["lr"])
    s = get_scheduler(c["name"], opt, num_warmup_steps=c["warm"],
                      num_training_steps=c["total"], scheduler_specific_kwargs=c["kw"])
    out.append([c["lr"] * s.lr_lambdas[0](i) for i in range(c["total"] + 3)])
print(json.dumps(out))
"""

# Every schedule by HF's name, with and without its --lr_scheduler_kwargs, odd step counts.
HF_SCHEDULES = [
    ("linear", 10, 100, {}),
    ("cosine", 0, 50, {}),
    ("cosine", 10, 100, {"num_cycles": 2.0}),
    ("cosine_with_restarts", 5, 37, {}),
    ("cosine_with_restarts", 10, 100, {"num_cycles": 3}),
    ("polynomial", 0, 40, {}),
    ("polynomial", 10, 100, {"lr_end": 0.1, "power": 2.0}),
    ("constant", 0, 20, {}),
    ("constant_with_warmup", 4, 20, {}),
    ("inverse_sqrt", 0, 30, {}),
    ("inverse_sqrt", 10, 100, {}),
    ("inverse_sqrt", 0, 60, {"timescale": 7}),
    ("cosine_with_min_lr", 10, 100, {"min_lr": 0.05, "num_cycles": 0.7}),
    ("cosine_warmup_with_min_lr", 10, 100, {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", 10, 100, {"min_lr_rate": 0.1, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", 10, 100, {"num_decay_steps": 20}),
    (
        "warmup_stable_decay",
        10,
        100,
        {
            "num_decay_steps": 20,
            "num_stable_steps": 30,  # 40 steps short of the run: the rest at the floor
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.1,
            "num_cycles": 1.0,
        },
    ),
    (
        "warmup_stable_decay",
        8,
        60,
        {
            "num_decay_steps": 12,
            "warmup_type": "1-sqrt",
            "decay_type": "linear",
            "min_lr_ratio": 0.2,
        },
    ),
]


def test_every_hf_schedule_matches_transformers_get_scheduler(tmp_path):
    """transformers' own `get_scheduler(name, ..., scheduler_specific_kwargs)` (in the
    HF oracle interpreter) against `schedule`, at every step of the run and two past it."""
    lr = 0.5
    cases = [dict(name=n, warm=w, total=t, kw=k, lr=lr) for n, w, t, k in HF_SCHEDULES]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    want = run_oracle(ORACLE_SCHEDULES, tmp_path / "cases.json")
    for (name, warm, total, kw), hf in zip(HF_SCHEDULES, want, strict=True):
        flags = [
            "--lr_scheduler_type",
            name,
            "--warmup_steps",
            str(warm),
            "--learning_rate",
            str(lr),
        ]
        flags += ["--lr_scheduler_kwargs", json.dumps(kw)] if kw else []
        f = schedule(parse_args(flags).optim, total)
        got = [float(f(i)) for i in range(total + 3)]
        np.testing.assert_allclose(got, hf, atol=1e-6, err_msg=f"{name} {kw}")


def test_hf_schedules_by_hand():
    """The same schedules without the oracle, at points worked out from HF's formulas."""
    # cosine_with_restarts, 3 cycles over 90 steps after 10 of warmup: restarts at 40, 70.
    lrs = _lrs(
        100,
        lr_scheduler_type="cosine_with_restarts",
        warmup_steps=10,
        lr_scheduler_kwargs='{"num_cycles": 3}',
    )
    assert lrs[10] == 1.0 and lrs[40] == pytest.approx(1.0) and lrs[70] == pytest.approx(1.0)
    assert lrs[25] == pytest.approx(0.5, abs=1e-6) and lrs[100] == 0.0
    # polynomial, power 2, lr_end 0.1: (1 - 0.1) * (1 - 45 / 90) ** 2 + 0.1 at step 55.
    lrs = _lrs(
        100,
        lr_scheduler_type="polynomial",
        warmup_steps=10,
        lr_scheduler_kwargs='{"power": 2, "lr_end": 0.1}',
    )
    assert lrs[55] == pytest.approx(0.9 * 0.25 + 0.1) and lrs[100] == pytest.approx(0.1)
    # inverse_sqrt, timescale = warmup = 16: 1 / sqrt(step / 16) after warmup.
    lrs = _lrs(100, lr_scheduler_type="inverse_sqrt", warmup_steps=16)
    assert lrs[64] == pytest.approx(0.5) and lrs[16] == pytest.approx(1.0)
    # warmup_stable_decay, 20 decay steps: held until 80, floor 0.1 reached at 100.
    lrs = _lrs(
        100,
        lr_scheduler_type="warmup_stable_decay",
        warmup_steps=10,
        lr_scheduler_kwargs='{"num_decay_steps": 20, "min_lr_ratio": 0.1}',
    )
    assert lrs[0] == pytest.approx(0.1) and lrs[79] == 1.0 and lrs[100] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lr_scheduler_kwargs", "{num_cycles: 3}"], "is not JSON"),
        (["--lr_scheduler_kwargs", "[3]"], "must be a JSON object of linear's arguments"),
        (
            ["--lr_scheduler_kwargs", '{"num_cycles": 3}'],
            "--lr_scheduler_type linear has no num_cycles \\(it takes none\\)",
        ),
        (
            ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"power": 2}'],
            "cosine has no power \\(its arguments: num_cycles\\)",
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_restarts",
                "--lr_scheduler_kwargs",
                '{"num_cycles": 1.5}',
            ],
            "num_cycles=1.5 must be a whole number >= 1",
        ),
        (
            ["--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"lr_end": 1e-4}'],
            "lr_end=0.0001 must be in \\[0, --learning_rate=5e-05\\)",
        ),
        (
            ["--lr_scheduler_type", "inverse_sqrt", "--lr_scheduler_kwargs", '{"timescale": 0}'],
            "timescale=0 must be a whole number of steps >= 1",
        ),
        (
            ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"num_cycles": "3"}'],
            "num_cycles='3' must be a number > 0",
        ),
        (["--lr_scheduler_type", "warmup_stable_decay"], "needs num_decay_steps"),
        (
            [
                "--lr_scheduler_type",
                "warmup_stable_decay",
                "--lr_scheduler_kwargs",
                '{"num_decay_steps": 5, "decay_type": "exp"}',
            ],
            "decay_type='exp' must be one of",
        ),
        (
            ["--lr_scheduler_type", "warmup_stable_decay", "--decay_ratio", "0.2"],
            "takes num_decay_steps and decay_type in --lr_scheduler_kwargs",
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_min_lr",
                "--lr_scheduler_kwargs",
                '{"min_lr": 1e-6, "min_lr_rate": 0.1}',
            ],
            "give one of min_lr and min_lr_rate",
        ),
        (
            [
                "--lr_scheduler_type",
                "cosine_with_min_lr",
                "--min_lr_rate",
                "0.1",
                "--lr_scheduler_kwargs",
                '{"min_lr_rate": 0.1}',
            ],
            "both set the floor",
        ),
        (["--lr_scheduler_type", "cosine_warmup_with_min_lr"], "or min_lr_rate or min_lr in"),
        (["--lr_scheduler_type", "reduce_lr_on_plateau"], "must be one of"),
    ],
)
def test_scheduler_kwargs_are_checked(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args(flags)


def test_scheduler_kwargs_from_yaml_and_the_floor_either_way(tmp_path):
    """A YAML config gives `lr_scheduler_kwargs` as a mapping; cosine_with_min_lr's floor
    as --min_lr_rate, or as HF's min_lr (absolute) or min_lr_rate, gives one schedule."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "optim:\n  lr_scheduler_type: cosine_with_restarts\n"
        "  lr_scheduler_kwargs: {num_cycles: 2}\n"
    )
    args = parse_args(["--config", str(config)]).optim
    assert json.loads(args.lr_scheduler_kwargs) == {"num_cycles": 2}
    spelt = [
        ["--min_lr_rate", "0.1"],
        ["--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}'],
        ["--lr_scheduler_kwargs", '{"min_lr": 1e-4}'],
    ]
    runs = []
    for extra in spelt:
        o = parse_args(
            ["--lr_scheduler_type", "cosine_with_min_lr", "--learning_rate", "1e-3", *extra]
        ).optim
        f = schedule(o, 50)
        runs.append([float(f(i)) for i in range(51)])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)
    np.testing.assert_allclose(runs[2], runs[0], rtol=1e-6)
    assert runs[0][-1] == pytest.approx(1e-4)


def test_warmup_stable_decay_longer_than_the_run_is_refused():
    o = parse_args(
        [
            "--lr_scheduler_type",
            "warmup_stable_decay",
            "--warmup_steps",
            "10",
            "--lr_scheduler_kwargs",
            '{"num_decay_steps": 95}',
        ]
    ).optim
    with pytest.raises(ValueError, match="num_decay_steps=95 is more than the run's 90 steps"):
        schedule(o, 100)


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lr_scheduler_type", "wsd"], "wsd needs --decay_ratio"),
        (["--lr_scheduler_type", "wsd", "--decay_ratio", "0.95", "--warmup_ratio", "0.1"], "0.95"),
        (["--min_lr_rate", "0.1"], "--min_lr_rate=0.1 is used by"),
        (["--min_lr_rate", "1.5", "--lr_scheduler_type", "wsd"], "--min_lr_rate=1.5 must be"),
        (["--decay_ratio", "0.1"], "--decay_ratio=0.1 is used by --lr_scheduler_type wsd"),
        (
            ["--lr_scheduler_type", "linear", "--decay_type", "1-sqrt"],
            "--decay_type='1-sqrt' is used by --lr_scheduler_type wsd, not 'linear'",
        ),
        (["--lr_scheduler_type", "constant", "--warmup_steps", "3"], "constant_with_warmup"),
        (["--decay_type", "exp"], "--decay_type='exp' must be one of"),
        (["--optim", "sgd"], "--optim='sgd' must be one of"),
    ],
)
def test_schedule_and_optimizer_flags_are_checked(flags, match):
    with pytest.raises(ValueError, match=match):
        parse_args(flags)


def test_fsdp_off_refuses_an_fsdp_axis(tmp_path, capsys):
    # `--fsdp ""` turns FSDP off: a -1 goes to data, and an fsdp axis above 1 is refused
    # (it would still shard over it).
    assert parse_mesh("data=1,fsdp=1,seq=2", 2, fsdp=False)["fsdp"] == 1
    with pytest.raises(ValueError) as error:
        parse_mesh("data=1,fsdp=2,seq=2", 4, fsdp=False)
    assert str(error.value).startswith(
        "--mesh 'data=1,fsdp=2,seq=2' gives fsdp=2 but --fsdp '' turns FSDP off: "
    )
    from train.__main__ import main

    flags = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "1"]
    flags += ["--fsdp", "", "--mesh", "data=1,fsdp=2,seq=2", "--output_dir", str(tmp_path)]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mesh 'data=1,fsdp=2,seq=2' gives fsdp=2 but --fsdp ''"), err
    assert "Traceback" not in err


def _one_update(name: str, weight_decay: float, **kw):
    """`(params, grads, new params)` after one step at lr 0.1 (constant)."""
    args = OptimArgs(
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim=name,
        weight_decay=weight_decay,
        max_grad_norm=0.0,
        **kw,
    )
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w": {"kernel": jax.random.normal(keys[0], (4, 8))},
        "norm": {"scale": 1.0 + jax.random.normal(keys[1], (8,))},
    }
    grads = {
        "w": {"kernel": jax.random.normal(keys[2], (4, 8))},
        "norm": {"scale": jax.random.normal(keys[3], (8,))},
    }
    tx = optimizer(args, 10)
    updates, _ = tx.update(grads, tx.init(params), params)
    return params, grads, jax.tree.map(jnp.add, params, updates)


def test_lion_first_update_is_sign_with_decoupled_decay():
    # Lion: u = sign((1 - b1) * g) at step one (momentum 0), p -= lr * (u + wd * p),
    # norm scales not decayed.
    params, grads, new = _one_update("lion", 0.5, adam_beta1=0.8, adam_beta2=0.95)
    w, g = params["w"]["kernel"], grads["w"]["kernel"]
    np.testing.assert_allclose(new["w"]["kernel"], w - 0.1 * (jnp.sign(g) + 0.5 * w), rtol=1e-6)
    s, gs = params["norm"]["scale"], grads["norm"]["scale"]
    np.testing.assert_allclose(new["norm"]["scale"], s - 0.1 * jnp.sign(gs), rtol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_weight_decay_is_lr_times_wd_and_skips_norm_scales(name):
    params, _, plain = _one_update(name, 0.0)
    _, _, decayed = _one_update(name, 0.5)
    w = params["w"]["kernel"]
    np.testing.assert_allclose(decayed["w"]["kernel"] - plain["w"]["kernel"], -0.05 * w, atol=1e-6)
    np.testing.assert_array_equal(decayed["norm"]["scale"], plain["norm"]["scale"])


def test_adafactor_step_has_an_absolute_lr():
    # HF Trainer's Adafactor (no parameter scale): the first update's RMS is at most lr
    # (update clipping at 1), whatever the parameters' size.
    params, _, new = _one_update("adafactor", 0.0)
    step = new["w"]["kernel"] - params["w"]["kernel"]
    rms = float(jnp.sqrt(jnp.mean(step**2)))
    assert 0.05 < rms <= 0.1 + 1e-6


def _hf_adafactor_steps(params, grads_by_step, lr, wd):
    """transformers.Adafactor(scale_parameter=False, relative_step=False), written out for
    one tensor as HF holds it: factored second moments for a matrix (rows' and columns'
    means of g^2 + 1e-30, beta2 = 1 - step^-0.8), the update clipped to an RMS of 1,
    `p -= lr * wd * p`, then `p -= lr * update`."""
    p = np.asarray(params, np.float64)
    row = col = v = None
    for step, g in enumerate(grads_by_step, start=1):
        g = np.asarray(g, np.float64)
        beta2, sq = 1 - step**-0.8, g * g + 1e-30
        if p.ndim >= 2:
            row = sq.mean(-1) if row is None else beta2 * row + (1 - beta2) * sq.mean(-1)
            col = sq.mean(-2) if col is None else beta2 * col + (1 - beta2) * sq.mean(-2)
            u = g / np.sqrt(row / row.mean(-1, keepdims=True))[:, None] / np.sqrt(col)[None]
        else:
            v = sq if v is None else beta2 * v + (1 - beta2) * sq
            u = g / np.sqrt(v)
        u /= max(np.sqrt(np.mean(u * u)), 1.0)
        p = p - lr * wd * p - lr * u
    return p


def test_adafactor_is_hfs_one_layer_at_a_time():
    """--optim adafactor against HF's Adafactor written out: per layer of a stacked
    `layers/...` leaf (each layer's update clipped on its own, as HF's separate tensors
    are), small matrices factored too, norm vectors kept whole, the embedding and head
    as one matrix each; weight decay but on norm scales."""
    rng = np.random.default_rng(0)
    shapes = {
        ("layers", "mlp", "kernel"): (3, 40, 24),
        ("layers", "norm", "scale"): (3, 24),
        ("embed", "embedding"): (50, 24),
        ("final_norm", "scale"): (24,),
    }
    params, grads = {}, [{} for _ in range(3)]
    for path, shape in shapes.items():
        leaf = rng.normal(size=shape).astype(np.float32)
        *outer, last = path
        node = params
        for key in outer:
            node = node.setdefault(key, {})
        node[last] = leaf
        for step in range(3):
            g = (
                rng.normal(size=shape).astype(np.float32)
                * (1 + 50 * (np.arange(shape[0]) == 0))[(...,) + (None,) * (len(shape) - 1)]
            )  # one layer's (row's) gradient 50x the rest: the clipping tells them apart
            node = grads[step]
            for key in outer:
                node = node.setdefault(key, {})
            node[last] = g
    args = OptimArgs(
        optim="adafactor", learning_rate=0.01, weight_decay=0.1, max_grad_norm=0.0,
        lr_scheduler_type="constant",
    )  # fmt: skip
    tx = optimizer(args, 3)
    p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
    for g in grads:
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
        p = jax.tree.map(jnp.add, p, updates)

    def leaf(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    for path in shapes:
        wd = 0.0 if path[-1] == "scale" else 0.1
        got, start = np.asarray(leaf(p, path)), leaf(params, path)
        steps = [leaf(g, path) for g in grads]
        if path[0] == "layers":  # HF's tensors: one per layer
            want = np.stack([_hf_adafactor_steps(start[i], [g[i] for g in steps], 0.01, wd)
                             for i in range(start.shape[0])])  # fmt: skip
        else:
            want = _hf_adafactor_steps(start, steps, 0.01, wd)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want - start).max())


def test_hf_optimizer_names_and_settings_the_optimizer_ignores():
    """HF's names for AdamW are taken as adamw; Adam settings away from their defaults are
    refused where the optimizer has no use for them (a run's saved settings, which
    hold every default, pass)."""
    for name in ("adamw_torch", "adamw_torch_fused", "adamw_hf"):
        assert parse_args(["--optim", name]).optim.optim == "adamw"
    refused = [
        ("adafactor", "--adam_beta1", "0.8"),
        ("adafactor", "--adam_beta2", "0.95"),
        ("adafactor", "--adam_epsilon", "1e-06"),
        ("lion", "--adam_epsilon", "1e-06"),
    ]
    for optim, flag, value in refused:
        with pytest.raises(ValueError, match=f"^{flag}={value} is not used by --optim {optim}$"):
            parse_args(["--optim", optim, flag, value])
    assert parse_args(["--optim", "adafactor", "--adam_beta1", "0.9"]).optim.optim == "adafactor"
    assert parse_args(["--optim", "lion", "--adam_beta2", "0.99"]).optim.adam_beta2 == 0.99


def test_defaults_and_warmup_fractions_are_hfs():
    """An HF command line that leaves the optimizer flags out trains as HF would:
    TrainingArguments' learning rate (5e-5) and linear schedule; transformers 5's
    `--warmup_steps` below 1 is a fraction of the run (ceil), 1 and above steps; and
    `cosine_with_min_lr` without its floor is refused, as HF refuses it."""
    from train.optim import warmup_steps

    args = parse_args([]).optim
    assert (args.learning_rate, args.lr_scheduler_type) == (5e-5, "linear")
    assert warmup_steps(parse_args(["--warmup_steps", "0.03"]).optim, 100) == 3
    assert warmup_steps(parse_args(["--warmup_steps", "0.25"]).optim, 10) == 3  # ceil(2.5)
    whole = parse_args(["--warmup_steps", "4"]).optim
    assert whole.warmup_steps == 4 and isinstance(whole.warmup_steps, int)
    assert warmup_steps(whole, 100) == 4
    with pytest.raises(ValueError, match="cosine_with_min_lr needs --min_lr_rate in"):
        parse_args(["--lr_scheduler_type", "cosine_with_min_lr"])
    floored = parse_args(["--lr_scheduler_type", "cosine_with_min_lr", "--min_lr_rate", "0.1"])
    assert floored.optim.min_lr_rate == 0.1
