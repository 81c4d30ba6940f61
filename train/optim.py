"""AdamW, Adafactor or Lion (optax; Adafactor as HF's, per layer) with HuggingFace-exact
learning-rate schedules and gradient clipping."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from train.config import OPTIMIZERS, OptimArgs, scheduler_kwargs


def warmup_steps(args: OptimArgs, total_steps: int) -> int:
    """HF `TrainingArguments.get_warmup_steps`: `--warmup_steps` (transformers 5: below 1,
    a fraction of the run: ceil(fraction * total)), else ceil(`--warmup_ratio` * total)."""
    steps = args.warmup_steps
    if steps >= 1:
        return int(steps)
    return math.ceil((steps if steps > 0 else args.warmup_ratio) * total_steps)


def decay_steps(args: OptimArgs, total_steps: int) -> int:
    """wsd: the last `ceil(decay_ratio * total)` steps decay (rounded as warmup is), at
    most the steps after warmup."""
    decay = math.ceil(args.decay_ratio * total_steps)
    return min(decay, max(0, total_steps - warmup_steps(args, total_steps)))


def schedule(args: OptimArgs, total_steps: int) -> optax.Schedule:
    """The LR at optimizer step `count` (0-based), as HF's `get_scheduler(name)` with
    `--lr_scheduler_kwargs` as its `scheduler_specific_kwargs`.

    Warmup is `lr * step / warmup` (wsd and warmup_stable_decay: from the floor up to
    `lr`; cosine_warmup_with_min_lr: HF's own), then:
    linear: decays to 0 at `total_steps`; cosine: `lr * 0.5 * (1 + cos(2 pi num_cycles
    progress))`, progress 0 -> 1 after warmup; cosine_with_restarts: `num_cycles` hard
    restarts of a half cosine; polynomial: `(lr - lr_end) * (1 - progress) ** power +
    lr_end`; inverse_sqrt: `lr / sqrt((step + timescale - warmup) / timescale)`;
    cosine_with_min_lr and cosine_warmup_with_min_lr: the cosine scaled into `[floor, 1]`;
    constant: `lr` from step 0 (no warmup); constant_with_warmup: `lr` after warmup;
    warmup_stable_decay (HF `get_wsd_schedule`): warmup, `lr` held, then `num_decay_steps`
    decay to the floor; wsd: the same, the last `decay_steps` decaying (`decay_type`).
    """
    kw = scheduler_kwargs(args)
    warm = warmup_steps(args, total_steps)
    peak = args.learning_rate
    kind = args.lr_scheduler_type
    floor = kw["floor"]
    cycles = kw.get("num_cycles", 0.5)
    if kind == "wsd":
        decay = decay_steps(args, total_steps)
        stable = total_steps - decay - warm
        warmup_type, decay_type = "linear", args.decay_type
    elif kind == "warmup_stable_decay":
        decay = kw["num_decay_steps"]
        stable = kw["num_stable_steps"]
        if stable is None:
            stable = total_steps - warm - decay
            if stable < 0:
                raise ValueError(
                    f"--lr_scheduler_kwargs num_decay_steps={decay} is more than the run's "
                    f"{total_steps - warm} steps after {warm} of warmup"
                )
        warmup_type, decay_type = kw["warmup_type"], kw["decay_type"]

    def wave(progress):
        return 0.5 * (1.0 + jnp.cos(jnp.pi * cycles * 2.0 * progress))

    def shape(progress, kind_of):
        if kind_of == "linear":
            return 1.0 - progress
        if kind_of == "1-sqrt":
            return 1.0 - jnp.sqrt(progress)
        return wave(progress)

    def rise(progress, kind_of):
        if kind_of == "linear":
            return progress
        if kind_of == "1-sqrt":
            return 1.0 - jnp.sqrt(1.0 - progress)
        return 0.5 * (1.0 - jnp.cos(jnp.pi * progress))

    def lr(count):
        step = jnp.asarray(count, jnp.float32)
        ramp = step / max(1, warm)
        progress = (step - warm) / max(1, total_steps - warm)
        if kind == "constant":
            return peak * jnp.ones_like(step)
        if kind == "constant_with_warmup":
            after = jnp.ones_like(step)
        elif kind == "linear":
            after = jnp.maximum(0.0, (total_steps - step) / max(1, total_steps - warm))
        elif kind == "cosine":
            after = jnp.maximum(0.0, wave(progress))
        elif kind == "cosine_with_min_lr":
            after = jnp.maximum(0.0, wave(progress) * (1.0 - floor) + floor)
        elif kind == "cosine_with_restarts":
            turn = jnp.pi * jnp.mod(cycles * progress, 1.0)
            after = jnp.where(progress >= 1.0, 0.0, jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(turn))))
        elif kind == "polynomial":
            end = kw["lr_end"]
            left = jnp.maximum(0.0, 1.0 - progress)
            after = jnp.where(
                step > total_steps, end / peak, ((peak - end) * left ** kw["power"] + end) / peak
            )
        elif kind == "inverse_sqrt":
            scale = kw["timescale"] or warm or 10_000
            after = 1.0 / jnp.sqrt((step + scale - warm) / scale)
        elif kind == "cosine_warmup_with_min_lr":
            start = kw["warmup_lr_rate"]
            if start is None:
                ramp = (step + 1.0) / max(1, warm)
            else:
                ramp = start + (1.0 - start) * step / max(1, warm - 1)
            late = (step - warm + 1.0) / max(1, total_steps - warm)
            after = jnp.maximum(0.0, wave(late) * (1.0 - floor) + floor)
        else:  # wsd, warmup_stable_decay
            ramp = jnp.maximum(0.0, rise(ramp, warmup_type) * (1.0 - floor) + floor)
            down = (step - warm - stable) / max(1, decay)
            decayed = jnp.maximum(0.0, shape(down, decay_type) * (1.0 - floor) + floor)
            after = jnp.where(
                step < warm + stable, 1.0, jnp.where(step < warm + stable + decay, decayed, floor)
            )
        return peak * jnp.where(step < warm, ramp, after)

    return lr


def _decay_mask(params):
    """HF decays every weight except biases and norm weights: here, all but norm scales."""

    def decays(path, _):
        return getattr(path[-1], "key", None) != "scale"

    return jax.tree_util.tree_map_with_path(decays, params)


class AdafactorState(NamedTuple):
    """`hf_adafactor`'s state: the step count and, in trees shaped as the parameters, the
    factored second moments' rows and columns, or the whole one (placeholders elsewhere)."""

    count: jax.Array
    v_row: Any
    v_col: Any
    v: Any


def _layer_axes(path) -> int:
    """How many leading axes of a parameter index layers: 1 under `layers` (the model
    stacks every per-layer leaf, `models.llama`), else 0."""
    return int(getattr(path[0], "key", None) == "layers")


def hf_adafactor(decay_rate: float = -0.8, eps: float = 1e-30, clip: float = 1.0):
    """HF Trainer's Adafactor (`transformers.Adafactor` with `scale_parameter=False,
    relative_step=False`, no momentum) up to the learning rate: each layer's weight as
    HF holds it, one matrix per layer, not the model's stacked `[L, ...]` leaf. Per
    layer, a matrix's second moment is factored into its rows' and columns' means, a
    vector's is kept whole, with `beta2 = 1 - step ** decay_rate`; the update `g / sqrt(v)`
    is then scaled down to an RMS of at most `clip`. (optax's adafactor clips each
    stacked leaf as a whole, and factors only matrices whose two largest sides reach 128.)"""

    def init(params):
        def moments(path, p):
            shape, lead = p.shape, _layer_axes(path)
            if p.ndim - lead >= 2:
                return (
                    jnp.zeros(shape[:-1], jnp.float32),
                    jnp.zeros(shape[:-2] + shape[-1:], jnp.float32),
                    jnp.zeros((1,), jnp.float32),
                )
            placeholder = jnp.zeros((1,), jnp.float32)
            return placeholder, placeholder, jnp.zeros(shape, jnp.float32)

        parts = jax.tree_util.tree_map_with_path(moments, params)
        rows, cols, whole = _unzip(params, parts, 3)
        return AdafactorState(jnp.zeros([], jnp.int32), rows, cols, whole)

    def update(updates, state, params=None):
        del params
        count = state.count + 1
        beta2 = 1.0 - count.astype(jnp.float32) ** decay_rate

        def one(path, g, v_row, v_col, v):
            g = g.astype(jnp.float32)
            lead = _layer_axes(path)
            sq = g * g + eps
            if g.ndim - lead >= 2:
                v_row = beta2 * v_row + (1 - beta2) * sq.mean(-1)
                v_col = beta2 * v_col + (1 - beta2) * sq.mean(-2)
                row = lax.rsqrt(v_row / v_row.mean(-1, keepdims=True))[..., None]
                u = g * row * lax.rsqrt(v_col)[..., None, :]
            else:
                v = beta2 * v + (1 - beta2) * sq
                u = g * lax.rsqrt(v)
            axes = tuple(range(lead, u.ndim))
            rms = jnp.sqrt(jnp.mean(u * u, axis=axes, keepdims=True))
            return u / jnp.maximum(rms / clip, 1.0), v_row, v_col, v

        out = jax.tree_util.tree_map_with_path(one, updates, state.v_row, state.v_col, state.v)
        new, rows, cols, whole = _unzip(updates, out, 4)
        return new, AdafactorState(count, rows, cols, whole)

    return optax.GradientTransformation(init, update)


def _unzip(like, tree, n: int) -> tuple:
    """`n` trees shaped as `like` from `tree`, `like`'s shape with an `n`-tuple per leaf."""
    inner = jax.tree.structure((0,) * n)
    return jax.tree.transpose(jax.tree.structure(like), inner, tree)


def update_settings(args: OptimArgs) -> dict:
    """The flags `optimizer` reads besides the schedule's, for `args.optim`: the
    settings a resumed run must keep (`train.loop`), since every step's update uses
    them."""
    names = {
        "adamw": ("adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay"),
        "lion": ("adam_beta1", "adam_beta2", "weight_decay"),
        "adafactor": ("weight_decay",),
    }[args.optim]
    return {k: getattr(args, k) for k in (*names, "max_grad_norm")}


def optimizer(args: OptimArgs, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then `--optim` under the schedule. Weight decay skips norm
    scales; it is decoupled and scaled by the LR in all three (AdamW's `lr * wd * p`)."""
    lr = schedule(args, total_steps)
    if args.optim == "adamw":
        update = optax.adamw(
            lr,
            b1=args.adam_beta1,
            b2=args.adam_beta2,
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            mask=_decay_mask,
        )
    elif args.optim == "lion":
        # HF passes its Adam betas to Lion too; the Lion paper uses b2=0.99.
        update = optax.lion(
            lr,
            b1=args.adam_beta1,
            b2=args.adam_beta2,
            weight_decay=args.weight_decay,
            mask=_decay_mask,
        )
    elif args.optim == "adafactor":
        # HF Trainer's Adafactor: an absolute LR (no relative step, no parameter scale),
        # no momentum; its decay `p -= lr * wd * p` before the update, as AdamW's.
        update = optax.chain(
            hf_adafactor(),
            optax.add_decayed_weights(args.weight_decay, mask=_decay_mask),
            optax.scale_by_learning_rate(lr),
        )
    else:
        raise ValueError(f"--optim={args.optim!r} must be one of {OPTIMIZERS}")
    clip = optax.clip_by_global_norm(args.max_grad_norm) if args.max_grad_norm > 0 else None
    return optax.chain(clip or optax.identity(), update)
