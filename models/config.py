"""Llama model configuration, read from and written to HuggingFace ``config.json``.

Two frozen dataclasses, one per concern:

* :class:`RopeConfig` -- rotary position embedding (theta and the ``rope_type``
  scaling: ``default``, ``linear`` or ``llama3``).
* :class:`LlamaConfig` -- the architecture (everything HF's ``LlamaConfig`` says
  that matters for the forward pass) plus the numerics and execution knobs that HF
  does not carry: compute ``dtype``, ``param_dtype``, ``scan_layers`` and ``remat``.

Both transformers 4.x (``rope_theta`` + ``rope_scaling``) and transformers 5.x
(``rope_parameters``) spellings are accepted by :func:`from_hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

import jax.numpy as jnp

RopeType = Literal["default", "linear", "llama3"]
RematPolicy = Literal["none", "full", "save_attn", "save_dots", "offload_attn", "offload_full"]

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
REMAT_POLICIES: tuple[str, ...] = (
    "none",
    "full",
    "save_attn",
    "save_dots",
    "offload_attn",
    "offload_full",
)
# `LlamaConfig.mlp_tile=-1` (auto): tiles of this many tokens once a device's share of
# the sequence reaches MLP_TILE_FROM tokens; shorter sequences run the MLP whole. Tiles
# cost speed where memory is not short: 6% of the 1B's tokens/s at 32k on one H200.
MLP_TILE_AUTO = 8192
MLP_TILE_FROM = 262144
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (HF ``rope_parameters``).

    Attributes:
        theta: base wavelength (``rope_theta``).
        type: ``default`` (no scaling), ``linear`` (positions divided by
            ``factor``) or ``llama3`` (frequency-dependent scaling of Llama 3.1+).
        factor: scaling factor for ``linear`` and ``llama3`` (8 for Llama 3.1,
            32 for Llama 3.2).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only; the pre-training context.
    """

    theta: float = 10000.0
    type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unknown rope type {self.type!r}; supported: {ROPE_TYPES}")
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"rope {name}={getattr(self, name)} must be finite")
        if self.theta <= 0:
            raise ValueError(f"rope theta={self.theta} must be positive")
        if self.factor <= 0:
            raise ValueError(f"rope factor={self.factor} must be positive")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor={self.high_freq_factor} > "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture and numerics of a Llama-2/3 decoder.

    Attributes:
        vocab_size: V.
        hidden_size: D, the model width.
        intermediate_size: F, the SwiGLU width.
        num_layers: L.
        num_heads: N, query heads.
        num_kv_heads: K, key/value heads (``N % K == 0``; K < N is GQA, K = 1 MQA).
        head_dim: H (explicit, as HF ``head_dim``; need not equal ``D // N``).
        rms_norm_eps: epsilon inside the RMSNorm square root.
        rope: rotary embedding parameters.
        tie_word_embeddings: the LM head reuses the token embedding.
        max_position_embeddings: informational (HF field; not a limit here).
        initializer_range: std of the normal initialiser (HF default 0.02).
        bos_token_id: carried through conversion.
        eos_token_id: carried through conversion (Llama 3 lists several).
        pad_token_id: carried through conversion (a tokenizer's padding id, if any).
        dtype: compute dtype (``"bfloat16"`` for training); norms, RoPE angles,
            softmax and logits are always computed in float32.
        param_dtype: storage dtype of the parameters (``"float32"`` master weights).
        scan_layers: ``jax.lax.scan`` over stacked layer parameters (fast compile);
            ``False`` unrolls the same stacked parameters in a Python loop (one
            named scope per layer in profiles). The parameter pytree is identical.
        remat: per-layer rematerialisation: ``none``, ``full``, ``save_attn``
            (saves only the attention output, so the backward pass recomputes the
            cheap projections and MLP but never the attention kernel) or ``save_dots``
            (also saves every projection's and the MLP's matmul outputs and the MLP's
            activation: only norms and RoPE are recomputed, for ~2.1 GB per layer at
            32k tokens of a 1B model); ``offload_attn`` and ``offload_full`` are
            ``save_attn`` and ``full`` with every saved tensor (each layer's input, and
            for ``offload_attn`` the attention output and log-sum-exp) moved to pinned
            host memory in the forward and back in the backward: no per-layer residual
            stays on the device.
        mlp_tile: tokens per MLP tile. The post-attention norm, MLP and residual add
            run over the sequence one tile at a time (``lax.map`` of a checkpointed
            tile), so the ``[T, F]`` intermediates exist for one tile only, forward and
            backward (the backward recomputes each tile's MLP). It divides a device's
            share of the sequence (with ring attention the tiles split each shard);
            ``0`` runs the MLP whole; ``-1`` (auto) uses :data:`MLP_TILE_AUTO` tokens
            once the share is at least :data:`MLP_TILE_FROM`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: RematPolicy = "none"
    mlp_tile: int = -1

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r} not in {DTYPES}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} not in {REMAT_POLICIES}")
        tile = self.mlp_tile
        if not isinstance(tile, int) or isinstance(tile, bool) or tile < -1:
            raise ValueError(f"mlp_tile={self.mlp_tile!r} must be -1 (auto), 0 (off) or a size")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The compute dtype as a jnp dtype."""
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        """The parameter dtype as a jnp dtype."""
        return jnp.dtype(self.param_dtype)

    def mlp_tile_for(self, local_len: int) -> int:
        """Tokens per MLP tile for a device's share of ``local_len`` tokens; 0: whole.

        Raises:
            ValueError: an explicit ``mlp_tile`` that does not divide ``local_len``.
        """
        tile = self.mlp_tile
        if tile == -1:
            if local_len < MLP_TILE_FROM:
                return 0
            tile = next((n for n in range(MLP_TILE_AUTO, 0, -1) if local_len % n == 0), local_len)
            return 0 if tile < 1024 else tile
        if tile == 0 or tile >= local_len:
            return 0
        if local_len % tile:
            raise ValueError(
                f"mlp_tile={tile} must divide the {local_len} tokens each device holds"
            )
        return tile

    @property
    def num_groups(self) -> int:
        """G = N // K query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> LlamaConfig:
        """``dataclasses.replace`` (validated again)."""
        return dataclasses.replace(self, **changes)


# HF keys we interpret; anything else in a config.json is carried by HF only.
_UNSUPPORTED_TRUE = ("attention_bias", "mlp_bias")


# A native directory's config (`models.save_native`), beside its `params.safetensors`.
NATIVE_CONFIG = "jflash_config.json"

_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


def _typed(hf: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """``hf[key]`` (``default`` when absent or null), refused unless it is a JSON value of
    ``kind`` (``int``, ``float`` or ``bool``): ``"false"`` is not false, ``4096.5`` not
    4096, and ``true`` not 1 (nothing is coerced into another value)."""
    value = hf.get(key)
    if value is None:
        return default
    if not _is_kind(value, kind):
        raise ValueError(f"config.json: {key}={value!r} must be {_KINDS[kind]}")
    return float(value) if kind is float else value


def _is_kind(value: Any, kind: type) -> bool:
    """Whether `value` is a JSON value of `kind` (`int`, `float` or `bool`; `str` too):
    an integer is a number, but true is neither."""
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


# The dataclass fields (their annotations' text) whose JSON values `_check_kinds` checks.
_FIELD_KINDS = {"int": int, "float": float, "bool": bool, "str": str}


def _check_kinds(cls: type, data: dict[str, Any]) -> None:
    """Refuses a value of `data` that is not of its `cls` field's kind: `"1e-6"` is not
    a number, nor `"false"` false (nothing is coerced into another value)."""
    for field in dataclasses.fields(cls):
        kind = _FIELD_KINDS.get(field.type)
        if kind is not None and field.name in data and not _is_kind(data[field.name], kind):
            what = "a string" if kind is str else _KINDS[kind]
            raise ValueError(f"{field.name}={data[field.name]!r} must be {what}")


def _token_id(hf: dict[str, Any], key: str) -> int | list[int] | None:
    """A ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: null, an integer or a
    list of integers."""
    value = hf.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"config.json: {key}={value!r} must be an integer or a list of them")
    return value


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """The RoPE a Llama ``config.json`` gives in transformers 5: ``rope_scaling`` (the
    4.x key) where it is given, else ``rope_parameters`` (see :func:`_rope_of`). Where
    both are given and each would give another RoPE, refused: transformers then reads
    ``rope_scaling`` alone, ``rope_parameters``' ``rope_theta`` too, so a config edited
    to add one beside the other runs a RoPE neither says."""
    params, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    if params and scaling:
        read, other = _rope_of(hf, scaling), _rope_of(hf, params)
        if read != other:
            raise ValueError(
                f"config.json: rope_scaling={scaling} and rope_parameters={params} give "
                f"different RoPE ({read} against {other}); transformers reads rope_scaling "
                "alone: keep the one the model was trained with"
            )
        return read
    return _rope_of(hf, scaling or params or {})


def _rope_of(hf: dict[str, Any], scaling: Any) -> RopeConfig:
    """The RoPE of one ``rope_scaling`` / ``rope_parameters`` object, as transformers 5
    standardises it for a Llama: ``rope_theta`` from the object, else the top level, else
    10,000; llama3's ``original_max_position_embeddings`` from the top level where it is
    given there, else the object's, else ``max_position_embeddings``."""
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json: rope scaling {scaling!r} must be an object")
    nested = sorted(k for k, v in scaling.items() if isinstance(v, dict))
    if nested:
        raise ValueError(
            f"config.json: rope parameters nested by layer type ({', '.join(nested)}) are "
            "not a Llama's (transformers' Llama ignores them and runs the default RoPE): "
            "write the inner object as rope_parameters"
        )
    scaling = dict(scaling)
    theta = _typed(scaling, "rope_theta", float)
    scaling.pop("rope_theta", None)
    if theta is None:
        theta = _typed(hf, "rope_theta", float, 10000.0)
    if scaling and "rope_type" not in scaling and "type" not in scaling:
        # transformers 5 runs default RoPE here, dropping the scaling with a warning;
        # a model trained with scaling would then run without it: refused instead.
        raise ValueError(
            f"config.json: rope scaling {scaling} names no 'rope_type' (transformers would "
            "drop it and run default RoPE)"
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope type {rope_type!r} in config.json; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if scaling.get("factor") is None:
        raise ValueError(f"rope type {rope_type!r} needs 'factor'; got {scaling}")
    factor = _typed(scaling, "factor", float)
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    if hf.get("original_max_position_embeddings") is not None:
        original = _typed(hf, "original_max_position_embeddings", int)
    elif scaling.get("original_max_position_embeddings") is not None:
        original = _typed(scaling, "original_max_position_embeddings", int)
    else:
        original = _typed(hf, "max_position_embeddings", int, 2048)
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if scaling.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope parameters missing {missing}; got {scaling}")
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=_typed(scaling, "low_freq_factor", float),
        high_freq_factor=_typed(scaling, "high_freq_factor", float),
        original_max_position_embeddings=original,
    )


def with_rope(
    config: LlamaConfig, theta: float | None = None, scaling: dict[str, Any] | None = None
) -> LlamaConfig:
    """``config`` with another RoPE, as a run extending its context sets it: ``theta``
    its base (None: the config's); ``scaling`` an HF ``rope_scaling`` object
    (``{"rope_type": "linear", "factor": 4}``, llama3's with its factors, or
    ``{"rope_type": "default"}`` for none; None: the config's scaling). llama3's
    ``original_max_position_embeddings``, where the object omits it, is the config's own
    when its RoPE is llama3 already, else ``max_position_embeddings``. ValueError for
    scaling transformers would not read."""
    if scaling is None:
        rope = config.rope if theta is None else dataclasses.replace(config.rope, theta=theta)
        return config.replace(rope=rope)
    hf = {
        "rope_theta": config.rope.theta if theta is None else theta,
        "max_position_embeddings": config.max_position_embeddings,
    }
    if config.rope.type == "llama3" and isinstance(scaling, dict):
        # A llama3 model keeps its pre-training context where the object names none:
        # max_position_embeddings is the extended one (an export raises it), and a run
        # continuing from that export with the same flag must get the same RoPE.
        scaling = {
            "original_max_position_embeddings": config.rope.original_max_position_embeddings,
            **{k: v for k, v in scaling.items() if v is not None},
        }
    try:
        return config.replace(rope=_rope_of(hf, scaling))
    except ValueError as e:  # its words are a config.json's
        words = str(e).replace("config.json: ", "").replace(" in config.json", "")
        raise ValueError(words) from None


def from_hf_config(hf: dict[str, Any] | str | os.PathLike[str]) -> LlamaConfig:
    """Builds a :class:`LlamaConfig` from an HF Llama ``config.json``.

    Args:
        hf: the parsed JSON dict, the path of a ``config.json``, or a model directory.

    Returns:
        The config, with default numerics (float32 compute and params, scanned,
        no remat); change them with :meth:`LlamaConfig.replace`.

    Raises:
        ValueError: not a Llama config, unknown rope type, missing fields, or a field
            whose JSON type is wrong (``"tie_word_embeddings": "false"``, a null size).
        NotImplementedError: biases in attention/MLP or an activation other than SiLU.
    """
    if not isinstance(hf, dict):
        path = os.fspath(hf)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except FileNotFoundError:
            folder = os.path.dirname(path)
            if os.path.isfile(os.path.join(folder, NATIVE_CONFIG)):
                raise ValueError(
                    f"{folder} is a native directory ({NATIVE_CONFIG}), not an HF one: "
                    f"`python -m models.convert --to-hf {folder} --out HF_DIR` makes one"
                ) from None
            raise ValueError(f"{path} does not exist (not an HF model directory?)") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(hf).__name__}")
        try:
            return _from_hf_dict(hf)
        except (ValueError, NotImplementedError) as e:  # named by the file
            said = str(e).replace(" in config.json", "")
            if said.startswith("config.json: "):
                said = f"{path}: {said.removeprefix('config.json: ')}"
            elif said.startswith("config.json "):
                said = f"{path} {said.removeprefix('config.json ')}"
            else:
                said = f"{path}: {said}"
            raise type(e)(said) from None
    return _from_hf_dict(hf)


def _from_hf_dict(hf: dict[str, Any]) -> LlamaConfig:
    """:func:`from_hf_config` of a parsed ``config.json``."""
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"model_type={model_type!r}: only 'llama' checkpoints are supported")
    architectures = hf.get("architectures") or []
    if "model_type" not in hf and any(not str(a).startswith("Llama") for a in architectures):
        raise ValueError(f"architectures={architectures}: only Llama checkpoints are supported")
    for key in _UNSUPPORTED_TRUE:
        if hf.get(key, False):
            raise NotImplementedError(f"config.json has {key}=true; Llama biases are unsupported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names of one function
        raise NotImplementedError(f"hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    required = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ]
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise ValueError(f"config.json is missing required keys {missing}")
    num_heads = _typed(hf, "num_attention_heads", int)
    hidden_size = _typed(hf, "hidden_size", int)
    head_dim = _typed(hf, "head_dim", int)
    if head_dim is None and num_heads > 0:
        if hidden_size % num_heads:  # transformers 5 refuses it too
            raise ValueError(
                f"config.json: hidden_size={hidden_size} is not a multiple of "
                f"num_attention_heads={num_heads} and no head_dim is given"
            )
        head_dim = hidden_size // num_heads  # HF's default
    return LlamaConfig(
        vocab_size=_typed(hf, "vocab_size", int),
        hidden_size=hidden_size,
        intermediate_size=_typed(hf, "intermediate_size", int),
        num_layers=_typed(hf, "num_hidden_layers", int),
        num_heads=num_heads,
        num_kv_heads=_typed(hf, "num_key_value_heads", int, num_heads),
        head_dim=head_dim,
        rms_norm_eps=_typed(hf, "rms_norm_eps", float, 1e-6),
        rope=_rope_from_hf(hf),
        tie_word_embeddings=_typed(hf, "tie_word_embeddings", bool, False),
        max_position_embeddings=_typed(hf, "max_position_embeddings", int, 2048),
        initializer_range=_typed(hf, "initializer_range", float, 0.02),
        bos_token_id=_token_id(hf, "bos_token_id"),
        eos_token_id=_token_id(hf, "eos_token_id"),
        pad_token_id=_token_id(hf, "pad_token_id"),
    )


def to_hf_config(config: LlamaConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The HF ``config.json`` dict for ``config``.

    RoPE is written in the transformers 4.x spelling (``rope_theta`` +
    ``rope_scaling``), which transformers 5 also reads and converts.

    Args:
        config: the model config.
        torch_dtype: dtype of the exported weights (``"float32"`` or ``"bfloat16"``).
    """
    rope = config.rope
    scaling: dict[str, Any] | None
    if rope.type == "default":
        scaling = None
    elif rope.type == "linear":
        scaling = {"rope_type": "linear", "factor": rope.factor}
    else:
        scaling = {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    eos = config.eos_token_id
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    """All fields of ``config`` as a JSON-able dict (native checkpoints)."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any]) -> LlamaConfig:
    """Inverse of :func:`config_to_dict`; unknown or missing keys raise ``ValueError``."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object of LlamaConfig fields, got {data!r}")
    fields = dataclasses.fields(LlamaConfig)
    unknown = sorted(set(data) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"unknown LlamaConfig keys {unknown}")
    missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in data]
    if missing:
        raise ValueError(f"LlamaConfig keys {missing} are missing")
    data = dict(data)
    _check_kinds(LlamaConfig, data)
    if "rope" in data and not isinstance(data["rope"], dict | RopeConfig):
        raise ValueError(f"rope={data['rope']!r} must be an object of RopeConfig fields")
    if "rope" in data and isinstance(data["rope"], dict):
        rope_fields = {f.name for f in dataclasses.fields(RopeConfig)}
        unknown = sorted(set(data["rope"]) - rope_fields)
        if unknown:
            raise ValueError(f"unknown RopeConfig keys {unknown}")
        _check_kinds(RopeConfig, data["rope"])
        data["rope"] = RopeConfig(**data["rope"])
    return LlamaConfig(**data)
