"""Flax NNX Llama-2/3, exact to HuggingFace ``LlamaForCausalLM``, with HF conversion.

A user's first lines::

    import models
    config, params = models.load_hf("/ckpt/Llama-3.2-1B")       # host numpy pytree
    logits = models.logits(config, params, input_ids)          # f32 [B, T, V]
    models.export_hf(params, config, "/out/hf")                 # transformers loads it

Training (the pure-pytree forward the trainer jits; ``config`` and ``attention``
are static)::

    config = models.LLAMA3_2_1B.replace(dtype="bfloat16", remat="save_attn")
    params = models.init_params(config, jax.random.key(0))
    attention = models.AttentionConfig(kind="ring", mesh=mesh, layout="zigzag")
    hidden = models.hidden_states(config, params, ids, positions, attention=attention)
    loss_sum, n = models.chunked_cross_entropy(
        hidden, models.lm_head_weight(config, params), labels)
    # or: models.cross_entropy(models.logits(config, params, ids, positions,
    #                                         attention=attention), labels)

``positions`` are global token positions ``[B, T]``: with a ``ring`` attention in a
zigzag or striped layout permute ids, labels and any segment ids once with
``jflash.to_layout(x, attention.layout_shards, attention.layout, axis=1)`` (the ring
axis's size under ``hybrid``, not every sequence device's); positions left out are
that order's, ``attention.positions(T)``. Positions that restart at each packed
document go with one segment id per document. Labels are aligned with logits
(:func:`next_token_labels`, -100 ignored).

Modules: ``config`` (dataclasses, HF config.json), ``presets``, ``rope``,
``attention`` (backend injection), ``llama`` (NNX modules), ``functional``
(pytree entry points), ``convert`` (HF <-> params table, CLI
``python -m models.convert``), ``loss``, ``flops``.
"""

import importlib.util as _util
import sys as _sys

# The `train` extra's packages the models import (`import jflash` needs none of them).
_missing = [name for name in ("flax", "ml_dtypes") if _util.find_spec(name) is None]
if _missing:
    _words = (
        f"jflash's models need {' and '.join(_missing)}, not installed: pip install 'jflash[train]'"
    )
    if _sys.argv[:1] == ["-m"]:  # `python -m models.convert`: a command's one line
        raise SystemExit(f"error: {_words}")
    raise ImportError(_words)

from models.attention import ATTENTION_KINDS, AttentionConfig
from models.config import LlamaConfig, RopeConfig, from_hf_config, to_hf_config
from models.flops import (
    FlopsPerToken,
    document_keys,
    flops_per_token,
    matmul_param_count,
    param_count,
    training_flops_per_token,
)
from models.functional import (
    Params,
    abstract_params,
    bind,
    check_params,
    hidden_states,
    init_params,
    lm_head_table,
    lm_head_weight,
    logits,
)
from models.llama import MLP, SAVE_ATTN_NAMES, Attention, DecoderLayer, Llama, RMSNorm
from models.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy, next_token_labels
from models.presets import (
    LLAMA2_3B,
    LLAMA2_7B,
    LLAMA2_13B,
    LLAMA3_1_8B,
    LLAMA3_2_1B,
    LLAMA3_2_3B,
    LLAMA3_8B,
    PRESET_NAMES,
    PRESETS,
    TINY,
    preset,
    preset_name,
)

__all__ = [
    "ATTENTION_KINDS",
    "IGNORE_INDEX",
    "LLAMA2_13B",
    "LLAMA2_3B",
    "LLAMA2_7B",
    "LLAMA3_1_8B",
    "LLAMA3_2_1B",
    "LLAMA3_2_3B",
    "LLAMA3_8B",
    "MAPPINGS",
    "MLP",
    "PRESETS",
    "PRESET_NAMES",
    "SAVE_ATTN_NAMES",
    "TINY",
    "Attention",
    "AttentionConfig",
    "DecoderLayer",
    "FlopsPerToken",
    "Llama",
    "LlamaConfig",
    "Params",
    "RMSNorm",
    "RopeConfig",
    "abstract_params",
    "bind",
    "check_params",
    "chunked_cross_entropy",
    "cross_entropy",
    "document_keys",
    "export_hf",
    "flops_per_token",
    "from_hf_config",
    "hidden_states",
    "init_params",
    "lm_head_table",
    "lm_head_weight",
    "load_hf",
    "load_native",
    "logits",
    "matmul_param_count",
    "next_token_labels",
    "param_count",
    "preset",
    "preset_name",
    "save_native",
    "to_hf_config",
    "training_flops_per_token",
]

# `models.convert` is also a command (`python -m models.convert`): imported on first use,
# so running it does not find the module already imported by this package.
_CONVERT = ("MAPPINGS", "export_hf", "load_hf", "load_native", "save_native")


def __getattr__(name: str):
    if name in _CONVERT:
        from models import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
