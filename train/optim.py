"""AdamW with HuggingFace-exact learning-rate schedules and gradient clipping."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from train.config import OptimArgs


def warmup_steps(args: OptimArgs, total_steps: int) -> int:
    """HF `TrainingArguments.get_warmup_steps`: explicit steps, else ceil(ratio * total)."""
    return (
        args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total_steps)
    )


def schedule(args: OptimArgs, total_steps: int) -> optax.Schedule:
    """The LR at optimizer step `count` (0-based), as HF's `get_*_schedule_with_warmup`.

    cosine: `lr * step/warmup` during warmup, then `lr * 0.5 * (1 + cos(pi * progress))`;
    linear: decays to 0 at `total_steps`; constant: HF "constant" (no warmup) unless
    warmup is set, then "constant_with_warmup".
    """
    warm = warmup_steps(args, total_steps)
    peak = args.learning_rate
    kind = args.lr_scheduler_type

    def lr(count):
        step = jnp.asarray(count, jnp.float32)
        ramp = step / max(1, warm)
        progress = (step - warm) / max(1, total_steps - warm)
        if kind == "cosine":
            after = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            after = jnp.maximum(0.0, after)
        elif kind == "linear":
            after = jnp.maximum(0.0, (total_steps - step) / max(1, total_steps - warm))
        else:
            after = jnp.ones_like(step)
        return peak * jnp.where(step < warm, ramp, after)

    return lr


def _decay_mask(params):
    """HF decays every weight except biases and norm weights: here, all but norm scales."""

    def decays(path, _):
        return getattr(path[-1], "key", None) != "scale"

    return jax.tree_util.tree_map_with_path(decays, params)


def optimizer(args: OptimArgs, total_steps: int) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(args.max_grad_norm)
        if args.max_grad_norm > 0
        else optax.identity(),
        optax.adamw(
            schedule(args, total_steps),
            b1=args.adam_beta1,
            b2=args.adam_beta2,
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            mask=_decay_mask,
        ),
    )
