"""`python -m train`: the seed's training job over a ("data", "fsdp", "seq") mesh."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models.loss import IGNORE_INDEX
from models.sharding import spec_axes
from train import data as data_lib
from train import outputs
from train.checkpoint import Checkpoints, resolve_resume
from train.config import TrainConfig
from train.errors import TrainingError
from train.mesh import (
    batch_sharding,
    compute_shardings,
    make_mesh,
    param_shardings,
    parse_mesh,
    replicated,
    shard_axes,
)
from train.metrics import JsonlLog, memory, throughput
from train.oom import is_oom
from train.optim import optimizer, schedule
from train.step import BATCH_KEYS, StepSpec, eval_sums, train_step
from train.tensorboard import SummaryWriter
from train.trace import NO_COMMAND_BUFFERS, command_buffers_on


def initialize_distributed(cfg: TrainConfig) -> None:
    """Multi-host through jax's own engine: flags, or the usual cluster variables."""
    p = cfg.parallel
    if p.coordinator_address or (p.num_processes or 0) > 1:
        jax.distributed.initialize(
            coordinator_address=p.coordinator_address,
            num_processes=p.num_processes,
            process_id=p.process_id,
        )
    elif "JAX_COORDINATOR_ADDRESS" in os.environ or "SLURM_JOB_ID" in os.environ:
        jax.distributed.initialize()


def _for_run(config: models.LlamaConfig, cfg: TrainConfig) -> models.LlamaConfig:
    return config.replace(
        dtype="bfloat16" if (cfg.model.bf16 or cfg.model.fp16) else "float32",
        param_dtype="float32",
        remat=cfg.remat,
        scan_layers=cfg.model.scan_layers,
    )


def model_config(cfg: TrainConfig) -> models.LlamaConfig:
    """The model's `LlamaConfig` (an HF directory's config.json, or a preset) with the
    run's dtypes and remat policy; reads no weights."""
    name = cfg.model.model_name_or_path
    if os.path.isdir(name):
        return _for_run(models.from_hf_config(name), cfg)
    try:
        return _for_run(models.preset(name), cfg)
    except (KeyError, ValueError) as e:
        raise TrainingError(
            f"--model_name_or_path={name!r} is neither a local HF directory nor a preset "
            f"({sorted(models.PRESETS)})"
        ) from e


def load_model(cfg: TrainConfig):
    """`(LlamaConfig, host params or None)`: an HF directory, or a preset (random init)."""
    name = cfg.model.model_name_or_path
    if not os.path.isdir(name):
        return model_config(cfg), None
    config, params = models.load_hf(name)
    return _for_run(config, cfg), params


SAMPLE_DATA = "sample"


def load_rows(cfg: TrainConfig, config, *, eval: bool = False) -> data_lib.Rows:
    """The packed rows of `--data_path` (or `--eval_data_path` with `eval`); `sample`
    makes learnable sample data in memory (the same on every host: it depends only on
    the flags and `--seed`; the evaluation's is held out from the same chain)."""
    path = cfg.data.eval_data_path if eval else cfg.data.data_path
    if not path:
        raise TrainingError(
            "--data_path is required: a .pkl, .jsonl or .npy file, or 'sample' for "
            "made-up learnable data (--sample_num_examples, --sample_vocab_size)"
        )
    if path == SAMPLE_DATA:
        vocab = cfg.data.sample_vocab_size or config.vocab_size
        if vocab > config.vocab_size:
            raise TrainingError(
                f"--sample_vocab_size={vocab} exceeds the model's vocab_size={config.vocab_size}"
            )
        train = cfg.data.sample_num_examples
        held_out = max(1, train // 8) if eval else 0
        examples = data_lib.markov_samples(
            train + held_out, cfg.data.model_max_length, vocab, cfg.run.seed
        )
        examples = examples[train:] if eval else examples
        dataset = data_lib.TokenDataset.from_examples(SAMPLE_DATA, list(examples))
    else:
        name = cfg.model.model_name_or_path
        tokenizer_dir = name if os.path.isdir(name) else None
        dataset = data_lib.load_dataset(
            path, tokenizer_dir=tokenizer_dir, vocab_size=config.vocab_size
        )
    return dataset.rows(cfg.data.model_max_length, eos_id=end_of_text(config))


def end_of_text(config: models.LlamaConfig) -> int | None:
    """The token between packed documents: the model's (tokenizer's) EOS, the first one
    where config.json lists several (Llama 3's `<|end_of_text|>`); None if it has none."""
    eos = config.eos_token_id
    if isinstance(eos, (tuple, list)):
        eos = eos[0] if eos else None
    return None if eos is None or not 0 <= int(eos) < config.vocab_size else int(eos)


def check_layout(cfg: TrainConfig, sizes: dict[str, int]) -> None:
    """Refuses, before compiling, shapes the mesh cannot split."""
    seq, seq_len = sizes["seq"], cfg.data.model_max_length
    if seq > 1 and cfg.model.attention != "ring":
        raise TrainingError(
            f"--mesh has seq={seq} but --attention={cfg.model.attention!r}: only 'ring' "
            "attention shards the sequence"
        )
    need = 2 * seq if (seq > 1 and cfg.model.ring_layout == "zigzag") else seq
    if seq_len % need:
        raise TrainingError(
            f"--model_max_length={seq_len} must be divisible by {need} "
            f"(seq={seq}, layout={cfg.model.ring_layout})"
        )


def loss_chunk(seq_len: int, seq: int) -> int:
    """Tokens per chunked-loss step: at most 4096 (float32 logits of 2 GiB at a 128k
    vocabulary), dividing T, a multiple of `seq` (each shard takes its share)."""
    for chunk in range(min(seq_len, 4096), 0, -1):
        if seq_len % chunk == 0 and chunk % seq == 0:
            return chunk
    return seq_len


@dataclasses.dataclass
class _Timer:
    start: float = 0.0
    tokens: int = 0


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
    rows: data_lib.Rows
    batches: data_lib.Batches
    total_steps: int
    global_batch: int
    accum: int
    state: dict[str, Any]
    state_shardings: dict[str, Any]
    step_fn: Callable
    flops_token: float
    eval_rows: data_lib.Rows | None = None
    eval_fn: Callable | None = None

    def batch(self, step: int) -> dict[str, jax.Array]:
        """`BATCH_KEYS` `[accum, global batch, T]` for `step`, sharded."""
        return host_batch(self.cfg, self.mesh, self.batches.batch_at(step), self.accum)

    def eval_batches(self):
        """The evaluation rows in order, `global_batch` at a time, as `BATCH_KEYS`
        `[1, global batch, T]`; the last batch is filled up with rows whose labels are
        all ignored (they count no tokens)."""
        rows, n = self.eval_rows, self.global_batch
        for begin in range(0, rows.num_rows, n):
            part = [a[begin : begin + n] for a in rows]
            missing = n - len(part[0])
            if missing:
                fill = (0, IGNORE_INDEX, 0)
                part = [
                    np.concatenate([a, np.full((missing, a.shape[1]), v, a.dtype)])
                    for a, v in zip(part, fill, strict=True)
                ]
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
    cfg: TrainConfig, config: models.LlamaConfig, devices=None, total_steps: int = 1
) -> StepPlan:
    """Mesh, shardings, optimizer and the jitted step for `cfg`, with abstract state.

    Nothing is allocated: `train.capacity` compiles `plan.step_fn` on abstract state to
    read its memory; `build` initialises the state that the plan describes.
    """
    count = len(devices) if devices is not None else jax.device_count()
    sizes = parse_mesh(cfg.parallel.mesh, count, fsdp=bool(cfg.parallel.fsdp))
    check_layout(cfg, sizes)
    mesh = make_mesh(sizes, devices)
    seq_len = cfg.data.model_max_length
    attention = models.AttentionConfig(
        kind=cfg.model.attention,
        implementation=cfg.model.attention_implementation,
        mesh=mesh,
        seq_axis="seq",
        layout=cfg.model.ring_layout,
        strategy=cfg.model.ring_strategy,
        batch_axes=("data", "fsdp"),
    )
    tx = optimizer(cfg.optim, total_steps)
    with jax.set_mesh(mesh):
        abstract_params = models.abstract_params(config)
        axes = shard_axes(mesh, cfg.parallel.shard_over_seq)
        gather = cfg.parallel.gather_once and "seq" in axes
        # Stored state that is only ever gathered whole (no per-layer FSDP gathers of
        # the copy) keeps its minor dimension whole (`param_spec`).
        whole = gather and sizes["fsdp"] == 1
        p_shard = param_shardings(abstract_params, mesh, axes, minor_last=whole)
        opt_abstract = jax.eval_shape(tx.init, abstract_params)
        o_shard = param_shardings(opt_abstract, mesh, axes, minor_last=whole)
    head = models.lm_head_table(config, p_shard)[0]  # its sharding
    head_axes = {a for part in head.spec for a in spec_axes(part)}
    spec = StepSpec(
        config=config,
        attention=attention,
        seq_shards=sizes["seq"],
        layout=cfg.model.ring_layout,
        loss_chunk=loss_chunk(seq_len, sizes["seq"]),
        replicated_head=gather or "seq" not in head_axes,
        weights=(p_shard, compute_shardings(p_shard, "seq")) if gather else None,
        mask_documents=cfg.data.mask_documents,
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
        step_fn=jax.jit(functools.partial(train_step, spec=spec, tx=tx), donate_argnums=0),
        eval_fn=jax.jit(functools.partial(eval_sums, spec=spec)),
    )


def build(cfg: TrainConfig, config: models.LlamaConfig | None = None, devices=None) -> Trainer:
    """Mesh, model, data, optimizer, initial state and the jitted step for `cfg`.

    Args:
      cfg: the trainer configuration.
      config: a model configuration to use instead of `cfg.model` (random init), e.g.
        a preset with fewer layers for profiling.
      devices: the devices the mesh spans (default: all), e.g. a subset for a
        scaling study.
    """
    count = len(devices) if devices is not None else jax.device_count()
    sizes = parse_mesh(cfg.parallel.mesh, count, fsdp=bool(cfg.parallel.fsdp))
    check_layout(cfg, sizes)
    if config is None:
        config, host_params = load_model(cfg)
    else:
        host_params = None
    seq_len = cfg.data.model_max_length

    rows = load_rows(cfg, config)
    eval_rows = load_rows(cfg, config, eval=True) if cfg.data.eval_data_path else None
    global_batch = cfg.run.per_device_train_batch_size * sizes["data"] * sizes["fsdp"]
    accum = cfg.run.gradient_accumulation_steps
    if global_batch * accum > rows.num_rows:
        raise TrainingError(
            f"one step needs {global_batch * accum} rows of {seq_len} tokens (global batch "
            f"{global_batch} x accumulation {accum}) but the data has {rows.num_rows}; lower "
            "--model_max_length, --per_device_train_batch_size or the accumulation, or add data"
        )
    batches = data_lib.Batches(rows, global_batch * accum, seed=cfg.run.seed)
    if cfg.run.max_steps > 0:
        total_steps = cfg.run.max_steps
    else:
        total_steps = math.ceil(cfg.run.num_train_epochs * batches.steps_per_epoch)
    if total_steps <= 0:
        raise TrainingError(
            f"nothing to train: --num_train_epochs={cfg.run.num_train_epochs} and "
            f"--max_steps={cfg.run.max_steps} give {total_steps} steps"
        )
    profile = _profile_window(cfg)
    if profile and profile[1] > total_steps:
        raise TrainingError(
            f"--profile_steps={cfg.profile.profile_steps!r} ends after the run's "
            f"{total_steps} steps; the trace would never be written"
        )

    plan = plan_step(cfg, config, devices, total_steps)
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
        state = {
            "params": params,
            "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh)),
        }
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
    )


def run(cfg: TrainConfig) -> dict:
    """Trains; returns a summary (training losses, evaluations, steps, metrics) for tests
    and reports.

    Everything that can refuse the run (flags, output directory, model, data, mesh, the
    checkpoint to resume, the step's compilation) is checked before a previous run's
    outputs are deleted (`--overwrite_output_dir`) or its log is cut back (resume).
    """
    initialize_distributed(cfg)
    is_main = jax.process_index() == 0
    out = cfg.run.output_dir
    outputs.check_writable(out)
    resume = resolve_resume(cfg.run.resume_from_checkpoint, out)
    continuing = resume is not None and os.path.abspath(resume[0]) == os.path.abspath(out)
    outputs.check_claim(
        out,
        continuing=continuing,
        overwrite=cfg.run.overwrite_output_dir,
        resume_flag=cfg.run.resume_from_checkpoint,
    )
    t = build(cfg)
    with jax.set_mesh(t.mesh):
        state, start_step = _initial_state(t, resume, continuing)
        t.state = None  # the loop owns (and donates) the state from here on
        step_fn = t.step_fn
        if start_step < t.total_steps:
            # Compiled before anything is deleted: a step that cannot compile (or does
            # not fit) leaves the previous run's outputs in place.
            with _oom_advice(cfg):
                step_fn = t.step_fn.lower(state, t.batch(start_step)).compile()
                if t.eval_rows is not None:
                    batch = next(t.eval_batches())
                    t.eval_fn = t.eval_fn.lower(state["params"], batch).compile()
        if cfg.run.overwrite_output_dir:
            outputs.clear(out, is_main)
        if continuing and is_main:
            outputs.drop_after(out, start_step)
        if start_step >= t.total_steps and is_main:
            print(
                f"nothing to train: checkpoint {start_step} is already at the run's "
                f"{t.total_steps} steps",
                file=sys.stderr,
            )
        state, history = _train(t, state, start_step, step_fn, is_main)
        if cfg.run.export_hf and t.total_steps > start_step:
            host = multihost_utils.process_allgather(state["params"], tiled=True)
            if is_main:
                hf_dir = os.path.join(out, "hf")
                models.export_hf(jax.tree.map(np.asarray, host), t.config, hf_dir)
                outputs.copy_tokenizer(cfg.model.model_name_or_path, hf_dir)
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "eval": [h for h in history if "eval_loss" in h],
        "history": history,
        "total_steps": t.total_steps,
        "start_step": start_step,
        "mesh": t.sizes,
        "config": t.config,
    }


def _run_meta(t: Trainer) -> dict:
    """What fixes the data order and the schedule: a resumed run must match it."""
    return {
        "model_max_length": t.cfg.data.model_max_length,
        "rows_per_step": t.global_batch * t.accum,
        "num_rows": t.rows.num_rows,
        "seed": t.cfg.run.seed,
        "total_steps": t.total_steps,
    }


def _initial_state(t: Trainer, resume, continuing: bool) -> tuple[dict, int]:
    """`(state, first step)`: the built state, or a checkpoint's (read, never written)."""
    if resume is None:
        return t.state, 0
    cfg = t.cfg
    if continuing:
        source = Checkpoints(cfg.run.output_dir, None, read_only=True)
    else:
        source = Checkpoints(resume[0], None, read_only=True)
    try:
        step = resume[1] if resume[1] is not None else source.latest_step()
        if step is None:
            raise TrainingError(f"--resume_from_checkpoint: no checkpoint in {source.directory}")
        later = [s for s in source.all_steps() if s > step]
        if continuing and later:
            raise TrainingError(
                f"--resume_from_checkpoint: {source.directory} also holds later "
                f"checkpoints {later}, which training on from {step} here would collide "
                f"with; resume into another --output_dir"
            )
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            t.state,
            t.state_shardings,
        )
        state, meta = source.restore(step, abstract)
    finally:
        source.close()
    start_step = int(meta["step"])
    _check_resumable(meta, _run_meta(t), source.directory)
    # The saved data position must land on the same step with this data/batch.
    resumed = data_lib.Batches(
        t.rows, t.global_batch * t.accum, seed=cfg.run.seed, start=meta["data"]
    )
    if resumed.step != start_step:
        raise TrainingError(
            f"checkpoint step {start_step} and data position {meta['data']} disagree: "
            "did the data, --model_max_length or the batch size change?"
        )
    return state, start_step


def _train(t: Trainer, state, start_step: int, step_fn, is_main: bool):
    """The loop from `start_step` to `t.total_steps`: `(final state, logged history)`."""
    cfg, out, total_steps = t.cfg, t.cfg.run.output_dir, t.total_steps
    ckpt = Checkpoints(out, cfg.run.save_total_limit)
    run_meta = _run_meta(t)
    writer = SummaryWriter(os.path.join(out, "tensorboard")) if is_main else None
    log = JsonlLog(os.path.join(out, "log.jsonl")) if is_main else None
    profile = _profile_window(cfg)
    if profile and is_main and jax.default_backend() == "gpu" and command_buffers_on():
        print(
            "warning: --profile_steps with XLA's command buffers on: the trace's kernels "
            f"will carry no op names or name scopes; set XLA_FLAGS={NO_COMMAND_BUFFERS} "
            "before starting for a trace that names them",
            file=sys.stderr,
            flush=True,
        )
    bar = _progress(cfg, is_main, start_step, total_steps)
    history = []
    timer = _Timer()
    finish_args = (cfg, t.lr_at, timer, t.flops_token, writer, log, bar, total_steps)
    steps_per_epoch = t.batches.steps_per_epoch
    # Metrics are fetched one step late (the next step is already queued), except at
    # logging and saving steps, which wait for their own step: throughput windows
    # then start and end at completed steps, and nothing non-finite is saved.
    pending = None
    tracing = False
    try:
        for step in range(start_step, total_steps):
            if profile and step == profile[0]:
                jax.block_until_ready(state)
                jax.profiler.start_trace(
                    cfg.profile.profile_dir or os.path.join(out, "tensorboard")
                )
                tracing = True
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                with _oom_advice(cfg):
                    state, metrics = step_fn(state, t.batch(step))
            if tracing and step == profile[1] - 1:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                tracing = False
            if pending is not None:
                history.append(_finish(pending, *finish_args))
                pending = None
            done = step + 1
            save = _should_save(cfg, done, total_steps, steps_per_epoch)
            if save or done % cfg.run.logging_steps == 0 or done == total_steps:
                history.append(_finish((step, metrics), *finish_args))
            else:
                pending = (step, metrics)
            if t.eval_rows is not None and _should_eval(cfg, done, total_steps, steps_per_epoch):
                if pending is not None:  # the step's own record goes first
                    history.append(_finish(pending, *finish_args))
                    pending = None
                history.append(_evaluate(t, state["params"], done, writer, log, bar))
            if save:
                epoch, index = divmod(done, steps_per_epoch)
                data_pos = {"epoch": epoch, "index": index}
                ckpt.save(done, state, {"step": done, "data": data_pos, "run": run_meta})
                if writer is not None:  # what a resume from here keeps is on disk
                    writer.flush()
    finally:
        if tracing:  # stopped early (an error): keep what was traced
            jax.profiler.stop_trace()
        ckpt.close()
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
        if log is not None:
            log.close()
    return state, history


def _should_eval(cfg: TrainConfig, done: int, total: int, steps_per_epoch: int) -> bool:
    if done == total:
        return True
    if cfg.run.eval_strategy == "epoch":
        return done % steps_per_epoch == 0
    return done % (cfg.run.eval_steps or cfg.run.save_steps) == 0


def _evaluate(t: Trainer, params, done: int, writer, log, bar) -> dict:
    """The mean token loss and perplexity over all evaluation rows (sums over batches,
    one division), logged like the training metrics."""
    total, count = 0.0, 0
    with _oom_advice(t.cfg):
        for batch in t.eval_batches():
            loss_sum, n = jax.device_get(t.eval_fn(params, batch))
            total, count = total + float(loss_sum), count + int(n)
    if count == 0:
        raise TrainingError(
            f"--eval_data_path={t.cfg.data.eval_data_path!r}: no labelled tokens to evaluate"
        )
    loss = total / count
    record = {
        "step": done,
        "eval_loss": loss,
        "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
        "eval_tokens": count,
    }
    if writer is not None:
        writer.scalars({"eval/loss": loss, "eval/perplexity": record["eval_perplexity"]}, done)
    if log is not None:
        log.write(record)
    if jax.process_index() == 0 and t.cfg.run.progress:
        line = f"eval at step {done}: loss {loss:.4f}, perplexity {record['eval_perplexity']:.4g}"
        bar.write(line) if bar is not None else print(line, flush=True)
    return record


def _check_resumable(meta: dict, run_meta: dict, where: str) -> None:
    saved = meta.get("run")
    if saved is None:  # checkpoints written before this record existed
        return
    schedule_keys = ("total_steps",)
    changed = {
        k: (saved[k], v)
        for k, v in run_meta.items()
        if k in saved and saved[k] != v and k not in schedule_keys
    }
    if changed:
        text = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written by a run with other settings "
            f"({text}); resuming would not continue its data order. Use the same "
            "--model_max_length, data, global batch (per-device batch x data x fsdp x "
            "accumulation) and --seed"
        )
    old, new = saved.get("total_steps"), run_meta["total_steps"]
    if old is not None and old != new:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} belongs to a run of {old} steps; this run "
            f"has {new} (--max_steps / --num_train_epochs), which would change its "
            "learning-rate schedule mid-run (the decay would jump). Resume with the same "
            f"number of steps ({old}), or train further as a new run from the export "
            "(--model_name_or_path <output_dir>/hf, a new --output_dir and its own schedule)"
        )


def _progress(cfg, is_main, start, total):
    if not (is_main and cfg.run.progress):
        return None
    from tqdm.auto import tqdm

    # disable=None: tqdm turns itself off when stderr is not a terminal (CI logs, pipes).
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, disable=None)


def _profile_window(cfg: TrainConfig) -> tuple[int, int] | None:
    text = cfg.profile.profile_steps.strip()
    if not text:
        return None
    try:
        start, stop = (int(x) for x in text.split(","))
    except ValueError:
        raise TrainingError(f"--profile_steps={text!r} must be 'start,stop'") from None
    if not 0 <= start < stop:
        raise TrainingError(f"--profile_steps={text!r} needs 0 <= start < stop")
    return start, stop


def _should_save(cfg: TrainConfig, done: int, total: int, steps_per_epoch: int) -> bool:
    if cfg.run.save_strategy == "no":
        return False
    if cfg.run.save_strategy == "epoch":
        return done % steps_per_epoch == 0 or done == total
    return done % cfg.run.save_steps == 0 or done == total


def _oom_error(cfg: TrainConfig) -> TrainingError:
    return TrainingError(
        "out of device memory. Turn one of: --per_device_train_batch_size (now "
        f"{cfg.run.per_device_train_batch_size}), --model_max_length (now "
        f"{cfg.data.model_max_length}), a larger seq or fsdp axis in --mesh (now "
        f"{cfg.parallel.mesh!r}), --remat_policy save_attn or full (now {cfg.remat!r}; "
        "memory: none > save_dots > save_attn > full); "
        "on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) gives XLA more of the "
        "device. `python -m train.capacity` finds what fits without running"
    )


@contextlib.contextmanager
def _oom_advice(cfg: TrainConfig):
    """Re-raises an out-of-memory error with the knobs to turn. Steps run
    asynchronously, so it wraps both the step's dispatch and its metrics' fetch, where
    an error raised while the step ran surfaces."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - rethrown with advice, or as is
        if is_oom(e):
            raise _oom_error(cfg) from e
        raise


def _finish(pending, cfg, lr_at, timer: _Timer, flops_token, writer, log, bar, total_steps) -> dict:
    """Fetches one step's metrics; stops on a non-finite loss or gradient (the update of
    a non-finite gradient makes the parameters non-finite); logs every logging_steps
    and the last step."""
    step, metrics = pending
    with _oom_advice(cfg):
        metrics = jax.device_get(metrics)
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingError(
            f"non-finite loss {loss} or gradient norm {grad_norm} at step {step + 1}; "
            "training stopped. No checkpoint was written for this or later steps, so the "
            "last checkpoint is intact. Lower --learning_rate or check the data."
        )
    done = step + 1
    if timer.start == 0.0:  # the first step includes compilation: throughput starts after it
        timer.start = time.perf_counter()
    else:
        timer.tokens += int(metrics["tokens"])
    record = {
        "step": done,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(lr_at(step)),
    }
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    if done % cfg.run.logging_steps == 0 or done == total_steps:
        now = time.perf_counter()
        if timer.tokens:  # the window holds timed steps (the first one is compilation)
            seconds = now - timer.start
            record.update(throughput(timer.tokens, seconds, flops_token, jax.device_count()))
        record.update(memory())
        timer.start, timer.tokens = now, 0
        if writer is not None:
            writer.scalars({f"train/{k}": v for k, v in record.items() if k != "step"}, done)
        if log is not None:
            log.write(record)
    return record
