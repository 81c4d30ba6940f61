"""AdamW, Adafactor or Lion (optax) with HuggingFace-exact learning-rate schedules and
gradient clipping."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from train.config import OPTIMIZERS, OptimArgs


def warmup_steps(args: OptimArgs, total_steps: int) -> int:
    """HF `TrainingArguments.get_warmup_steps`: explicit steps, else ceil(ratio * total)."""
    return (
        args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total_steps)
    )


def decay_steps(args: OptimArgs, total_steps: int) -> int:
    """wsd: the last `ceil(decay_ratio * total)` steps decay (rounded as warmup is), at
    most the steps after warmup."""
    decay = math.ceil(args.decay_ratio * total_steps)
    return min(decay, max(0, total_steps - warmup_steps(args, total_steps)))


def schedule(args: OptimArgs, total_steps: int) -> optax.Schedule:
    """The LR at optimizer step `count` (0-based), as HF's `get_scheduler(name)`.

    Warmup is `lr * step / warmup` (wsd: from the floor, `min_lr_rate`, up to `lr`), then:
    cosine: `lr * 0.5 * (1 + cos(pi * progress))`, progress 0 -> 1 after warmup;
    cosine_with_min_lr: the same factor scaled into `[min_lr_rate, 1]`;
    linear: decays to 0 at `total_steps`; constant: `lr` from step 0 (no warmup);
    constant_with_warmup: `lr` after warmup;
    wsd (HF `get_wsd_schedule`): warmup, `lr` held, then the last `decay_steps` decay
    (`decay_type` linear | cosine | 1-sqrt) to `lr * min_lr_rate`.
    """
    warm = warmup_steps(args, total_steps)
    peak = args.learning_rate
    kind = args.lr_scheduler_type
    floor = args.min_lr_rate
    decay = decay_steps(args, total_steps)
    stable_end = total_steps - decay

    def shape(progress, decay_type):
        if decay_type == "linear":
            return 1.0 - progress
        if decay_type == "1-sqrt":
            return 1.0 - jnp.sqrt(progress)
        return 0.5 * (1.0 + jnp.cos(jnp.pi * progress))

    def lr(count):
        step = jnp.asarray(count, jnp.float32)
        ramp = step / max(1, warm)
        progress = (step - warm) / max(1, total_steps - warm)
        if kind == "cosine":
            after = jnp.maximum(0.0, shape(progress, "cosine"))
        elif kind == "cosine_with_min_lr":
            after = jnp.maximum(0.0, shape(progress, "cosine") * (1.0 - floor) + floor)
        elif kind == "linear":
            after = jnp.maximum(0.0, (total_steps - step) / max(1, total_steps - warm))
        elif kind == "wsd":
            ramp = ramp * (1.0 - floor) + floor
            down = jnp.clip((step - stable_end) / max(1, decay), 0.0, 1.0)
            decayed = jnp.maximum(0.0, shape(down, args.decay_type) * (1.0 - floor) + floor)
            after = jnp.where(step < stable_end, 1.0, decayed)
        elif kind == "constant":
            return peak * jnp.ones_like(step)
        else:  # constant_with_warmup
            after = jnp.ones_like(step)
        return peak * jnp.where(step < warm, ramp, after)

    return lr


def _decay_mask(params):
    """HF decays every weight except biases and norm weights: here, all but norm scales."""

    def decays(path, _):
        return getattr(path[-1], "key", None) != "scale"

    return jax.tree_util.tree_map_with_path(decays, params)


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
        # no momentum. optax adds the decay after the LR scaling, so it gets lr * wd.
        decay = None
        if args.weight_decay > 0:
            decay = lambda count: args.weight_decay * lr(count)
        update = optax.adafactor(
            lr,
            multiply_by_parameter_scale=False,
            weight_decay_rate=decay,
            weight_decay_mask=_decay_mask,
        )
    else:
        raise ValueError(f"--optim={args.optim!r} must be one of {OPTIMIZERS}")
    clip = optax.clip_by_global_norm(args.max_grad_norm) if args.max_grad_norm > 0 else None
    return optax.chain(clip or optax.identity(), update)
