"""What one training run is made of, built from a `TrainConfig` before anything runs:
the model (an HF directory or a preset), the packed data (`--data_path`,
`--eval_data_path`), the mesh, shardings, optimizer and the jitted step (`plan_step`:
abstract, nothing allocated; `train.tools.capacity` and `train.tools.profile` compile it), and the
initial state (`build`). `train.loop.run` trains what `build` returns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models.config import with_rope
from models.sharding import spec_axes
from train import data as data_lib
from train import data_cache, hosts
from train.chat import check_template_path, parse_template_kwargs
from train.config import NO_EOS, TrainConfig, rope_scaling
from train.dataset import Rows, ShortData, TokenDataset
from train.errors import TrainingError
from train.mesh import (
    SEQ_AXES,
    batch_sharding,
    compute_shardings,
    make_mesh,
    param_shardings,
    parse_mesh,
    replicated,
    seq_shards,
    shard_axes,
)
from train.optim import optimizer, schedule
from train.outputs import LOG_FILE, PREVIOUS_RUN
from train.readers import (
    FILES,
    data_format,
    is_pattern,
    one_listing,
    pattern_folder,
    source_exists,
    source_files,
    would_read,
)
from train.run_files import is_run_output
from train.step import BATCH_KEYS, StepSpec, eval_sums, train_step
from train.words import plural


def _for_run(config: models.LlamaConfig, cfg: TrainConfig) -> models.LlamaConfig:
    if cfg.model.rope_theta is not None or cfg.model.rope_scaling:  # a longer context's RoPE
        try:
            config = with_rope(config, cfg.model.rope_theta, rope_scaling(cfg.model))
        except ValueError as e:
            given = f"--rope_scaling={cfg.model.rope_scaling!r}" if cfg.model.rope_scaling else ""
            flag = given or f"--rope_theta={cfg.model.rope_theta}"
            raise TrainingError(f"{flag}: {e}") from None
    return config.replace(
        dtype="bfloat16" if (cfg.model.bf16 or cfg.model.fp16) else "float32",
        param_dtype="float32",
        remat=cfg.remat,
        scan_layers=cfg.model.scan_layers,
        mlp_tile=cfg.model.mlp_tile,
    )


def _run_dir_hint(path: str) -> str | None:
    """Where `path` is a training run's output directory or one of its checkpoints
    (no config.json of its own): what it is, and the model to give instead."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    folder = os.path.abspath(path)
    step = os.path.basename(folder)
    if step.isdigit() and os.path.basename(os.path.dirname(folder)) == "checkpoints":
        run_dir = os.path.dirname(os.path.dirname(folder))
        return (
            f"is a checkpoint of a training run, not an HF model: export it with python -m "
            f"train.tools.export {run_dir} --step {step} --out DIR and give DIR "
            "(--resume_from_checkpoint resumes it, optimizer state and all)"
        )
    if is_run_output(folder):
        hf = os.path.join(folder, "hf")
        export = (
            f"its export {hf}"
            if os.path.isfile(os.path.join(hf, "config.json"))
            else (
                f"an export of one of its checkpoints (python -m train.tools.export {folder} "
                "--out DIR)"
            )
        )
        return f"is a training run's output directory, not an HF model: give {export}"
    return None


def model_config(cfg: TrainConfig, hf_config: str | None = None) -> models.LlamaConfig:
    """The model's `LlamaConfig` (an HF directory's config.json, or a preset; or the
    config.json `hf_config`, such as a run's own copy) with the run's dtypes and remat
    policy; reads no weights."""
    name = cfg.model.model_name_or_path
    if hf_config is not None:
        try:
            return _for_run(models.from_hf_config(hf_config), cfg)
        except (OSError, ValueError) as e:
            raise TrainingError(f"{hf_config}: {e}") from None
    if os.path.isdir(name):
        if (hint := _run_dir_hint(name)) is not None:
            raise TrainingError(f"--model_name_or_path={name!r} {hint}")
        return _for_run(models.from_hf_config(name), cfg)
    try:
        return _for_run(models.preset(name), cfg)
    except (KeyError, ValueError) as e:
        raise TrainingError(
            f"--model_name_or_path={name!r} is neither a local HF directory nor a preset "
            f"({', '.join(sorted(models.PRESET_NAMES.values()))})"
        ) from e


# Bytes per parameter of the training state beside the fp32 parameter and its fp32
# gradient: AdamW's two moments, Lion's one; Adafactor's factored moments are rows and
# columns, small beside the weights.
OPTIMIZER_BYTES = {"adamw": 8, "lion": 4, "adafactor": 0}


def state_bytes(cfg: TrainConfig, config: models.LlamaConfig) -> int:
    """The training state's bytes: fp32 parameters and gradients (the trainer keeps
    parameters in float32 whatever `--bf16`) and `--optim`'s state."""
    return models.param_count(config) * (4 + 4 + OPTIMIZER_BYTES[cfg.optim.optim])


def available_host_bytes() -> int | None:
    """`/proc/meminfo`'s MemAvailable: what the host can give without swapping (None
    where the file is not there or does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(cfg: TrainConfig, config: models.LlamaConfig) -> None:
    """On the CPU backend, refuse a model whose training state is larger than the host's
    available memory: the kernel would kill the process without a word. (A GPU reports
    its out-of-memory error, which the trainer explains.)"""
    if jax.default_backend() != "cpu":
        return
    available = available_host_bytes()
    need = state_bytes(cfg, config)
    if available is None or need <= available:
        return
    gb = 1e9
    raise TrainingError(
        f"--model_name_or_path={cfg.model.model_name_or_path!r}: its training state "
        f"(fp32 parameters, gradients and {cfg.optim.optim} state, "
        f"{models.param_count(config) / 1e9:.3g}B parameters) needs about {need / gb:.3g} GB "
        f"but this host has {available / gb:.3g} GB available; train a smaller preset "
        "(e.g. tiny) or run on GPUs with enough memory"
    )


def load_model(cfg: TrainConfig):
    """`(LlamaConfig, host params or None)`: an HF directory, or a preset (random init)."""
    name = cfg.model.model_name_or_path
    if not os.path.isdir(name):
        return model_config(cfg), None
    config, params = models.load_hf(name)
    return _for_run(config, cfg), params


SAMPLE_DATA = "sample"


def is_sample_data(path: str) -> bool:
    """`--data_path sample` means generated data only where no file or directory of
    that name exists: a path the user has wins, as a local model directory wins over a
    preset of its name."""
    return path == SAMPLE_DATA and not os.path.exists(path)


def _check_sources(cfg: TrainConfig, flag: str, path: str, eval: bool) -> None:
    """Refuses a folder or pattern of data files that would read the run's own files in
    `--output_dir` (its log.jsonl, at the run's next start), and warns where the
    evaluation data shares files with the training data (its loss then measures what
    was trained on)."""
    files = [Path(f) for f in source_files(path)]
    out = cfg.run.output_dir
    listed = is_pattern(path) or (
        os.path.isdir(path) and not data_cache.is_cache(path) and data_format(path) == FILES
    )
    # The run's log.jsonl does not exist at its first start: its resume would read it.
    logs = (os.path.join(out, LOG_FILE), os.path.join(out, PREVIOUS_RUN, LOG_FILE))
    if listed and any(would_read(path, log) for log in logs):
        raise TrainingError(
            f"--output_dir={out!r}: {flag}={path!r} would read the run's own files (its "
            "log.jsonl) as data; give an output directory elsewhere"
        )
    train_path = cfg.data.data_path
    if eval and not is_sample_data(train_path) and source_exists(train_path):
        trained = {os.path.realpath(f) for f in source_files(train_path)}
        shared = [f for f in files if os.path.realpath(f) in trained]
        if shared and jax.process_index() == 0:
            names = ", ".join(str(f) for f in shared[:3]) + ", ..." * (len(shared) > 3)
            print(
                f"warning: {flag}={path!r} shares {plural(len(shared), 'file')} with "
                f"--data_path ({names}): its loss is measured on data the run trains on",
                flush=True,
            )


def _eos_warning(cfg: TrainConfig, eos: int | None, tokenizer: str | None) -> str | None:
    """The warning line where the token between packed documents was not chosen: none at
    all (no `--eos_token_id`, no `eos_token` in the tokenizer, none in the model's
    config), or the model's id where the run's tokenizer names none (another token of
    that tokenizer's vocabulary, maybe); else None."""
    if cfg.data.eos_token_id is not None:
        return None
    if eos is None:
        return (
            "warning: no EOS between packed documents: no --eos_token_id, and neither "
            "the tokenizer nor the model's config.json names one; the model does not learn "
            "to end a document (give --eos_token_id)"
        )
    if tokenizer is not None and data_lib.tokenizer_eos_id(tokenizer) is None:
        return (
            f"warning: the tokenizer {tokenizer!r} names no eos_token: documents end with "
            f"the model's eos_token_id {eos}, whichever token that is in this tokenizer "
            "(give --eos_token_id to choose)"
        )
    return None


# A data file this large, read into memory without --data_cache_dir, gets a note.
IN_MEMORY_NOTE_BYTES = 1_000_000_000


@one_listing()  # a folder's or pattern's files listed once for all that asks
def load_rows(cfg: TrainConfig, config, *, eval: bool = False):
    """The packed rows of `--data_path` (or `--eval_data_path` with `eval`): a data file
    (in memory, or through a token cache under `--data_cache_dir`) or a token cache
    directory (`train.data_cache.packed_rows`); `sample` makes learnable sample data in
    memory (the same on every host: it depends only on the flags and `--seed`; the
    evaluation's is held out from the same chain). The evaluation's tail that does not
    fill a row makes a last row, filled up with ignored tokens: every token is evaluated."""
    path = cfg.data.eval_data_path if eval else cfg.data.data_path
    if not path:
        raise TrainingError(
            "--data_path is required: a data file (.pkl, .jsonl, .npy, .parquet; .jsonl.gz "
            "and other compressed .jsonl and .pkl), a folder of them or a quoted glob "
            "pattern, a save_to_disk directory, a token cache directory, or 'sample' for "
            "made-up learnable data (--sample_num_examples, --sample_vocab_size)"
        )
    eos = data_eos(cfg, config)
    if is_sample_data(path):
        vocab = cfg.data.sample_vocab_size or config.vocab_size
        if vocab > config.vocab_size:
            raise TrainingError(
                f"--sample_vocab_size={vocab} exceeds the model's vocab_size={config.vocab_size}"
            )
        train = cfg.data.sample_num_examples
        held_out = max(1, train // 8) if eval else 0
        # One example and its EOS fill a row: rows of one document each, as in HF's
        # benchmarks (nothing for the document mask to do).
        length = cfg.data.model_max_length - (eos is not None)
        examples = data_lib.markov_samples(train + held_out, max(length, 1), vocab, cfg.run.seed)
        examples = examples[train:] if eval else examples
        dataset = TokenDataset.from_examples(SAMPLE_DATA, list(examples))
    else:
        flag = "--eval_data_path" if eval else "--data_path"
        if not source_exists(path):
            what = "no data file matches it" if is_pattern(path) else "no such data file"
            if not os.path.isabs(path):  # relative to the working directory, not a YAML's
                what += f" (looked for {os.path.abspath(path)})"
            raise TrainingError(f"{flag}={path!r}: {what}")
        name = cfg.model.model_name_or_path
        # The model directory's tokenizer where it has one; text without any asks for one.
        own = os.path.isdir(name) and data_lib.tokenizer_file(name).is_file()
        tokenizer = cfg.data.tokenizer_name_or_path or (name if own else None)
        cache_root = cfg.data.data_cache_dir or None
        read = functools.partial(
            data_cache.packed_rows,
            path,
            cfg.data.model_max_length,
            tokenizer=tokenizer,
            eos_id=eos,
            vocab_size=config.vocab_size,
            cache_root=cache_root,
            pad_last=eval,
            packing=cfg.data.packing,
            chat_template_kwargs=parse_template_kwargs(
                cfg.data.chat_template_kwargs, "--chat_template_kwargs"
            ),
            chat_turns=cfg.data.chat_turns,
            chat_template=cfg.data.chat_template or None,
        )
        try:
            _check_sources(cfg, flag, path, eval)  # lists its files: errors name the flag
            if (
                not eval
                and jax.process_index() == 0
                and (line := _eos_warning(cfg, eos, tokenizer))
            ):
                print(line, flush=True)
            if not cache_root and not data_cache.is_cache(path) and jax.process_index() == 0:
                size = data_cache.source_bytes(path)
                if size >= IN_MEMORY_NOTE_BYTES:
                    print(
                        f"note: {flag}={path!r} ({size / 1e9:.1f} GB) is read into memory, which "
                        "takes several times its size (about 21 bytes a token) on every process, "
                        "at every start; --data_cache_dir DIR tokenizes it once into a "
                        "memory-mapped token cache that keeps both small",
                        flush=True,
                    )
            # A cache directory every process shares is built once, by process 0, and
            # then read by the others as process 0 checked it against its data (each
            # host's own copy of the data has its own time); on each host's own disk,
            # each builds its own.
            if cache_root and not data_cache.is_cache(path) and hosts.shared(cache_root):
                return hosts.first_on_process_0(
                    read,
                    f"--data_cache_dir: caching {path}",
                    others=functools.partial(read, source_checked=True),
                )
            return read()
        except ShortData as e:  # the row's length by its flag
            raise TrainingError(
                f"{e.source}: {e.tokens} tokens do not fill one row of "
                f"--model_max_length={e.seq_len} tokens; lower --model_max_length or add data"
            ) from None
        except ValueError as e:
            if tokenizer and "out of range for vocab_size" in str(e):
                _blame_the_tokenizer(cfg, tokenizer, config.vocab_size, e)
            named = pattern_folder(path) if is_pattern(path) else path
            if str(e).startswith(named) and flag not in str(e):  # which flag's data it is
                raise ValueError(f"{flag} {e}") from None
            raise
    return dataset.rows(
        cfg.data.model_max_length, eos_id=eos, pad_last=eval, packing=cfg.data.packing
    )


def _blame_the_tokenizer(cfg: TrainConfig, tokenizer: str, vocab_size: int, error) -> None:
    """Where the data's out-of-range id comes from a tokenizer with more ids than the
    model has, a TrainingError naming both sizes; else nothing (the data's own ids)."""
    try:
        from models.convert import tokenizer_vocab_size

        size = tokenizer_vocab_size(data_lib.tokenizer_file(tokenizer))
    except (OSError, ValueError):
        return
    if size <= vocab_size:
        return
    which = (
        f"--tokenizer_name_or_path={tokenizer!r}"
        if cfg.data.tokenizer_name_or_path
        else f"the tokenizer of --model_name_or_path={tokenizer!r}"
    )
    raise TrainingError(
        f"{error}: {which} has {size} ids but the model's vocab_size is {vocab_size}; "
        f"train a model of vocab_size >= {size} (its config.json) or use a tokenizer of "
        f"at most {vocab_size} ids"
    ) from None


def chat_templates(cfg: TrainConfig) -> dict[str, str] | None:
    """`--chat_template`'s templates by name (`train.chat.check_template_path`: read and
    compiled), what the run renders its conversations with and its export carries; None
    without the flag (the tokenizer's own). Refused whatever the data, before anything
    is written: a missing file, a directory without a template, one that does not
    compile."""
    if not cfg.data.chat_template:
        return None
    try:
        return check_template_path(cfg.data.chat_template, "--chat_template")
    except ValueError as e:
        raise TrainingError(str(e)) from None


def data_eos(cfg: TrainConfig, config: models.LlamaConfig) -> int | None:
    """The token between packed documents: `--eos_token_id`, else the `eos_token` of
    the run's tokenizer (`--tokenizer_name_or_path`, else the one in the
    `--model_name_or_path` directory) where its files name one, as `train.data` and
    HF's packing take it, else the model's (`end_of_text`). An Instruct model's
    tokenizer names its end of turn (Llama-3's `<|eot_id|>`), which then ends each
    conversation once, where its config.json lists `<|end_of_text|>` first. None: no
    token (`--eos_token_id none`, or none anywhere)."""
    tokenizer = cfg.data.tokenizer_name_or_path
    if tokenizer and not (file := data_lib.tokenizer_file(tokenizer)).is_file():
        # Refused whatever the data: the export carries this tokenizer.
        raise TrainingError(
            f"--tokenizer_name_or_path={tokenizer!r}: {file} does not exist (give a "
            "tokenizer.json or the directory that holds it)"
        )
    eos, where = cfg.data.eos_token_id, "--eos_token_id"
    if eos == NO_EOS:
        return None
    model = cfg.model.model_name_or_path
    if eos is None and tokenizer:
        eos = data_lib.tokenizer_eos_id(tokenizer)
        where = f"the eos_token of --tokenizer_name_or_path={tokenizer!r}"
    elif eos is None and os.path.isdir(model) and data_lib.tokenizer_file(model).is_file():
        eos = data_lib.tokenizer_eos_id(model)
        where = f"the eos_token of the tokenizer in --model_name_or_path={model!r}"
    if eos is None:
        return end_of_text(config)
    if not 0 <= eos < config.vocab_size:
        raise TrainingError(f"{where}: {eos} is not an id of vocab_size={config.vocab_size}")
    return eos


def export_config(cfg: TrainConfig, config: models.LlamaConfig) -> models.LlamaConfig:
    """The config the HF export writes: `config` with the EOS the run packed documents
    with (`data_eos`) first among its EOS ids, so the exported model continues training
    and stops generating on the token it was trained with (a preset's own EOS is not
    that of a `--tokenizer_name_or_path` BPE), and `max_position_embeddings` raised to
    `--model_max_length` where the run trained past it (the context it was extended to)."""
    if cfg.data.model_max_length > config.max_position_embeddings:
        config = config.replace(max_position_embeddings=cfg.data.model_max_length)
    eos = data_eos(cfg, config)
    ids = config.eos_token_id
    if eos is None or end_of_text(config) == eos:
        return config
    if isinstance(ids, (tuple, list)):  # Llama 3 lists its stop tokens: keep them all
        return config.replace(eos_token_id=(eos, *(i for i in ids if i != eos)))
    return config.replace(eos_token_id=eos)


def end_of_text(config: models.LlamaConfig) -> int | None:
    """The token between packed documents: the model's (tokenizer's) EOS, the first one
    where config.json lists several (Llama 3's `<|end_of_text|>`); None if it has none."""
    eos = config.eos_token_id
    if isinstance(eos, (tuple, list)):
        eos = eos[0] if eos else None
    return None if eos is None or not 0 <= int(eos) < config.vocab_size else int(eos)


def resolve_strategy(
    cfg: TrainConfig, config: models.LlamaConfig, sizes: dict[str, int], devices=None
) -> TrainConfig:
    """`cfg` with `--ring_strategy auto` replaced by the strategy it picks: `hybrid`
    where the mesh has a `seq_a2a` axis; `ulysses` where the sequence is split
    (`seq > 1`), `seq` divides the model's query heads and every device belongs to this
    one host (its all-to-all stays on NVLink); otherwise `ring`. Measured in whole
    training steps on one node of H200s, Ulysses was level with the ring at `seq=2` and
    1.05-1.18x its tokens/s at `seq=4` (BENCHMARKS.md, Trainer); across hosts the ring
    keeps its transfers to neighbours. Other strategies are returned as given."""
    if cfg.model.ring_strategy != "auto":
        return cfg
    devices = jax.devices() if devices is None else devices
    one_host = len({d.process_index for d in devices}) == 1
    seq = sizes["seq"]
    if sizes["seq_a2a"] > 1:
        strategy = "hybrid"
    elif seq > 1 and config.num_heads % seq == 0 and one_host:
        strategy = "ulysses"
    else:
        strategy = "ring"
    model = dataclasses.replace(cfg.model, ring_strategy=strategy)
    return dataclasses.replace(cfg, model=model)


def check_layout(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """Refuses, before compiling, shapes the mesh cannot split."""
    seq, a2a, seq_len = sizes["seq"], sizes["seq_a2a"], cfg.data.model_max_length
    strategy = cfg.model.ring_strategy
    if seq * a2a > 1 and cfg.model.attention != "ring":
        raise TrainingError(
            f"--mesh has seq={seq}, seq_a2a={a2a} but --attention={cfg.model.attention!r}: "
            "only 'ring' attention shards the sequence"
        )
    if a2a > 1 and strategy != "hybrid":
        raise TrainingError(
            f"--mesh has seq_a2a={a2a} but --ring_strategy={strategy!r}: the seq_a2a axis "
            "is the all-to-all axis of --ring_strategy hybrid (other strategies use seq)"
        )
    if strategy == "allgather" and cfg.model.ring_layout == "striped":
        # jflash refuses it for causal attention: a striped rank's queries are no run of
        # positions, so a gathered K/V would take one kernel call per token.
        raise TrainingError(
            "--ring_strategy allgather with --ring_layout striped: use --ring_strategy ring, "
            "or --ring_layout zigzag or contiguous"
        )
    ring = seq if strategy == "hybrid" else seq * a2a
    chunks = 2 * ring if (ring > 1 and cfg.model.ring_layout == "zigzag") else ring
    need = math.lcm(chunks, seq * a2a)
    if seq_len % need:
        other = math.lcm(ring, seq * a2a)  # striped and contiguous: one chunk per rank
        hint = ""
        if cfg.model.ring_layout == "zigzag" and seq_len % other == 0:
            hint = f"; --ring_layout striped or contiguous needs a multiple of {other}"
        raise TrainingError(
            f"--model_max_length={seq_len} must be divisible by {need} "
            f"(seq={seq}, seq_a2a={a2a}, layout={cfg.model.ring_layout}){hint}"
        )


def checked_mesh(
    cfg: TrainConfig, config: models.LlamaConfig, devices=None
) -> tuple[TrainConfig, dict[str, int]]:
    """``(cfg with --ring_strategy auto resolved, the mesh's sizes)``, after refusing
    what this machine and mesh cannot run, before the model and data load: cuDNN's
    attention off NVIDIA GPUs, and the mesh's split of the sequence and the heads."""
    count = len(devices) if devices is not None else jax.device_count()
    platform = (devices[0] if devices is not None else jax.devices()[0]).platform
    if cfg.model.attention == "cudnn" and platform != "gpu":
        raise TrainingError(
            f"--attention cudnn needs NVIDIA GPUs (cuDNN), but this runs on {platform!r}: "
            "use ring, jflash or xla"
        )
    sizes = parse_mesh(cfg.parallel.mesh, count, fsdp=bool(cfg.parallel.fsdp))
    asked = cfg.model.ring_strategy
    cfg = resolve_strategy(cfg, config, sizes, devices)
    check_layout(cfg, sizes)
    check_heads(cfg, config, sizes, asked)
    return cfg, sizes


def check_heads(
    cfg: TrainConfig, config: models.LlamaConfig, sizes: dict[str, int], asked: str
) -> None:
    """Refuses, before loading weights, an all-to-all degree that does not divide the
    model's query heads (`ulysses` splits them over seq, `hybrid` over seq_a2a), with a
    remedy the flags take. `asked`: `--ring_strategy` as given (`auto` is named so)."""
    strategy = cfg.model.ring_strategy
    axis = {"ulysses": "seq", "hybrid": "seq_a2a"}.get(strategy)
    degree = sizes[axis] if axis else 1
    if degree > 1 and config.num_heads % degree:
        flag = f"--ring_strategy {asked}" + (f" (picking {strategy})" if asked != strategy else "")
        if strategy == "hybrid":
            ring = sizes["seq"] * degree
            remedy = (
                f"choose a seq_a2a that divides them (the other devices on seq), or --mesh "
                f"seq={ring} without seq_a2a and --ring_strategy ring (any head count)"
            )
        else:
            remedy = "choose a seq that divides them, or --ring_strategy ring (any head count)"
        raise TrainingError(
            f"{flag} splits the model's {config.num_heads} query heads over {axis}={degree}, "
            f"which does not divide them: {remedy}"
        )


def loss_chunk(seq_len: int, seq: int) -> int:
    """Tokens per chunked-loss step: at most 4096 (float32 logits of 2 GiB at a 128k
    vocabulary), dividing T, a multiple of `seq` (each shard takes its share)."""
    for chunk in range(min(seq_len, 4096), 0, -1):
        if seq_len % chunk == 0 and chunk % seq == 0:
            return chunk
    return seq_len


@dataclasses.dataclass
class Trainer:
    """What a training loop needs, built from a `TrainConfig` by `build`.

    `state` is the initial (randomly initialised or HF-loaded) training state; `run`
    may replace it by a checkpoint. `step_fn(state, batch(step))` is one jitted step
    (the state is donated).
    """

    cfg: TrainConfig
    mesh: Mesh
    sizes: dict[str, int]
    config: models.LlamaConfig
    spec: StepSpec
    tx: optax.GradientTransformation
    lr_at: Callable[[int], jax.Array]
    rows: Rows | data_cache.CachedRows
    batches: data_lib.Batches
    total_steps: int
    global_batch: int
    accum: int
    state: dict[str, Any]
    state_shardings: dict[str, Any]
    step_fn: Callable
    flops_token: float
    eval_rows: Rows | data_cache.CachedRows | None = None
    eval_fn: Callable | None = None
    # `--chat_template`'s templates as the run read them (`chat_templates`): the export's
    chat_templates: dict[str, str] | None = None
    # Where attention stays inside packed documents: the model FLOPs per token of the
    # steps whose batches were made and not yet counted (`step_flops_token`).
    _step_flops: dict[int, float] = dataclasses.field(default_factory=dict)

    def batch(self, step: int) -> dict[str, jax.Array]:
        """`BATCH_KEYS` `[accum, global batch, T]` for `step`, sharded."""
        rows = self.batches.batch_at(step)
        if self.spec.mask_documents:  # this process's rows stand for the step's
            keys = models.document_keys(rows.segment_ids)
            seq_len = rows.input_ids.shape[-1]
            self._step_flops[step] = models.training_flops_per_token(
                self.config, seq_len, keys=keys
            )
        return host_batch(self.cfg, self.mesh, rows, self.accum)

    def step_flops_token(self, step: int) -> float:
        """The model FLOPs per token of step `step` (its batch made by `batch`): with
        packed documents whose attention stays inside each, the attention its rows'
        documents hold (`models.document_keys`), else one causal row (`flops_token`)."""
        return self._step_flops.pop(step, self.flops_token)

    def eval_batches(self):
        """The evaluation rows in order, `global_batch` at a time, as `BATCH_KEYS`
        `[1, global batch, T]`; the last batch is filled up with rows whose labels are
        all ignored (they count no tokens)."""
        rows, n = self.eval_rows, self.global_batch
        for begin in range(0, rows.num_rows, n):
            part = rows.take(np.arange(begin, min(begin + n, rows.num_rows)))
            if len(part.input_ids) < n:
                part = data_lib.filled_rows(part, n - len(part.input_ids))
            yield host_batch(self.cfg, self.mesh, data_lib.Batch(*part), 1)


def host_batch(cfg: TrainConfig, mesh: Mesh, b: data_lib.Batch, accum: int) -> dict:
    """One step's `BATCH_KEYS` as global arrays `[accum, global batch, T]` from the
    step's rows `b` (`[accum * global batch, T]` numpy)."""
    b_shard = batch_sharding(mesh)
    stacked = NamedSharding(mesh, P(None, *b_shard.spec))
    seq_len = b.input_ids.shape[-1]
    if cfg.data.packing_positions == "per_document":
        positions = data_lib.document_positions(b.segment_ids)
    else:
        positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), b.input_ids.shape)
    arrays = (b.input_ids, b.labels, b.segment_ids, positions)
    # Every host holds the whole global batch (`Batches` is not split by process).
    shape = (accum, b.input_ids.shape[0] // accum, seq_len)
    return {
        name: jax.make_array_from_process_local_data(stacked, np.reshape(x, shape), shape)
        for name, x in zip(BATCH_KEYS, arrays, strict=True)
    }


@dataclasses.dataclass
class StepPlan:
    """Everything about one training step that needs no data and no device memory."""

    mesh: Mesh
    sizes: dict[str, int]
    spec: StepSpec
    tx: Any
    state_shardings: dict[str, Any]
    abstract_state: dict[str, Any]
    step_fn: Callable
    eval_fn: Callable

    def abstract_batch(self, global_batch: int, accum: int, seq_len: int) -> dict[str, Any]:
        """`BATCH_KEYS` shapes of one step, sharded like `Trainer.batch`."""
        b_shard = batch_sharding(self.mesh)
        stacked = NamedSharding(self.mesh, P(None, *b_shard.spec))
        shape = (accum, global_batch, seq_len)
        return {
            name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=stacked) for name in BATCH_KEYS
        }


def plan_step(
    cfg: TrainConfig,
    config: models.LlamaConfig,
    devices=None,
    total_steps: int = 1,
    packed: bool = True,
) -> StepPlan:
    """Mesh, shardings, optimizer and the jitted step for `cfg`, with abstract state.

    Nothing is allocated: `train.tools.capacity` compiles `plan.step_fn` on abstract state to
    read its memory; `build` initialises the state that the plan describes.

    `packed`: whether some row of the data holds more than one document. Without any,
    `--mask_documents` has nothing to mask and the step passes the attention no segment
    ids (the same mask; the kernels without ids are faster).
    """
    cfg, sizes = checked_mesh(cfg, config, devices)
    mesh = make_mesh(sizes, devices)
    seq_len = cfg.data.model_max_length
    attention = models.AttentionConfig(
        kind=cfg.model.attention,
        implementation=cfg.model.attention_implementation,
        mesh=mesh,
        seq_axis=SEQ_AXES if cfg.model.ring_strategy == "hybrid" else "seq",
        layout=cfg.model.ring_layout,
        strategy=cfg.model.ring_strategy,
        batch_axes=("data", "fsdp"),
    )
    tx = optimizer(cfg.optim, total_steps)
    with jax.set_mesh(mesh):
        abstract_params = models.abstract_params(config)
        axes = shard_axes(mesh, cfg.parallel.shard_over_seq)
        gather = cfg.parallel.gather_once and any(a in SEQ_AXES for a in axes)
        # Stored state that is only ever gathered whole (no per-layer FSDP gathers of
        # the copy) keeps its minor dimension whole (`param_spec`).
        whole = gather and sizes["fsdp"] == 1
        p_shard = param_shardings(abstract_params, mesh, axes, minor_last=whole)
        opt_abstract = jax.eval_shape(tx.init, abstract_params)
        o_shard = param_shardings(opt_abstract, mesh, axes, minor_last=whole)
    try:  # a tile that does not divide a device's share is refused here, not mid-trace
        config.mlp_tile_for(seq_len // attention.seq_shards)
    except ValueError as e:
        raise TrainingError(f"--mlp_tile: {e}") from None
    offload = None
    if cfg.optim.optimizer_offload:  # stored on the host; the step moves it for the update
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        if "pinned_host" not in kinds:
            raise TrainingError(
                f"--optimizer_offload true needs pinned host memory, which "
                f"{mesh.devices.flat[0].platform} devices do not offer (they have {sorted(kinds)})"
            )
        host = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), o_shard)
        offload = (host, o_shard, cfg.optim.max_grad_norm)
        o_shard = offload[0]
    head = models.lm_head_table(config, p_shard)[0]  # its sharding
    head_axes = {a for part in head.spec for a in spec_axes(part)}
    spec = StepSpec(
        config=config,
        attention=attention,
        seq_shards=seq_shards(sizes),
        layout_shards=sizes["seq"] if cfg.model.ring_strategy == "hybrid" else seq_shards(sizes),
        layout=cfg.model.ring_layout,
        loss_chunk=loss_chunk(seq_len, seq_shards(sizes)),
        replicated_head=gather or not head_axes & set(SEQ_AXES),
        weights=(p_shard, compute_shardings(p_shard, SEQ_AXES)) if gather else None,
        mask_documents=cfg.data.mask_documents and packed,
        opt_offload=offload,
    )
    shardings = {"params": p_shard, "opt_state": o_shard, "step": replicated(mesh)}
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        {
            "params": abstract_params,
            "opt_state": opt_abstract,
            "step": jax.ShapeDtypeStruct((), jnp.int32),
        },
        shardings,
    )
    return StepPlan(
        mesh=mesh,
        sizes=sizes,
        spec=spec,
        tx=tx,
        state_shardings=shardings,
        abstract_state=abstract_state,
        step_fn=jax.jit(
            functools.partial(train_step, spec=spec, tx=tx, lr=schedule(cfg.optim, total_steps)),
            donate_argnums=0,
        ),
        eval_fn=jax.jit(functools.partial(eval_sums, spec=spec)),
    )


def build(
    cfg: TrainConfig,
    config: models.LlamaConfig | None = None,
    devices=None,
    *,
    restoring: bool = False,
) -> Trainer:
    """Mesh, model, data, optimizer, initial state and the jitted step for `cfg`.

    Args:
      cfg: the trainer configuration.
      config: a model configuration to use instead of `cfg.model` (random init), e.g.
        a preset with fewer layers for profiling.
      devices: the devices the mesh spans (default: all), e.g. a subset for a
        scaling study.
      restoring: a checkpoint's state replaces the initial one: `state` is only its
        abstract form (shapes, dtypes, shardings), and no weights are read or
        initialised (a resume would read and then drop them).
    """
    arch = model_config(cfg) if config is None else config
    cfg, sizes = checked_mesh(cfg, arch, devices)
    templates = chat_templates(cfg)
    check_host_memory(cfg, arch)
    if config is None and not restoring:
        config, host_params = load_model(cfg)
    else:
        config, host_params = config or arch, None
    seq_len = cfg.data.model_max_length

    evaluates = cfg.data.eval_data_path and cfg.run.eval_strategy != "no"
    with one_listing():  # the training data's listing serves the evaluation's checks
        rows = load_rows(cfg, config)
        eval_rows = load_rows(cfg, config, eval=True) if evaluates else None
    for flag, path, data, what in (
        ("--data_path", cfg.data.data_path, rows, "train on"),
        ("--eval_data_path", cfg.data.eval_data_path, eval_rows, "evaluate"),
    ):
        if data is not None and not data.labelled:
            raise TrainingError(
                f"{flag}={path!r}: every label is -100, no labelled tokens to {what}"
            )
    global_batch = cfg.run.per_device_train_batch_size * sizes["data"] * sizes["fsdp"]
    accum = cfg.run.gradient_accumulation_steps
    if global_batch * accum > rows.num_rows:
        raise TrainingError(
            f"one step needs {global_batch * accum} rows of {seq_len} tokens (global batch "
            f"{global_batch} x accumulation {accum}) but the data has {rows.num_rows}; lower "
            "--model_max_length, --per_device_train_batch_size or the accumulation, or add data"
        )
    batches = data_lib.Batches(
        rows,
        global_batch * accum,
        seed=cfg.run.seed,
        drop_last=cfg.data.dataloader_drop_last,
        micro_batch_size=global_batch,
    )
    if cfg.run.max_steps > 0:
        total_steps = cfg.run.max_steps
    else:
        total_steps = math.ceil(cfg.run.num_train_epochs * batches.steps_per_epoch)
    if total_steps <= 0:
        raise TrainingError(
            f"nothing to train: --num_train_epochs={cfg.run.num_train_epochs} and "
            f"--max_steps={cfg.run.max_steps} give {total_steps} steps"
        )
    # A window that starts after the run's last step traces nothing; one that ends
    # after it is cut there, with a warning (`train.loop`).
    profile = profile_window(cfg)
    if profile and profile[0] >= total_steps:
        raise TrainingError(
            f"--profile_steps={cfg.profile.profile_steps!r} starts after the run's "
            f"{plural(total_steps, 'step')}: nothing would be traced"
        )

    packed = rows.packed or (eval_rows is not None and eval_rows.packed)
    plan = plan_step(cfg, config, devices, total_steps, packed=packed)
    mesh = plan.mesh
    if restoring:
        state = plan.abstract_state
    else:
        state = initial_state(cfg, config, plan, host_params)
    return Trainer(
        cfg=cfg,
        mesh=mesh,
        sizes=plan.sizes,
        config=config,
        spec=plan.spec,
        tx=plan.tx,
        lr_at=schedule(cfg.optim, total_steps),
        rows=rows,
        batches=batches,
        total_steps=total_steps,
        global_batch=global_batch,
        accum=accum,
        state=state,
        state_shardings=plan.state_shardings,
        step_fn=plan.step_fn,
        flops_token=models.training_flops_per_token(config, seq_len),
        eval_rows=eval_rows,
        eval_fn=plan.eval_fn,
        chat_templates=templates,
    )


def initial_state(cfg: TrainConfig, config, plan: StepPlan, host_params) -> dict[str, Any]:
    """The state a run starts from: `host_params` (an HF directory's) or, where None,
    parameters initialised from `--seed`, placed by the plan's shardings; the
    optimizer's initial state; step 0."""
    mesh, p_shard = plan.mesh, plan.state_shardings["params"]
    with jax.set_mesh(mesh):
        if host_params is None:
            params = jax.jit(functools.partial(models.init_params, config), out_shardings=p_shard)(
                jax.random.key(cfg.run.seed)
            )
        else:
            params = jax.tree.map(
                lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
                host_params,
                p_shard,
            )
        opt_state = jax.jit(plan.tx.init, out_shardings=plan.state_shardings["opt_state"])(params)
        return {
            "params": params,
            "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh)),
        }


def profile_window(cfg: TrainConfig) -> tuple[int, int] | None:
    """`--profile_steps start,stop`: the steps `start .. stop - 1` as the step lines (and
    the trace's step numbers) count them, from 1; returned as the loop's 0-based
    `(first, stop)`, or None without the flag."""
    text = cfg.profile.profile_steps.strip()
    if not text:
        return None
    try:
        start, stop = (int(x) for x in text.split(","))
    except ValueError:
        raise TrainingError(f"--profile_steps={text!r} must be 'start,stop'") from None
    if not 1 <= start < stop:
        raise TrainingError(
            f"--profile_steps={text!r} needs 1 <= start < stop (steps count from 1, as the "
            "step lines do)"
        )
    return start - 1, stop - 1
