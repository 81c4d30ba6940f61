"""Named model presets (architectures as published on the HF Hub).

Each preset is a :class:`~models.config.LlamaConfig` with float32 numerics;
derive training variants with ``LLAMA3_2_1B.replace(dtype="bfloat16", remat="save_attn")``.
"""

from __future__ import annotations

from models.config import LlamaConfig, RopeConfig

_LLAMA3_ROPE_8 = RopeConfig(
    theta=500000.0,
    type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
_LLAMA3_ROPE_32 = RopeConfig(
    theta=500000.0,
    type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

LLAMA2_7B = LlamaConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)
LLAMA2_13B = LlamaConfig(
    vocab_size=32000,
    hidden_size=5120,
    intermediate_size=13824,
    num_layers=40,
    num_heads=40,
    num_kv_heads=40,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)
# "Llama-2-3B" as the PyTorch + LightSeq training scripts name it: the OpenLLaMA-3B
# shape (head_dim 100).
LLAMA2_3B = LlamaConfig(
    vocab_size=32000,
    hidden_size=3200,
    intermediate_size=8640,
    num_layers=26,
    num_heads=32,
    num_kv_heads=32,
    head_dim=100,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=500000.0),
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_id=128001,
)
LLAMA3_1_8B = LLAMA3_8B.replace(rope=_LLAMA3_ROPE_8, max_position_embeddings=131072)
LLAMA3_2_1B = LlamaConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope=_LLAMA3_ROPE_32,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_id=128001,
)
LLAMA3_2_3B = LLAMA3_2_1B.replace(
    hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128
)
# For tests and smoke runs: GQA with 2 query heads per KV head.
TINY = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)

PRESETS: dict[str, LlamaConfig] = {
    "llama2_7b": LLAMA2_7B,
    "llama2_13b": LLAMA2_13B,
    "llama2_3b": LLAMA2_3B,
    "llama3_8b": LLAMA3_8B,
    "llama3_1_8b": LLAMA3_1_8B,
    "llama3_2_1b": LLAMA3_2_1B,
    "llama3_2_3b": LLAMA3_2_3B,
    "tiny": TINY,
}
# Each preset's name as command lines spell it (`--model_name_or_path llama3.2-1b`,
# `python -m train.tools.profile --models llama3.2-1b`) and as the profile's rows and
# reports name it: the published name in lower case. `preset_name` gives it for any
# spelling `preset` takes.
PRESET_NAMES: dict[str, str] = {
    "llama2_7b": "llama2-7b",
    "llama2_13b": "llama2-13b",
    "llama2_3b": "llama2-3b",
    "llama3_8b": "llama3-8b",
    "llama3_1_8b": "llama3.1-8b",
    "llama3_2_1b": "llama3.2-1b",
    "llama3_2_3b": "llama3.2-3b",
    "tiny": "tiny",
}


def _key(name: str) -> str:
    """The `PRESETS` key of preset `name`, ignoring case and separators; a ValueError
    for a name no preset has."""

    def squash(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    matches = [key for key in PRESETS if squash(key) == squash(name)]
    if not matches:
        raise ValueError(
            f"unknown preset {name!r}; known: {', '.join(sorted(PRESET_NAMES.values()))}"
        )
    return matches[0]


def preset(name: str) -> LlamaConfig:
    """The preset called ``name``, ignoring case and separators (``Llama-3.2-1B``)."""
    return PRESETS[_key(name)]


def preset_name(name: str) -> str:
    """Preset ``name`` (any spelling :func:`preset` takes: ``Llama-3.2-1B``,
    ``llama3_2_1b``) as ``PRESET_NAMES`` spells it (``llama3.2-1b``)."""
    return PRESET_NAMES[_key(name)]
