"""HuggingFace <-> jflash parameter conversion, driven by one declarative table.

``MAPPINGS`` pairs every parameter path of :mod:`models.llama` with its HF key and
the transform between them (HF ``nn.Linear.weight`` is ``[out, in]``, ours
``[in, out]``: a transpose, nothing else, thanks to the rotate-half RoPE layout).
Per-layer entries (``{layer}`` in the key) are stacked on a leading ``[L]`` axis.

CLI::

    python -m models.convert --from-hf HF_DIR --out NATIVE_DIR
    python -m models.convert --to-hf NATIVE_DIR --out HF_DIR [--dtype bfloat16] [--max-shard-gb 5]
    python -m models.convert --init PRESET [--tokenizer TOKENIZER] [--vocab-size V]
        [--seed S] [--dtype bfloat16] [--max-shard-gb 5] --out HF_DIR

``--init`` writes a randomly initialised preset as an HF directory; with a tokenizer
(a ``tokenizer.json`` or its directory) the vocabulary size and BOS / EOS ids come from
it and its files are copied along. A flag that the chosen conversion does not read is
refused. An ``--out`` that already holds files the conversion would write or remove (a
model's config or weights, tokenizer files from another directory) is refused unless
``--overwrite`` is given.

A native directory holds ``params.safetensors`` (keys ``embed/embedding``, ...)
and ``jflash_config.json``; tokenizer files are copied along in both directions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from typing import Literal

import jax
import ml_dtypes
import numpy as np

from models.cli import OneLineParser
from models.config import (
    DTYPES,
    NATIVE_CONFIG,
    LlamaConfig,
    config_from_dict,
    config_to_dict,
    from_hf_config,
    to_hf_config,
)
from models.files import atomic_write, folder_error
from models.functional import Params, abstract_params, check_params, init_params
from models.presets import preset
from models.safetensors_io import Deferred, SafetensorsFile, save_file

Transform = Literal["identity", "transpose"]


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """One row of the conversion table.

    Attributes:
        path: our parameter path (keys into the nested params dict).
        hf_key: the HF state-dict key; ``{layer}`` marks a per-layer tensor.
        transform: how an HF tensor becomes ours (each transform is its own inverse).
        untied_only: present only when ``tie_word_embeddings`` is false.
    """

    path: tuple[str, ...]
    hf_key: str
    transform: Transform = "identity"
    untied_only: bool = False

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.hf_key


_LAYER = "model.layers.{layer}"
MAPPINGS: tuple[ParamMapping, ...] = (
    ParamMapping(("embed", "embedding"), "model.embed_tokens.weight"),
    ParamMapping(("layers", "input_norm", "scale"), f"{_LAYER}.input_layernorm.weight"),
    ParamMapping(
        ("layers", "attn", "q_proj", "kernel"), f"{_LAYER}.self_attn.q_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "attn", "k_proj", "kernel"), f"{_LAYER}.self_attn.k_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "attn", "v_proj", "kernel"), f"{_LAYER}.self_attn.v_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "attn", "o_proj", "kernel"), f"{_LAYER}.self_attn.o_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "post_attn_norm", "scale"), f"{_LAYER}.post_attention_layernorm.weight"
    ),
    ParamMapping(
        ("layers", "mlp", "gate_proj", "kernel"), f"{_LAYER}.mlp.gate_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "mlp", "up_proj", "kernel"), f"{_LAYER}.mlp.up_proj.weight", "transpose"
    ),
    ParamMapping(
        ("layers", "mlp", "down_proj", "kernel"), f"{_LAYER}.mlp.down_proj.weight", "transpose"
    ),
    ParamMapping(("final_norm", "scale"), "model.norm.weight"),
    ParamMapping(("lm_head", "kernel"), "lm_head.weight", "transpose", untied_only=True),
)

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A model directory's tokenizer files, copied with it (conversion, the trainer's export);
# a directory among them goes with the files in it (:func:`tokenizer_files`).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # where transformers saves a tokenizer's chat template
    "additional_chat_templates",  # a directory: its other named templates, <name>.jinja
    "generation_config.json",
)
NATIVE_PARAMS = "params.safetensors"
_STAGED = ".partial"  # suffix of export_hf's files until all of them are written
# The files export_hf writes (each first as name + _STAGED).
_EXPORT_NAME = re.compile(
    r"config\.json|model\.safetensors(\.index\.json)?|model-\d{5,}-of-\d{5,}\.safetensors"
)


def _numpy_dtype(name: str) -> np.dtype:
    """numpy dtype for ``float32 | bfloat16 | float16`` (bfloat16 from ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _apply(array: np.ndarray, transform: Transform) -> np.ndarray:
    return array.T if transform == "transpose" else array


def _active(config: LlamaConfig) -> list[ParamMapping]:
    return [m for m in MAPPINGS if not (m.untied_only and config.tie_word_embeddings)]


def _hf_keys(mapping: ParamMapping, num_layers: int) -> list[str]:
    if mapping.per_layer:
        return [mapping.hf_key.format(layer=i) for i in range(num_layers)]
    return [mapping.hf_key]


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class _TensorIndex(Mapping[str, np.ndarray]):
    """All tensors of an HF directory: one ``model.safetensors`` or an index + shards
    (where both are there, the single file, as transformers' ``from_pretrained``)."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(single):
            weight_map = dict.fromkeys(SafetensorsFile(single), "model.safetensors")
        elif os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map: dict[str, str] = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                    isinstance(name, str) for name in weight_map.values()
                ):
                    raise TypeError("'weight_map' is not an object of file names")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        else:
            pickled = [
                n
                for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                if os.path.isfile(os.path.join(path, n))
            ]
            if pickled:
                raise ValueError(
                    f"{path} holds PyTorch pickle weights ({pickled[0]}), which are not read "
                    "(loading a pickle runs its code): save the model as safetensors first, "
                    "e.g. transformers' from_pretrained(path).save_pretrained(out)"
                )
            raise ValueError(
                f"{path} has no weights: neither model.safetensors nor model.safetensors.index.json"
            )
        missing = sorted(
            name
            for name in set(weight_map.values())
            if not os.path.isfile(os.path.join(path, name))
        )
        if missing:
            raise ValueError(f"{index} lists shards that are not in {path}: {missing}")
        self._files = {
            name: SafetensorsFile(os.path.join(path, name)) for name in set(weight_map.values())
        }
        absent = {key: name for key, name in weight_map.items() if key not in self._files[name]}
        if absent:
            raise ValueError(f"{index} lists tensors that its shards do not hold: {absent}")
        self._where = weight_map
        self._stored: dict[str, str] = {}  # a renamed tensor's name in its file

    def __getitem__(self, key: str) -> np.ndarray:
        return self._files[self._where[key]][self._stored.get(key, key)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._files[self._where[key]].shape(self._stored.get(key, key))

    def rename(self, old: str, new: str) -> None:
        """Tensor `old` is read as `new` (and no longer as `old`)."""
        self._where[new] = self._where.pop(old)
        self._stored[new] = self._stored.pop(old, old)

    def read_as_causal_lm(self, tied: bool) -> None:
        """Names as `LlamaForCausalLM`'s, where transformers loads other spellings the
        same: a `LlamaModel` checkpoint's (no `model.` prefix), and a tied model's one
        matrix stored as `lm_head.weight` only."""
        names = list(self._where)
        if "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names):
            for name in names:
                if name != "lm_head.weight":
                    self.rename(name, "model." + name)
        if tied and "model.embed_tokens.weight" not in self and "lm_head.weight" in self:
            self.rename("lm_head.weight", "model.embed_tokens.weight")

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _few(names: list[str], shown: int = 6) -> str:
    """`names` for an error line: all of a few, else the first `shown` and the count."""
    if len(names) <= shown:
        return str(names)
    return f"{names[:shown]} and {len(names) - shown} more"


def load_hf(
    path: str | os.PathLike[str], *, param_dtype: str | None = None
) -> tuple[LlamaConfig, Params]:
    """Loads an HF Llama checkpoint directory (``config.json`` + safetensors).

    Strict: every expected tensor must be present with the expected shape, and
    every tensor in the files must be used (a tied ``lm_head.weight`` equal to the
    embedding and ``rotary_emb.inv_freq`` buffers are tolerated). Names as
    transformers reads them: a ``LlamaModel``'s (no ``model.`` prefix), and a tied
    model's one matrix stored as ``lm_head.weight`` only.

    Args:
        path: local directory, as written by ``save_pretrained``.
        param_dtype: dtype of the returned parameters (default
            ``config.param_dtype``, float32); bfloat16 tensors upcast exactly.

    Returns:
        ``(config, params)``; params are host numpy arrays (``jax.device_put`` them
        with the shardings you want).

    Raises:
        ValueError: listing all missing, unexpected and mis-shaped tensors; naming a
            tensor with a weight beyond ``param_dtype``'s range (float16: 65504).
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        raise ValueError(f"{path} is a file: load_hf reads an HF checkpoint directory")
    config = from_hf_config(path)
    if param_dtype is not None:
        config = config.replace(param_dtype=param_dtype)
    dtype = _numpy_dtype(config.param_dtype)
    tensors = _TensorIndex(path)
    tensors.read_as_causal_lm(config.tie_word_embeddings)
    expected = abstract_params(config)
    L = config.num_layers

    missing, misshaped, used = [], [], set()
    for m in _active(config):
        want = tuple(_get(expected, m.path).shape)
        want_hf = want[1:] if m.per_layer else want
        want_hf = want_hf[::-1] if m.transform == "transpose" else want_hf
        for key in _hf_keys(m, L):
            if key not in tensors:
                missing.append(key)
            elif tensors.shape(key) != want_hf:
                misshaped.append(f"{key}: expected {want_hf}, got {tensors.shape(key)}")
            used.add(key)
    unexpected = []
    for key in sorted(set(tensors) - used):
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        tied = config.tie_word_embeddings and "model.embed_tokens.weight" in tensors
        if key == "lm_head.weight" and tied:
            embed = tensors["model.embed_tokens.weight"]
            if tensors[key].shape == embed.shape and np.array_equal(tensors[key], embed):
                continue
            raise ValueError(
                f"checkpoint {path} has an lm_head.weight other than its "
                "model.embed_tokens.weight, but its config.json says tie_word_embeddings: "
                "true (transformers then loads the head untied): set it to false"
            )
        unexpected.append(key)
    if missing or unexpected or misshaped:
        raise ValueError(
            f"checkpoint {path} does not match its config.json: missing={_few(missing)}, "
            f"unexpected={_few(unexpected)}, misshaped={_few(misshaped)}"
        )

    params: Params = {}
    for m in _active(config):
        arrays = [_cast(tensors, key, m.transform, dtype, path) for key in _hf_keys(m, L)]
        _set(params, m.path, np.stack(arrays) if m.per_layer else arrays[0])
    return config, params


def _beyond(array: np.ndarray, dtype: np.dtype) -> str | None:
    """Where a finite weight of `array` is beyond `dtype`'s range (float16's 65504),
    which a cast would make inf: `holds a weight of magnitude ..., beyond ...`; where
    `array` holds no floats (an int8 tensor of a quantized checkpoint), that; else
    None."""
    try:
        ml_dtypes.finfo(array.dtype)
    except ValueError:
        return (
            f"is stored as {np.dtype(array.dtype).name}, not floats (a quantized "
            "checkpoint?): weights are read from float32, bfloat16 or float16 tensors"
        )
    limit = float(ml_dtypes.finfo(dtype).max)
    if array.size and limit < float(ml_dtypes.finfo(array.dtype).max):
        ends = float(np.max(array)), float(np.min(array))  # no copy of `array`
        largest = max(abs(end) for end in ends)
        if not all(map(math.isfinite, ends)):  # an inf or NaN: the largest finite one
            largest = float(np.max(np.abs(array[np.isfinite(array)]), initial=0.0))
        if largest > limit:
            return (
                f"holds a weight of magnitude {largest:.6g}, beyond {np.dtype(dtype).name}'s "
                f"largest {limit:g}"
            )
    return None


def _cast(tensors, key: str, transform: Transform, dtype: np.dtype, path: str) -> np.ndarray:
    """Tensor `key` in `dtype`; ValueError naming it where a finite weight is beyond
    `dtype`'s range (`_beyond`)."""
    array = _apply(tensors[key], transform)
    if beyond := _beyond(array, dtype):
        raise ValueError(f"checkpoint {path}: {key} {beyond}{_inf_hint(beyond, dtype)}")
    return array.astype(dtype)


def _inf_hint(beyond: str, dtype: np.dtype) -> str:
    """What `_beyond`'s range message adds: the cast that would make the weight inf."""
    if not beyond.startswith("holds a weight"):
        return ""
    return f": param_dtype={dtype.name!r} would make it inf; load it as 'float32' or 'bfloat16'"


def to_hf_state_dict(
    params: Params, config: LlamaConfig, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Our params as an HF state dict of numpy arrays in ``dtype``; ValueError naming
    the tensor where a finite weight is beyond ``dtype``'s range (float16's 65504),
    which the cast would make inf."""
    tensors = _hf_tensors(params, config, dtype)
    return {key: np.array(tensor.make(), order="C") for key, tensor in tensors.items()}


def _hf_tensors(params: Params, config: LlamaConfig, dtype: str) -> dict[str, Deferred]:
    """Our params as HF tensors in ``dtype``, each made (taken from the device, a layer
    of a stack at a time, transposed, cast, checked as :func:`to_hf_state_dict` says)
    only when it is written: an export holds the params and one tensor."""
    np_dtype = _numpy_dtype(dtype)

    def make(key: str, leaf, layer: int | None, transform: Transform) -> np.ndarray:
        part = np.asarray(jax.device_get(leaf if layer is None else leaf[layer]))
        part = _apply(part, transform)
        if beyond := _beyond(part, np_dtype):
            raise ValueError(
                f"{key} {beyond}: dtype={dtype!r} would make it inf; export it as "
                "'bfloat16' or 'float32'"
            )
        return part.astype(np_dtype, copy=False)

    tensors: dict[str, Deferred] = {}
    for m in _active(config):
        leaf = _get(params, m.path)
        shape = tuple(leaf.shape[1:] if m.per_layer else leaf.shape)
        if m.transform == "transpose":
            shape = shape[::-1]
        for i, key in enumerate(_hf_keys(m, config.num_layers)):
            layer = i if m.per_layer else None
            made = functools.partial(make, key, leaf, layer, m.transform)
            tensors[key] = Deferred(shape, np_dtype, made)
    return tensors


def export_hf(
    params: Params,
    config: LlamaConfig,
    path: str | os.PathLike[str],
    *,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    max_shard_bytes: int | None = None,
) -> None:
    """Writes an HF checkpoint directory that ``LlamaForCausalLM.from_pretrained`` loads.

    Args:
        params: parameter dict matching ``config``.
        config: the model.
        path: output directory (created).
        dtype: dtype of the written tensors.
        max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` shards with
            an index when the total size exceeds this (default: one file).

    Every file is staged (written under a temporary name) and renamed once all are
    written; staged files of these names that an export killed part way left in
    ``path`` are removed first.

    Raises:
        ValueError: params that do not match ``config``, a ``dtype`` other than
            ``float32 | bfloat16 | float16``, a weight beyond ``dtype``'s range (float16:
            65504), or a ``max_shard_bytes`` below 1.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not in {DTYPES}")
    if max_shard_bytes is not None and not max_shard_bytes >= 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} must be at least 1")
    check_params(config, params)
    state = _hf_tensors(params, config, dtype)  # made (and range-checked) as written
    if dtype == "float16":  # a weight past 65504: refused before anything is written
        for tensor in state.values():  # (past bfloat16's 3.39e38: as its file is written,
            tensor.make()  # the files staged so far removed)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    _remove_stale_staged(path)
    metadata = {"format": "pt"}
    total = sum(a.nbytes for a in state.values())
    # Every file is written under a temporary name first and renamed once all are
    # complete: an export that fails part way leaves an earlier checkpoint in `path`
    # whole, never new shards under an old index or new weights under an old config.
    staged: list[str] = []

    def stage(name: str) -> str:
        staged.append(name)
        return os.path.join(path, name + _STAGED)

    try:
        if max_shard_bytes is None or total <= max_shard_bytes:
            save_file(state, stage("model.safetensors"), metadata)
        else:
            shards: list[dict[str, np.ndarray]] = [{}]
            size = 0
            for key in sorted(state):
                if shards[-1] and size + state[key].nbytes > max_shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][key] = state[key]
                size += state[key].nbytes
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, stage(name), metadata)
                weight_map.update(dict.fromkeys(shard, name))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(stage("model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        with open(stage("config.json"), "w") as f:
            json.dump(to_hf_config(config, torch_dtype=dtype), f, indent=2)
    except BaseException:
        for name in staged:
            if os.path.exists(os.path.join(path, name + _STAGED)):
                os.remove(os.path.join(path, name + _STAGED))
        raise
    for name in staged:
        os.replace(os.path.join(path, name + _STAGED), os.path.join(path, name))
    remove_other_weights(path, set(staged))


def _remove_stale_staged(path: str) -> None:
    """Removes what an export into ``path`` killed part way (SIGKILL: nothing cleaned
    up) left staged: its ``name + _STAGED`` files, and the ``.tmp`` of one it was
    writing, for the names :func:`export_hf` writes; other files stay."""
    for name in os.listdir(path):
        staged = name.removesuffix(".tmp")
        if (
            staged.endswith(_STAGED)
            and _EXPORT_NAME.fullmatch(staged.removesuffix(_STAGED))
            and os.path.isfile(os.path.join(path, name))
        ):
            os.remove(os.path.join(path, name))


def remove_other_weights(path: str, written: set[str]) -> None:
    """Once the new checkpoint is written, drops the weight files of an earlier one in
    the same directory (a sharded export over a single-file one, or the reverse):
    loaders would read those instead of, or mixed with, the new weights."""
    for name in os.listdir(path):
        if _is_weights(name) and name not in written:
            os.remove(os.path.join(path, name))


def save_native(params: Params, config: LlamaConfig, path: str | os.PathLike[str]) -> None:
    """Writes ``params`` (keys ``a/b/c``) and the full config to directory ``path``.

    The config records the parameters' own dtype as ``param_dtype`` (bfloat16 arrays of
    a float32 config are saved as bfloat16, and say so); parameters of several dtypes
    are refused. The config marks a whole directory (:func:`load_native` reads it
    first): the parameters are written beside the old ones first (staged; a write cut
    off removes them and leaves the old model whole), then the old config is removed,
    the parameters renamed into place and the new config written last, so that no
    moment leaves a directory that reads as a model with another model's parameters,
    or with parameters half written."""
    check_params(config, params)  # another model's tree replaces no checkpoint
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    tensors = {
        "/".join(k.key for k in keys): np.asarray(jax.device_get(leaf)) for keys, leaf in flat
    }
    dtypes = sorted({np.dtype(a.dtype).name for a in tensors.values()})
    if len(dtypes) != 1 or dtypes[0] not in DTYPES:
        raise ValueError(
            f"save_native: the parameters hold {' and '.join(dtypes)}; cast them to one of "
            f"{DTYPES} (jax.tree.map(lambda a: a.astype(dtype), params))"
        )
    config = config.replace(param_dtype=dtypes[0])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, NATIVE_CONFIG)
    staged = os.path.join(path, NATIVE_PARAMS + _STAGED)
    try:
        save_file(tensors, staged, {"format": "jflash"})
    except BaseException:  # an error or Ctrl-C while writing: the old model stays whole
        with contextlib.suppress(OSError):
            os.remove(staged)
        raise
    if os.path.lexists(config_path):
        os.remove(config_path)
    os.replace(staged, os.path.join(path, NATIVE_PARAMS))
    with atomic_write(config_path, "w") as f:
        json.dump(config_to_dict(config), f, indent=2)


def load_native(
    path: str | os.PathLike[str], *, param_dtype: str | None = None
) -> tuple[LlamaConfig, Params]:
    """Reads a directory written by :func:`save_native` (strict, like :func:`load_hf`).

    Args:
        path: the directory.
        param_dtype: dtype of the returned parameters (default the config's
            ``param_dtype``, the saved arrays' own); a cast to float16 refuses a weight
            beyond its range, naming it.
    """
    path = os.fspath(path)
    config_path = os.path.join(path, NATIVE_CONFIG)
    if not os.path.isfile(config_path):
        hf = os.path.isfile(os.path.join(path, "config.json"))
        hint = " (an HF directory: read it with load_hf, --from-hf)" if hf else ""
        raise ValueError(f"{path} is not a native directory: it has no {NATIVE_CONFIG}{hint}")
    data = read_json(config_path)
    try:
        config = config_from_dict(data)
        if param_dtype is not None:
            config = config.replace(param_dtype=param_dtype)
    except (TypeError, ValueError) as e:  # TypeError: a field of the wrong type
        raise ValueError(f"{config_path}: {e}") from None
    dtype = _numpy_dtype(config.param_dtype)
    params: Params = {}
    for key, array in SafetensorsFile(os.path.join(path, NATIVE_PARAMS)).items():
        if beyond := _beyond(array, dtype):
            raise ValueError(f"{path}: {key} {beyond}{_inf_hint(beyond, dtype)}")
        _set(params, tuple(key.split("/")), np.array(array, dtype=dtype))
    try:
        check_params(config, params)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config, params


def tokenizer_files(folder: str | os.PathLike[str]) -> list[str]:
    """The tokenizer files (:data:`TOKENIZER_FILES`) in directory ``folder``, as paths
    relative to it, in that order: a directory's files by their paths
    (``additional_chat_templates/tool_use.jinja``)."""
    found = []
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            found.append(name)
        elif os.path.isdir(path):
            inside = sorted(os.listdir(path))
            found += [f"{name}/{n}" for n in inside if os.path.isfile(os.path.join(path, n))]
    return found


def _copy_tokenizer(src: str, dst: str) -> None:
    """The tokenizer files of directory ``src`` into ``dst`` (none when they are one).
    The tokenizer files of ``dst`` that are not ``src``'s (those of another model, which
    ``--overwrite`` replaces: a chat template the new tokenizer lacks, or a whole
    tokenizer where ``src`` has none) are removed, so that no model is left beside
    another one's tokenizer or template."""
    if os.path.isdir(dst) and os.path.samefile(src, dst):
        return
    copied = tokenizer_files(src)
    for name in copied:
        os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    remove_other_tokenizer_files(dst, copied)


def remove_other_tokenizer_files(folder: str, kept: Iterable[str]) -> None:
    """Removes the tokenizer files of directory ``folder`` (:func:`tokenizer_files`)
    not named in ``kept``, and ``additional_chat_templates/`` once it is empty."""
    kept = set(kept)
    for name in tokenizer_files(folder):
        if name not in kept:
            os.remove(os.path.join(folder, name))
            parent = os.path.dirname(name)
            if parent and not os.listdir(os.path.join(folder, parent)):
                os.rmdir(os.path.join(folder, parent))


def read_json(path: str | os.PathLike[str]) -> dict:
    """The JSON object in file ``path``; ValueError naming the file where it cannot be
    read, is not JSON or holds another value."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_ids(tokenizer_json: str) -> dict[str, int]:
    """Token -> id of a ``tokenizer.json``: its model's vocabulary and added tokens."""
    data = read_json(tokenizer_json)
    model = data.get("model") or {}
    vocab = (model.get("vocab") if isinstance(model, dict) else None) or {}
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids = {
            piece[0] if isinstance(piece, list) and piece else None: i
            for i, piece in enumerate(vocab)
        }
    for token in data.get("added_tokens") or []:
        token = token if isinstance(token, dict) else {}
        ids[token.get("content")] = token.get("id")
    bad = {k: v for k, v in ids.items() if not isinstance(k, str) or type(v) is not int or v < 0}
    if bad:
        shown = dict(list(bad.items())[:3])
        raise ValueError(
            f"{tokenizer_json}: not a tokenizer.json vocabulary: tokens and ids like {shown}"
        )
    return ids


def tokenizer_vocab_size(tokenizer_json: str | os.PathLike[str]) -> int:
    """One more than the largest id of a ``tokenizer.json`` (vocabulary and added tokens)."""
    ids = _token_ids(os.fspath(tokenizer_json))
    if not ids:
        raise ValueError(f"{tokenizer_json}: no vocabulary found")
    return max(ids.values()) + 1


def special_token_ids(tokenizer_json: str | os.PathLike[str]) -> dict[str, int]:
    """``{"bos_token": id, "eos_token": id, "pad_token": id}`` for the special tokens
    that the ``tokenizer_config.json`` or ``special_tokens_map.json`` beside
    ``tokenizer_json`` names (as strings or ``{"content": ...}``; ValueError naming
    another value), looked up in ``tokenizer_json`` (a pad token it lacks is left out)."""
    tokenizer_json = os.fspath(tokenizer_json)
    folder = os.path.dirname(tokenizer_json)
    names: dict[str, str] = {}
    for config in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = os.path.join(folder, config)
        if os.path.isfile(path):
            for key in ("bos_token", "eos_token", "pad_token"):
                given = read_json(path).get(key)
                value = given.get("content") if isinstance(given, dict) else given
                if isinstance(value, str):
                    names[key] = value
                elif given is not None:  # an id, a list: HF would fail to load it too
                    raise ValueError(
                        f"{path}: {key} {json.dumps(given)} is not a token: give its text, "
                        'as "</s>" or {"content": "</s>"}'
                    )
    if not names:
        return {}
    ids = _token_ids(tokenizer_json)
    # A pad token HF would add to the vocabulary at load is no id of this file's.
    names = {k: v for k, v in names.items() if k != "pad_token" or v in ids}
    missing = {k: v for k, v in names.items() if v not in ids}
    if missing:
        raise ValueError(f"{tokenizer_json}: special tokens {missing} are not in its vocabulary")
    return {key: ids[value] for key, value in names.items()}


def init_hf(
    preset_name: str,
    out: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    max_shard_bytes: int | None = None,
) -> LlamaConfig:
    """Writes preset ``preset_name``, randomly initialised (``init_params`` with
    ``seed``), as an HF directory ``out`` (``config.json``, ``model.safetensors``, the
    tokenizer's files); ``dtype`` and ``max_shard_bytes`` as :func:`export_hf`'s. With
    ``tokenizer`` (``tokenizer.json`` or its directory) the vocabulary size (unless
    ``vocab_size``) and BOS / EOS / padding ids are the tokenizer's (None where its
    ``tokenizer_config.json`` / ``special_tokens_map.json`` name none)."""
    config = preset(preset_name)
    files = None
    if tokenizer is not None:
        tokenizer = os.fspath(tokenizer)
        tokenizer_json = (
            os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
        )
        if not os.path.isfile(tokenizer_json):
            raise ValueError(f"--tokenizer: {tokenizer_json} does not exist")
        files = os.path.dirname(tokenizer_json) or "."
        special = special_token_ids(tokenizer_json)
        needed = tokenizer_vocab_size(tokenizer_json)
        if vocab_size is not None and vocab_size < needed:
            raise ValueError(
                f"--vocab-size={vocab_size} is smaller than {tokenizer_json}'s vocabulary "
                f"({needed} ids): its tokens would index past the embedding"
            )
        config = config.replace(
            vocab_size=needed if vocab_size is None else vocab_size,
            # the preset's ids are other tokens of this vocabulary, if any
            bos_token_id=special.get("bos_token"),
            eos_token_id=special.get("eos_token"),
            pad_token_id=special.get("pad_token"),
        )
    elif vocab_size is not None:
        config = config.replace(vocab_size=vocab_size)
    for key in ("bos_token_id", "eos_token_id"):
        value = getattr(config, key)
        if isinstance(value, int) and not 0 <= value < config.vocab_size:
            config = config.replace(**{key: None})  # the preset's id is not in this vocabulary
    params = init_params(config, jax.random.key(seed))
    export_hf(params, config, out, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if files is not None:
        _copy_tokenizer(files, os.fspath(out))
        if os.path.basename(tokenizer_json) != "tokenizer.json":
            shutil.copy(tokenizer_json, os.path.join(out, "tokenizer.json"))
    else:  # no tokenizer: another model's there (--overwrite) would not match this one
        remove_other_tokenizer_files(os.fspath(out), [])
    return config


def main(argv: list[str] | None = None) -> None:
    """``python -m models.convert``: HF directory <-> native directory, or a new model."""
    parser = OneLineParser(
        prog="python -m models.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="HF checkpoint directory to read")
    source.add_argument("--to-hf", metavar="DIR", help="native directory to export to HF")
    source.add_argument(
        "--init", metavar="PRESET", help="write this preset, randomly initialised, as HF"
    )
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="--init: tokenizer.json or its directory"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="--init: default the tokenizer's"
    )
    parser.add_argument("--seed", type=int, default=None, help="--init: initialisation seed (0)")
    parser.add_argument("--out", metavar="DIR", required=True, help="output directory")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the written tensors (default float32; --from-hf: the native "
        "parameters', so that a bfloat16 checkpoint stays bfloat16)",
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=None, help="--to-hf, --init: shard size limit in GB"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model and tokenizer files already in --out",
    )
    args = parser.parse_args(argv)
    # A flag the chosen conversion does not read is refused, not silently dropped.
    command = "--init" if args.init else "--from-hf" if args.from_hf else "--to-hf"
    for flag, used_by in _FLAG_USERS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) is not None and command not in used_by:
            parser.error(f"{flag} applies to {' and '.join(used_by)} only, not {command}")
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error(f"--vocab-size={args.vocab_size} must be at least 1")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        parser.error(f"--seed={args.seed} must be in [0, 2**63)")
    if error := shard_gb_error(args.max_shard_gb):
        parser.error(error)
    if error := folder_error(args.out, "--out"):  # before the conversion's work
        parser.error(error)
    held = [] if args.overwrite else _replaced(args)
    if held:
        parser.error(replace_refusal(args.out, held))
    try:
        _run(args)
    except (ValueError, NotImplementedError, OSError) as e:  # one line, naming the input
        parser.exit(2, f"error: {e}\n")


# Options of `python -m models.convert` and the conversions that read them.
_FLAG_USERS = {
    "--tokenizer": ("--init",),
    "--vocab-size": ("--init",),
    "--seed": ("--init",),
    "--max-shard-gb": ("--to-hf", "--init"),
}


def _replaced(args: argparse.Namespace) -> list[str]:
    """The files in ``--out`` that the conversion would write over or remove: a native
    directory's two files (``--from-hf``); an HF export's config and weights, and any
    other weight files, which it removes (``--to-hf``, ``--init``); and the tokenizer
    files it would copy in from another directory."""
    out = args.out
    if not os.path.isdir(out):
        return []
    if args.from_hf:
        written = {NATIVE_PARAMS, NATIVE_CONFIG}
        source = args.from_hf
    else:
        written = {"config.json"}
        source = args.to_hf or args.tokenizer
    if source is not None and os.path.isfile(source):  # --tokenizer given as its file
        written.add("tokenizer.json")
        source = os.path.dirname(source) or "."
    if source is not None and os.path.isdir(source) and not os.path.samefile(source, out):
        copied = set(tokenizer_files(source))
        # and, where it copies a tokenizer, removes another one's files (`_copy_tokenizer`)
        written |= copied | (set(tokenizer_files(out)) if copied else set())
    return replaced_files(out, written, weights=not args.from_hf)


def replaced_files(out: str, written: Iterable[str], *, weights: bool) -> list[str]:
    """The files in directory ``out`` (paths relative to it, sorted; none where it is no
    directory) that writing the files named ``written`` there would replace (a name that
    is a directory in ``out``: the files in it), and with ``weights`` every HF weight
    file there, which :func:`export_hf` removes where it does not write it: what a
    command writing a model into ``out`` refuses to replace without ``--overwrite``
    (:func:`replace_refusal`)."""
    if not os.path.isdir(out):
        return []
    held = {n for n in os.listdir(out) if weights and _is_weights(n)}
    for name in written:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            held |= {f"{name}/{n}" for n in os.listdir(path)}
        else:
            held.add(name)
    return sorted(n for n in held if os.path.isfile(os.path.join(out, n)))


def replace_refusal(out: str, held: list[str], what: str = "this conversion") -> str:
    """The one line refusing ``--out`` that holds the files ``held``
    (:func:`replaced_files`), which ``what`` would replace."""
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return (
        f"--out={out!r} already holds {shown}, which {what} would replace: pass "
        "--overwrite to replace them, or choose another directory"
    )


def _is_weights(name: str) -> bool:
    """An HF weight file's name (safetensors or PyTorch, single or sharded, its index)."""
    return name.startswith(("model.safetensors", "model-", "pytorch_model")) and name.endswith(
        (".safetensors", ".bin", ".index.json")
    )


def shard_gb_error(max_shard_gb: float | None) -> str | None:
    """Why ``--max-shard-gb`` cannot be taken (not a finite number above 0), or None."""
    if max_shard_gb is None or (math.isfinite(max_shard_gb * 1e9) and max_shard_gb > 0):
        return None
    return (
        f"--max-shard-gb={max_shard_gb} must be a finite number > 0 (leave it out for one "
        "weights file)"
    )


def shard_bytes(max_shard_gb: float | None) -> int | None:
    """``--max-shard-gb`` as ``export_hf``'s ``max_shard_bytes`` (None: one file)."""
    return None if max_shard_gb is None else max(1, int(max_shard_gb * 1e9))


def _run(args: argparse.Namespace) -> None:
    if args.init:
        config = init_hf(
            args.init,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            seed=args.seed or 0,
            dtype=args.dtype or "float32",
            max_shard_bytes=shard_bytes(args.max_shard_gb),
        )
        print(
            f"wrote {args.out}: {args.init} randomly initialised, vocab_size="
            f"{config.vocab_size}, eos_token_id={config.eos_token_id}"
        )
        return
    if args.from_hf:
        config, params = load_hf(args.from_hf, param_dtype=args.dtype)
        save_native(params, config, args.out)
        _copy_tokenizer(args.from_hf, args.out)
        src = args.from_hf
    else:
        config, params = load_native(args.to_hf)
        export_hf(
            params,
            config,
            args.out,
            dtype=args.dtype or "float32",
            max_shard_bytes=shard_bytes(args.max_shard_gb),
        )
        _copy_tokenizer(args.to_hf, args.out)
        src = args.to_hf
    num = sum(np.size(x) for x in jax.tree.leaves(params))
    print(f"converted {src} -> {args.out}: {num:,} parameters")


if __name__ == "__main__":
    main()
