"""`python -m train`: the training job over a ("data", "fsdp", "seq") mesh."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.compilation_cache import compilation_cache

import models
from train import outputs, reporters
from train.build import Trainer, build, export_config, is_sample_data, profile_window
from train.checkpoint import (
    Checkpoints,
    remove_partial_saves,
    resolve_resume,
    resume_path,
    resumes,
)
from train.config import NO_EOS, STEP_COUNTS, TrainConfig
from train.errors import STOP_SIGNALS, USER_ERRORS, Preempted, TrainingError, from_interrupt
from train.hosts import check_shared, initialize_distributed, same_on_every_process
from train.metrics import JsonlLog, memory, throughput
from train.oom import allocator_hint, failed_allocation_bytes, is_oom
from train.run_record import (
    check_model,
    check_resumable,
    data_fingerprint,
    drop_last_warning,
    eval_data_warning,
    label_fingerprint,
    resolve_auto_resume,
    run_record,
    update_warning,
)
from train.words import plural
from train.xla_flags import NO_COMMAND_BUFFERS, command_buffers_on

# TensorBoard / wandb tags under `train/` that take HF Trainer's name (its
# `train/learning_rate`), so that an HF run's charts and a jflash run's overlay; the
# other records keep their `log.jsonl` names.
HF_TAGS = {"lr": "learning_rate"}


@dataclasses.dataclass
class _Timer:
    start: float = 0.0
    tokens: int = 0
    steps: int = 0  # timed steps in the window (compilation's step is not one)
    # Tokens a step computes: its rows x their length, labelled or not (what throughput,
    # TFLOP/s and MFU count; the loss counts only the labelled ones).
    step_tokens: int = 0
    flops: float = 0.0  # the window's model FLOPs (each step's tokens x its FLOPs per token)
    profile: tuple[int, int] | None = None  # the traced steps, 0-based `(first, stop)`
    traced: bool = False  # the window holds a traced step (slower under the profiler)

    def leave_out(self, began: float) -> None:
        """Leaves the time since `began` (time.perf_counter) out of the throughput
        window: an evaluation's, a save's, the profiler's. Before the first step's end
        there is no window yet."""
        if self.start:
            self.start += time.perf_counter() - began


def run(cfg: TrainConfig) -> dict:
    """Trains; returns a summary (training losses, evaluations, steps, metrics) for tests
    and reports.

    Everything that can refuse the run (flags, output directory, model, data, mesh, the
    checkpoint to resume, the step's compilation) is checked before a previous run's
    outputs are set aside (`--overwrite_output_dir`) or its log is cut back (resume). An
    `--overwrite_output_dir` run stopped before then carries the note
    `outputs.NOT_STARTED`.
    """
    stage = {"claimed": False}
    try:
        return _run(cfg, stage)
    except BaseException as e:
        if cfg.run.overwrite_output_dir and not stage["claimed"]:
            e.add_note(outputs.NOT_STARTED)
        raise


def checkpoints_used(cfg: TrainConfig) -> bool:
    """Whether the run may write or read checkpoints in `--output_dir` (a multi-host
    run's processes then need it to be one directory, `hosts.check_shared`)."""
    return cfg.run.save_strategy != "no" or resumes(cfg.run.resume_from_checkpoint)


def _settings_of(cfg: TrainConfig) -> dict[str, Any]:
    """Every setting by its flag, but how each process met the others: `--process_id`
    (each process's own), `--coordinator_address` (having met, the processes reached
    the same coordinator, whether by host name or address) and `--ddp_timeout`."""
    flat = {
        f"--{name}": value
        for section in dataclasses.asdict(cfg).values()
        for name, value in section.items()
    }
    for own in ("--process_id", "--coordinator_address", "--ddp_timeout"):
        del flat[own]
    return flat


def _run(cfg: TrainConfig, stage: dict) -> dict:
    """`run`; sets `stage["claimed"]` once it starts to change the output directory."""
    initialize_distributed(cfg)
    same_on_every_process(_settings_of(cfg), "settings")
    is_main = jax.process_index() == 0
    out = cfg.run.output_dir
    outputs.check_writable(out)
    if is_main:  # before anything reads or mends the directory, or advises on it
        outputs.check_not_in_use(out)
    if cache := cfg.run.compilation_cache_dir:
        outputs.check_writable(cache, "--compilation_cache_dir")
        use_compilation_cache(os.path.abspath(cache))
    if checkpoints_used(cfg):
        check_shared(out, "--output_dir", "Each process saves its part of every checkpoint there")
    if (other := resume_path(cfg.run.resume_from_checkpoint)) is not None:
        check_shared(  # before any process reads it
            other, "--resume_from_checkpoint", "Each process reads its part of the checkpoint"
        )
    # A previous run split by a replacing run killed midway is made whole before
    # anything reads the directory (which checkpoint to resume, what it holds).
    if (line := outputs.recover(out, is_main)) is not None:
        print(line, flush=True)
    # What `auto` and `latest` choose from, checked again under the lock (`claim`).
    seen = outputs.saved_steps(out)
    # `auto` resuming where --overwrite_output_dir is given: a refusal of the checkpoint
    # says why the overwrite did not apply.
    auto_over = (cfg.run.resume_from_checkpoint or "").lower() == "auto" and bool(
        seen and cfg.run.overwrite_output_dir
    )
    cfg = resolve_auto_resume(cfg, is_main)
    reporters.check(cfg.run.report_to)
    if cfg.profile.profile_steps and cfg.profile.profile_dir:
        outputs.check_writable(cfg.profile.profile_dir, "--profile_dir")
    resume = resolve_resume(cfg.run.resume_from_checkpoint, out)
    continuing = resume is not None and os.path.abspath(resume[0]) == os.path.abspath(out)
    if resume is not None and not os.path.isdir(os.path.join(resume[0], "checkpoints")):
        # Said before the model and data load (`Checkpoints` says it again on reading).
        where = os.path.abspath(os.path.join(resume[0], "checkpoints"))
        auto = " (`auto` starts from step 0 where there is none)" if continuing else ""
        raise TrainingError(f"--resume_from_checkpoint: {where} does not exist{auto}")
    # What the run reads, which --overwrite_output_dir must not replace.
    inputs = {
        f"--{name}": getattr(getattr(cfg, section), name)
        for section, name in outputs.PATH_SETTINGS
        if name not in outputs.CREATED_DIRS
    }
    inputs["--resume_from_checkpoint"] = resume[0] if resume is not None else ""
    claim = functools.partial(
        outputs.check_claim,
        out,
        continuing=continuing,
        overwrite=cfg.run.overwrite_output_dir,
        resume_flag=cfg.run.resume_from_checkpoint,
        inputs=inputs,
    )
    claim()
    # A resume's state is the checkpoint's: no weights are read or initialised for it.
    t = build(cfg, restoring=resume is not None)
    same_on_every_process(
        {
            "rows": t.rows.num_rows,
            "tokens": data_fingerprint(t.rows),
            "labels": label_fingerprint(t.rows),
        },
        "data (--data_path's rows: their count, and a hash of their tokens and labels)",
    )
    if is_main:
        _say_what_is_made_up(cfg)
        _say_where_positions_run_past(t)
        _say_what_the_mesh_leaves_unused(t)
        print(_plan(t), flush=True)
        if line := _intervals(t):
            print(line, flush=True)
    split = ", ".join(f"{a}={t.sizes[a]}" for a in ("seq", "seq_a2a") if t.sizes[a] > 1)
    if is_main and split and cfg.model.ring_strategy == "auto":
        print(f"--ring_strategy auto: {t.cfg.model.ring_strategy} ({split})", flush=True)
    if is_main and cfg.data.mask_documents and not t.spec.mask_documents:
        print("--mask_documents: every row holds one document, nothing to mask", flush=True)
    elif is_main and t.spec.mask_documents:
        restart = cfg.data.packing_positions == "per_document"
        print(
            "--mask_documents: rows pack several documents; attention stays inside each"
            + (", and positions restart at each (--packing_positions)" if restart else ""),
            flush=True,
        )
    elif is_main and t.rows.packed and cfg.data.eos_token_id == NO_EOS:
        print(
            "note: --mask_documents false with --eos_token_id none: nothing marks where one "
            "packed document ends and the next begins (no token, attention across them); "
            "right for pieces of one long text, not for separate documents",
            flush=True,
        )
    with jax.set_mesh(t.mesh):
        run_meta = run_record(t)  # what a checkpoint records and a resume checks
        try:
            state, start_step, eval_pending = _initial_state(t, resume, continuing, run_meta)
        except TrainingError as e:
            if not auto_over:
                raise
            raise TrainingError(
                f"{e} (--resume_from_checkpoint auto found checkpoint {seen[-1]} in {out} "
                "and resumes it: --overwrite_output_dir applies only where there is none; "
                "to replace that run, drop auto, or choose another --output_dir)"
            ) from None
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
        # A run with nothing to train writes nothing (and replaces nothing), but the
        # export of a run stopped after its last checkpoint (a SIGTERM on the last step,
        # or during the export).
        trains = start_step < t.total_steps
        # (Only a run's own stopped export: a finished run resumed into another
        # directory has nothing to train there, and writes nothing.)
        exports = cfg.run.export_hf and (trains or (continuing and _export_missing(out, is_main)))
        with contextlib.ExitStack() as held:
            if trains or exports:
                # Under the lock, the checkpoints it chose from are compared too (on the
                # main process alone: a race seen by some processes would hang the rest).
                _claim_under_lock(held, out, functools.partial(claim, seen=seen), is_main)
            stage["claimed"] = True
            aside = None
            if cfg.run.overwrite_output_dir and trains:
                aside = outputs.set_aside(out, is_main)
                if aside is not None:
                    print(
                        f"--overwrite_output_dir: the previous run's outputs are kept in "
                        f"{aside} until this run writes its first checkpoint or finishes",
                        flush=True,
                    )
            elif continuing and is_main:  # a resume of a replacing run that was killed
                kept = os.path.join(out, outputs.PREVIOUS_RUN)
                aside = kept if os.path.isdir(kept) else None
            if trains and is_main and (cut := remove_partial_saves(out)):
                print(
                    f"removed {plural(len(cut), 'checkpoint save')} cut off before completing "
                    f"in {os.path.join(out, 'checkpoints')}: {', '.join(cut)}",
                    flush=True,
                )
            try:
                state, history = _run_from(
                    t, cfg, state, start_step, step_fn, resume, continuing, run_meta, aside,
                    exports, eval_pending,
                )  # fmt: skip
            except BaseException as e:
                if is_main and _preempted_first_save(e, aside, out):
                    # The job is to go on from the step it reached, and the run it
                    # replaces may be wanted back (a mistaken overwrite stopped by a
                    # kill): both are kept.
                    line = outputs.kept_aside(aside, e.step)
                else:
                    line = outputs.settle(aside, out, good=False) if is_main else None
                if line is not None:
                    e.add_note(line)
                    print(line, file=sys.stderr, flush=True)
                raise
            line = outputs.settle(aside, out, good=True) if is_main else None
            if line is not None:
                print(line, flush=True)
    return {
        "losses": [h["loss"] for h in history if "loss" in h],
        "eval": [h for h in history if "eval_loss" in h],
        "history": history,
        "total_steps": t.total_steps,
        "start_step": start_step,
        "mesh": t.sizes,
        "config": t.config,
    }


def _preempted_first_save(error: BaseException, aside: str | None, out: str) -> bool:
    """Whether `error` is a preemption whose save is the only whole checkpoint of a run
    that set a previous run aside (`aside` still holds it)."""
    return (
        isinstance(error, Preempted)
        and error.saved
        and aside is not None
        and os.path.isdir(aside)
        and outputs.saved_steps(out) == [error.step]
    )


def _claim_under_lock(held: contextlib.ExitStack, out: str, claim, is_main: bool) -> None:
    """The main process takes `out`'s lock (held until `held` closes) and checks the
    claim again under it (a run may have written into `out` since the first check);
    every process learns the verdict, so that none goes on alone."""
    error = None
    if is_main:
        try:
            held.enter_context(outputs.claimed(out))
            claim()
        except TrainingError as e:
            error = e
    if jax.process_count() > 1:
        refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            raise TrainingError(
                f"--output_dir={out!r} was refused on process 0 (its output says why)"
            )
    if error is not None:
        raise error


def _run_from(
    t: Trainer,
    cfg: TrainConfig,
    state,
    start_step: int,
    step_fn,
    resume,
    continuing: bool,
    run_meta: dict,
    aside,
    exports: bool,
    eval_pending: bool = False,
):
    """`run` once the directory is claimed: settings, the loop, the export;
    `(final state, history)`. `cfg`: the run's settings as given (`t.cfg` has `auto`
    resolved). `aside`: where a previous run's outputs are kept (main process only; None
    elsewhere). `exports`: whether the HF export is written at the end. `eval_pending`:
    the checkpoint resumed from was saved with its step's evaluation cut short."""
    out = cfg.run.output_dir
    is_main = jax.process_index() == 0
    if continuing and is_main:
        outputs.drop_after(out, start_step)
    # A resume that finds its run done writes nothing: the settings file keeps the
    # run's own, and no empty TensorBoard file is added; but an evaluation of its last
    # step that a stop cut short (and no resume finished since) is run.
    trains = start_step < t.total_steps
    evaluates = (
        not trains
        and continuing  # (into another directory a finished run writes nothing)
        and eval_pending
        and t.eval_rows is not None
        and not outputs.logged_eval(out, start_step)
    )
    if is_main and trains:
        outputs.write_settings(out, cfg)
        if t.chat_templates is not None:
            outputs.write_chat_templates(out, t.chat_templates)
        outputs.write_tokenizer(out, cfg)
        outputs.write_model_config(out, models.to_hf_config(t.config))
        if resume is not None:
            print(f"resumed from step {start_step} of {resume[0]}", flush=True)
    if not trains and is_main:
        print(
            f"nothing to train: checkpoint {start_step} is already at the run's "
            f"{plural(t.total_steps, 'step')}"
            + (": evaluating it, which a stop cut short" if evaluates else "")
            + ("" if continuing else f"; nothing is written into {out}"),
            file=sys.stderr,
        )
    history = []
    if trains or evaluates:
        state, history = _train(
            t, state, start_step, step_fn, is_main, run_meta, aside, eval_pending
        )
    if exports:
        hf_dir = outputs.hf_dir(out)
        if not trains and is_main:
            print(
                f"checkpoint {start_step} has no HF export (the run stopped after saving "
                f"it): writing {hf_dir}",
                flush=True,
            )
        # One process: the params as they are, taken to the host a tensor at a time as
        # the export writes them; several: gathered whole onto every host first.
        params = state["params"]
        if jax.process_count() > 1:
            params = multihost_utils.process_allgather(params, tiled=True)
        if is_main:
            # The tokenizer first (the run's copy of it, where it has one): the
            # export's config.json, renamed into place last, then marks a whole
            # export (`outputs.has_export`).
            os.makedirs(hf_dir, exist_ok=True)
            export_cfg, tokenizer = outputs.with_run_tokenizer(cfg, out)
            config = export_config(export_cfg, t.config)
            eos = config.eos_token_id
            outputs.copy_tokenizer(tokenizer, hf_dir, t.chat_templates, eos_token_id=eos)
            models.export_hf(params, config, hf_dir)
    return state, history


def _export_missing(out: str, is_main: bool) -> bool:
    """Whether `out` lacks a whole HF export, as process 0 sees it (every process
    takes part in an export)."""
    missing = is_main and not outputs.has_export(out)
    if jax.process_count() > 1:
        missing = bool(multihost_utils.broadcast_one_to_all(np.int32(missing)))
    return missing


def _say_what_is_made_up(cfg: TrainConfig) -> None:
    """One line each where the run trains a randomly initialised preset or generated
    data: neither is what a user's own model or dataset would be."""
    name = cfg.model.model_name_or_path
    if not os.path.isdir(name):
        print(
            f"--model_name_or_path {name}: the preset's shape, randomly initialised "
            "(no weights loaded; a local HF directory loads its weights)",
            flush=True,
        )
    paths = {"--data_path": cfg.data.data_path, "--eval_data_path": cfg.data.eval_data_path}
    for flag, path in paths.items():
        if path and is_sample_data(path):
            print(f"{flag} sample: generated Markov-chain data, not a dataset", flush=True)


def _plan(t: Trainer) -> str:
    """The run in one line, as HF's "Running training" block gives it: the rows, a
    step's rows and tokens and what multiplies into them, the steps and epochs, the
    model's size and the mesh."""
    cfg, seq = t.cfg, t.cfg.data.model_max_length
    rows, per_step = t.rows.num_rows, t.global_batch * t.accum
    epoch = t.batches.steps_per_epoch
    params = sum(x.size for x in jax.tree.leaves(t.state["params"]))
    mesh = ",".join(f"{a}={n}" for a, n in t.sizes.items())
    factors = (
        f"per-device batch {cfg.run.per_device_train_batch_size} x data {t.sizes['data']} "
        f"x fsdp {t.sizes['fsdp']} x accumulation {t.accum}"
    )
    epochs = f"{t.total_steps / epoch:.3g}"
    epochs += " epoch" if epochs == "1" else " epochs"
    used = t.batches.rows_per_epoch  # drop_last: the whole micro-batches' rows
    parts = []
    if used < rows:
        parts.append(f"the last {plural(rows - used, 'row')} of each epoch dropped")
    if used % per_step:
        parts.append(f"the last filled up with {plural(-used % per_step, 'empty row')}")
    last = "".join(f", {p}" for p in parts)
    return (
        f"plan: {plural(rows, 'row', grouped=True)} of {plural(seq, 'token', grouped=True)}; "
        f"{plural(t.total_steps, 'step', grouped=True)} ({epochs}, "
        f"{plural(epoch, 'step', grouped=True)} each{last}), each "
        f"{plural(per_step, 'row', grouped=True)} = "
        f"{plural(per_step * seq, 'token', grouped=True)} ({factors}); "
        f"{params / 1e6:,.1f}M parameters; mesh {mesh}"
    )


def _intervals(t: Trainer) -> str | None:
    """The intervals given as a fraction of the run (HF's form), in steps, or None."""
    run = t.cfg.run
    given = [n for n in STEP_COUNTS if 0 < getattr(run, n) < 1]
    parts = [
        f"--{n} {getattr(run, n)}: every {plural(run.every(n, t.total_steps), 'step')}"
        for n in given
    ]
    return f"of the run's {t.total_steps} steps, " + "; ".join(parts) if parts else None


def _say_what_the_mesh_leaves_unused(t: Trainer) -> None:
    """One line each for settings the mesh or the attention gives nothing to do:
    `--ring_strategy` other than the ring and `--ring_layout` where the sequence is not
    split, `--attention_implementation` with XLA's or cuDNN's attention,
    `--ring_strategy hybrid` without a `seq_a2a` axis (it runs the ring alone),
    `--shard_over_seq` (with `--gather_once`) where the sequence is not split, an
    offloading `--remat_policy` on the CPU backend (one memory space: nothing moves),
    and an `--mlp_tile` as long as a device's share of a row or longer."""
    seq, a2a = t.sizes["seq"], t.sizes["seq_a2a"]
    model = t.cfg.model
    if seq * a2a == 1:  # no sequence split: the strategies and layouts have no work
        given = [
            f"--{name} {value}"
            for name, value, default in (
                ("ring_strategy", model.ring_strategy, ("auto", "ring")),
                ("ring_layout", model.ring_layout, ("zigzag",)),
            )
            if value not in default
        ]
        if given:
            print(
                f"{' and '.join(given)}: the mesh does not split the sequence (seq=1, "
                f"seq_a2a=1), so {'they have' if len(given) > 1 else 'it has'} no effect; "
                "give seq=2 or more to split it",
                flush=True,
            )
    if model.attention_implementation is not None and model.attention in ("xla", "cudnn"):
        print(
            f"--attention_implementation {model.attention_implementation}: --attention "
            f"{model.attention} runs {'XLA' if model.attention == 'xla' else 'cuDNN'}'s own "
            "attention, not jflash's kernels, so it has no effect (--attention ring or jflash "
            "take it)",
            flush=True,
        )
    if model.ring_strategy == "hybrid" and a2a == 1 and seq > 1:
        print(
            f"--ring_strategy hybrid: the mesh has no seq_a2a axis (seq_a2a=1), so it runs "
            f"the ring alone over seq={seq}; give seq_a2a=2 or more for its all-to-all",
            flush=True,
        )
    if t.cfg.parallel.shard_over_seq and seq * a2a == 1:
        print(
            "--shard_over_seq: the mesh does not split the sequence (seq=1, seq_a2a=1), so "
            "the parameters are sharded over fsdp alone",
            flush=True,
        )
    remat = t.cfg.remat
    if remat.startswith("offload") and t.mesh.devices.flat[0].platform == "cpu":
        on_device = {"offload_attn": "save_attn", "offload_full": "full"}[remat]
        print(
            f"--remat_policy {remat}: the cpu backend has one memory space, so XLA keeps "
            f"the residuals it would offload on the device: it runs as {on_device} here "
            "(offload on a GPU)",
            flush=True,
        )
    if (tile := t.cfg.model.mlp_tile) > 0:
        share = t.cfg.data.model_max_length // t.spec.attention.seq_shards
        if t.config.mlp_tile_for(share) == 0:
            print(
                f"--mlp_tile {tile}: a device holds {share} tokens of a row, one tile at "
                "most, so the MLP runs whole (no memory saved); give a divisor of it to tile",
                flush=True,
            )


def _say_where_positions_run_past(t: Trainer) -> None:
    """One line where the rows' RoPE positions reach past the model's
    `max_position_embeddings` (its pre-training context): allowed, since that is how a
    context is extended by training, but a user extending Llama-2's 4k should know; and
    one with the RoPE that `--rope_theta` / `--rope_scaling` set."""
    rope, given = t.config.rope, t.cfg.model
    if given.rope_theta is not None or given.rope_scaling:
        pairs = (("--rope_theta", given.rope_theta), ("--rope_scaling", given.rope_scaling))
        flags = " and ".join(flag for flag, value in pairs if value)
        factor = f" (factor {rope.factor:g})" if rope.type != "default" else ""
        print(
            f"{flags}: RoPE {rope.type}{factor}, theta {rope.theta:g}, for this run and its export",
            flush=True,
        )
    longest = t.cfg.data.model_max_length
    limit = t.config.max_position_embeddings
    if longest <= limit:
        return
    restart = t.spec.mask_documents and t.cfg.data.packing_positions == "per_document"
    print(
        f"--model_max_length {longest}: positions up to {longest - 1}"
        + (" (in documents that long)" if restart else "")
        + f" run past the model's max_position_embeddings {limit} (RoPE {rope.type}, "
        f"theta {rope.theta:g}): the run extends its context by training; --rope_theta "
        "and --rope_scaling change how",
        flush=True,
    )


def use_compilation_cache(folder: str) -> None:
    """jax's persistent compilation cache in `folder`, for this process from now on
    (`--compilation_cache_dir`): jax opens its cache once, at the first compilation, so
    a later run in the same process that names another folder reopens it there."""
    if jax.config.jax_compilation_cache_dir != folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        compilation_cache.reset_cache()


def _initial_state(t: Trainer, resume, continuing: bool, run_meta: dict) -> tuple[dict, int, bool]:
    """`(state, first step, evaluation pending)`: the built state, or a checkpoint's
    (read, never written), restored into `t.state`'s abstract form (`build(...,
    restoring=True)`); whether a SIGTERM cut that step's evaluation short."""
    if resume is None:
        return t.state, 0, False
    cfg = t.cfg
    if continuing:
        source = Checkpoints(cfg.run.output_dir, None, read_only=True)
    else:
        source = Checkpoints(resume[0], None, read_only=True)
    try:
        step = resume[1] if resume[1] is not None else source.latest_step()
        if step is None:
            kept = os.path.join(resume[0], outputs.PREVIOUS_RUN)
            also = (
                f"; the run it was replacing is kept in {kept} (--overwrite_output_dir true "
                "replaces both, or move its contents back)"
                if os.path.isdir(kept)
                else ""
            )
            raise TrainingError(
                f"--resume_from_checkpoint: no checkpoint in {source.directory}{also}"
            )
        later = [s for s in source.all_steps() if s > step]
        if continuing and later:
            raise TrainingError(
                f"--resume_from_checkpoint: {source.directory} also holds later "
                f"checkpoints {later}, which training on from {step} here would collide "
                f"with; resume into another --output_dir"
            )
        # What wrote the checkpoint is checked before its state is read: another
        # optimizer's state has another structure, which restoring would only fail on.
        saved = source.meta(step)
        if saved is not None:
            check_resumable(saved, run_meta, source.directory)
        check_model(source.param_shapes(step), t.state["params"], step, cfg, source.directory)
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            t.state,
            t.state_shardings,
        )
        state, meta = source.restore(step, abstract)
    finally:
        source.close()
    start_step = int(meta["step"])
    extended = check_resumable(meta, run_meta, source.directory)
    if jax.process_index() == 0 and extended:
        print(extended, flush=True)
    if jax.process_index() == 0:
        warnings = (eval_data_warning, drop_last_warning, update_warning)
        for line in (warning(meta, run_meta) for warning in warnings):
            if line:
                print(line, flush=True)
    # The saved data position must land on the same step with this data/batch.
    resumed = t.batches.starting_at(meta["data"])
    if resumed.step != start_step:
        # A checkpoint whose record has no `dataloader_drop_last` was written when every
        # epoch dropped its partial last batch: the flag's way now without accumulation.
        older = "dataloader_drop_last" not in (meta.get("run") or {})
        hint = (
            " (a checkpoint written when each epoch dropped its last partial batch resumes "
            "with --dataloader_drop_last true)"
            if older and not cfg.data.dataloader_drop_last and t.accum == 1
            else ""
        )
        raise TrainingError(
            f"checkpoint step {start_step} and data position {meta['data']} disagree: "
            "did the data, --model_max_length, the batch size or --dataloader_drop_last "
            f"change?{hint}"
        )
    return state, start_step, bool(meta.get(EVAL_PENDING))


class _Preemption:
    """How the loop learns that a SIGTERM (a scheduler preempting the job) asks it to
    stop, and at which step. Where jax's preemption service runs
    (`outputs.preemption_service`: `jax.distributed.initialize` started it, as every
    multi-process run does), every process calls `reached_preemption_sync_point` once per
    step, and it answers True on all of them at the same step, after a SIGTERM to any;
    without it (one process), this class's own SIGTERM handler notes the signal, while
    the loop runs (`watching`), and the loop stops after the step in flight.

    `save`: the step reached is saved (`--save_on_preemption`, and a `--save_strategy`
    other than `no`). In one process without it, SIGTERM keeps its handler from
    `train.__main__` (the run stops at once, naming its last checkpoint)."""

    def __init__(self, cfg: TrainConfig):
        self.sync = outputs.preemption_service()
        self.save = cfg.run.save_on_preemption and cfg.run.save_strategy != "no"
        self.why = (
            "--save_strategy no" if cfg.run.save_strategy == "no" else "--save_on_preemption false"
        )
        self.noted = False  # this process's own handler saw a SIGTERM (or SIGHUP)
        self.at: float | None = None  # when (time.monotonic()); None: not seen here
        self.signum = signal.SIGTERM  # which
        self.arrived: float | None = None  # when a stop signal arrived (`_timing_arrivals`)
        self.watched = frozenset()  # the signals `_note` handles (`watching`)

    @contextlib.contextmanager
    def watching(self):
        """SIGTERM, and SIGHUP (a terminal closed) unless ignored (`nohup`), noted while
        the loop runs, in one process without jax's preemption service."""
        own = not self.sync and self.save and threading.current_thread() is threading.main_thread()
        signums = [
            s for s in STOP_SIGNALS if own and signal.getsignal(s) not in (signal.SIG_IGN, None)
        ]
        previous = {s: signal.signal(s, self._note) for s in signums}
        self.watched = frozenset(previous)
        arrivals = self._timing_arrivals() if signums else contextlib.nullcontext()
        try:
            with arrivals:
                yield
        finally:
            self.watched = frozenset()
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextlib.contextmanager
    def _timing_arrivals(self):
        """Times each stop signal as it arrives (`arrived`): Python runs a handler only
        between bytecodes, which can be seconds later where the main thread waits in C
        (a save waiting for the one before it). The signal's number goes to a socket
        (`signal.set_wakeup_fd`) that a thread reads at once."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        try:
            before = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread after all: handlers' times only
            reader.close()
            writer.close()
            yield
            return

        def read():
            while data := reader.recv(64):
                if self.arrived is None and any(b in STOP_SIGNALS for b in data):
                    self.arrived = time.monotonic()

        thread = threading.Thread(target=read, name="jflash-signal-times", daemon=True)
        thread.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(before)
            writer.close()  # the reader sees the end
            thread.join(timeout=5)
            reader.close()

    def _note(self, signum, frame) -> None:
        if not self.noted:
            now = time.monotonic()
            self.at = min(now, self.arrived) if self.arrived is not None else now
            self.signum = signum
            if signum == signal.SIGHUP:
                _leave_the_terminal()
        self.noted = True

    def unwatched(self) -> tuple:
        """The signals a save holds until it is issued (`outputs.signals_held`): Ctrl-C,
        and the stop signals this class does not note itself (they would cut it off)."""
        return (signal.SIGINT, *(s for s in outputs.stop_signals() if s not in self.watched))

    def reached(self, done: int) -> bool:
        """Called once per step on every process, after step `done` is dispatched."""
        if self.sync:
            return bool(multihost_utils.reached_preemption_sync_point(done))
        return self.noted


def _keeps_last_save(preemption: _Preemption, last_saved: int | None) -> bool:
    """Whether a stop asked in one process (its own handler noted it: saving, no jax
    preemption service) keeps the last save issued (`last_saved`), whether or not it is
    whole yet, instead of saving a later step (several processes would each see their
    own save's progress, and must agree on the step)."""
    return preemption.noted and last_saved is not None


def _wait_for_last_save(
    ckpt, preemption: _Preemption, done: int, kept: int, save_began: float | None
) -> _StopTimes:
    """The stop at step `done` that keeps the save of step `kept`: waited for, timed
    (`save_began`: where step `done`'s save call began, if the stop was noted in it)."""
    with outputs.signals_held(reraise=False):
        stop = _StopTimes(done, preemption.at, kept=kept, step_ended=save_began)
        ckpt.wait()
        stop.lap("save_s")
    return stop


def _leave_the_terminal() -> None:
    """After SIGHUP (the terminal closed): a write to it fails (EIO), which would stop
    the run before its save, so stdout and stderr where they are a terminal go to
    /dev/null from here on (log.jsonl and TensorBoard keep the metrics)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if os.isatty(fd):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


# A checkpoint's record of a step whose evaluation a SIGTERM cut short: its resume
# evaluates first (the parameters are that step's).
EVAL_PENDING = "eval_pending"

# How long the save in flight may still take when the loop of a multi-process run ends
# on an unexpected error, most often the collective a stopped process left: the save
# commits at a barrier of every process, which a stopped one holds until jax's
# heartbeat timeout aborts the others (100 s, with a C++ stack) instead of their line.
SAVE_WAIT_AFTER_ERROR_S = 20.0


def _save_wait_s(error: BaseException | None) -> float | None:
    """How long the loop's `Checkpoints.close` may wait for the save in flight as it ends
    on `error` (None: until the save is done). Bounded only where `python -m train` then
    ends the process at once (`os._exit`): an error of a multi-process run other than a
    stop (Ctrl-C, SIGTERM) or the run's own (`USER_ERRORS`), whose processes stop
    alike and exit as usual."""
    if error is None or from_interrupt(error) is not None or jax.process_count() == 1:
        return None
    if isinstance(error, USER_ERRORS):
        return None
    return SAVE_WAIT_AFTER_ERROR_S


def _train(
    t: Trainer,
    state,
    start_step: int,
    step_fn,
    is_main: bool,
    run_meta: dict,
    aside,
    eval_pending: bool = False,
):
    """The loop from `start_step` to `t.total_steps`: `(final state, logged history)`.
    `aside`: a previous run's outputs (`outputs.set_aside`), deleted once this run has
    a whole checkpoint. `eval_pending`: evaluate before the first step (the step
    resumed from had its evaluation cut short)."""
    cfg, out, total_steps = t.cfg, t.cfg.run.output_dir, t.total_steps
    # --save_strategy no: no checkpoints directory either.
    ckpt = Checkpoints(out, cfg.run.save_total_limit) if cfg.run.save_strategy != "no" else None
    writer = reporters.open_reporters(cfg) if is_main else None
    log = JsonlLog(os.path.join(out, "log.jsonl")) if is_main else None
    profile = _profile_steps(cfg, start_step, total_steps, is_main)
    if profile and is_main and jax.default_backend() == "gpu" and command_buffers_on():
        print(
            "warning: --profile_steps with XLA's command buffers on: the trace's kernels "
            f"will carry no op names or name scopes; set XLA_FLAGS={NO_COMMAND_BUFFERS} "
            "before starting for a trace that names them",
            file=sys.stderr,
            flush=True,
        )
    bar = _progress(cfg, is_main, start_step, total_steps)
    lines = _step_lines(bar)
    history = []
    step_tokens = t.global_batch * t.accum * cfg.data.model_max_length
    timer = _Timer(profile=profile, step_tokens=step_tokens)
    finish_args = (cfg, timer, t.step_flops_token, writer, log, bar, lines, total_steps)
    steps_per_epoch = t.batches.steps_per_epoch
    # Metrics are fetched one step late (the next step is already queued), except at
    # the run's first step and at logging and saving steps, which wait for their own
    # step: throughput windows then start and end at completed steps, before the next
    # step is queued (queueing a step can take the host longer than the GPU takes to
    # finish the one before, with XLA's command buffers off), and nothing non-finite is
    # saved.
    pending = None
    tracing = False
    on_cpu = jax.default_backend() == "cpu"
    trace_dir = cfg.profile.profile_dir or os.path.join(out, "tensorboard")
    finished = False
    saved_any = False  # no checkpoint to look for before the first save is issued
    last_saved = None  # the step of the last save issued
    preemption = _Preemption(cfg)
    stop = None  # a preemption's save, timed (`_StopTimes`)
    watch = contextlib.ExitStack()  # SIGTERM's handler while the loop runs
    cut_short = False  # a SIGTERM left this step's evaluation unfinished
    try:
        if t.eval_rows is not None and cfg.run.eval_on_start and start_step == 0:
            # The loss to beat (a resume's log holds it already), before SIGTERM's
            # handler of the loop: a SIGTERM during it stops the run as one before the
            # first step does, and its restart evaluates again.
            history.append(_evaluate(t, state["params"], start_step, writer, log, bar))
        watch.enter_context(preemption.watching())
        if t.eval_rows is not None and eval_pending:
            record = _evaluate(t, state["params"], start_step, writer, log, bar, preemption)
            history += [record] if record is not None else []
        for step in range(start_step, total_steps):
            if profile and step == profile[0]:
                jax.block_until_ready(state)
                began = time.perf_counter()
                jax.profiler.start_trace(trace_dir)
                tracing = True
                timer.leave_out(began)  # the profiler's time, not a step's
            # The trace numbers steps as the step lines do (from 1).
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                with _oom_advice(cfg):
                    state, metrics = step_fn(state, t.batch(step))
                if tracing and on_cpu:
                    # Nothing in a CPU trace ties a run to the call that dispatched it:
                    # it is the step's whose annotation it began in, so it ends inside.
                    jax.block_until_ready(state)
            if tracing and step == profile[1] - 1:
                jax.block_until_ready(state)
                tracing = False  # stopped once, even where writing the trace fails
                began = time.perf_counter()
                jax.profiler.stop_trace()  # writes the trace: seconds, not the steps'
                timer.leave_out(began)
                if is_main:
                    print(
                        f"--profile_steps: traced steps {profile[0] + 1}..{profile[1]} (as the "
                        f"step lines count) into {trace_dir} (tensorboard --logdir {trace_dir}; "
                        "tensorboard and its profile plugin: pip install 'jflash[xprof]')",
                        flush=True,
                    )
            if pending is not None:
                history.append(_finish(pending, *finish_args))
                pending = None
            done = step + 1
            # SIGTERM: the step just dispatched is the last; it is saved as a save step is.
            preempted = preemption.reached(done)
            save = _should_save(cfg, done, total_steps, steps_per_epoch)
            first = step == start_step  # the throughput window starts at its end
            if first or save or preempted or _logs(cfg, done, total_steps):
                history.append(_finish((step, metrics), *finish_args))
            else:
                pending = (step, metrics)
            if t.eval_rows is not None and _should_eval(cfg, done, total_steps, steps_per_epoch):
                if pending is not None:  # the step's own record goes first
                    history.append(_finish(pending, *finish_args))
                    pending = None
                began = time.perf_counter()
                record = _evaluate(t, state["params"], done, writer, log, bar, preemption)
                history += [record] if record is not None else []
                cut_short = record is None
                # Training speed: the window leaves an evaluation's (and a save's) time out.
                timer.leave_out(began)
            if not preempted and not preemption.sync and preemption.noted:
                # It came during the step's metrics or evaluation: this step is the last.
                preempted = True
                if pending is not None:
                    history.append(_finish(pending, *finish_args))
                    pending = None

            # (One process) A stop asked while the last save may still be written keeps
            # that save: the run waits for it and stops there rather than write another
            # after it; the steps after it are trained again at the resume.
            keeps = functools.partial(_keeps_last_save, preemption, last_saved)
            save_began = None  # a stop noted after this is the save's time, not the step's
            kept = last_saved if preempted and not save and keeps() and ckpt.saving() else None
            if kept is None and (save or (preempted and preemption.save)):
                epoch, index = divmod(done, steps_per_epoch)
                data_pos = {"epoch": epoch, "index": index}
                began = time.perf_counter()
                # A save is never cut off by Ctrl-C; a preemption's is waited for on
                # disk, and a second SIGTERM or Ctrl-C meanwhile is dropped (the run is
                # stopping already). The signals this loop only notes are not held: a
                # stop asked while the save waits for the one before it keeps that one.
                held = outputs.signals_held(reraise=not preempted, signals=preemption.unwatched())
                with held:
                    meta = {"step": done, "data": data_pos, "run": run_meta}
                    if preempted:  # the stop's timing: the save in flight apart
                        stop = _StopTimes(done, preemption.at)
                        ckpt.wait()
                        stop.lap("in_flight_save_s")
                    save_began = time.monotonic()
                    issued = ckpt.save(
                        done,
                        state,
                        meta | ({EVAL_PENDING: True} if cut_short else {}),
                        unless=None if preempted else keeps,
                    )
                    if preempted:
                        ckpt.wait()
                        stop.lap("save_s")
                if issued:
                    last_saved, saved_any = done, True
                    if writer is not None:  # what a resume from here keeps is on disk
                        writer.flush()
                    if not preempted and _keeps_last_save(preemption, done):
                        kept = done  # the stop came just as this save was issued
                else:  # the stop came while this save waited for the last one
                    kept = last_saved
                timer.leave_out(began)
            if kept is not None:
                stop = _wait_for_last_save(ckpt, preemption, done, kept, save_began)
                raise Preempted(
                    kept, os.path.join(out, "checkpoints"), True, preemption.why, preemption.signum
                )
            if preempted:
                saved = save or preemption.save
                raise Preempted(
                    done, os.path.join(out, "checkpoints"), saved, preemption.why, preemption.signum
                )
            # Saves are asynchronous: the first whole checkpoint shows up steps later.
            if aside is not None and saved_any and outputs.saved_steps(out):
                line = outputs.settle(aside, out, good=True)
                aside = None
                if line is not None:
                    bar.write(line) if bar is not None else print(line, flush=True)
        finished = True
    finally:
        watch.close()  # SIGTERM as before the loop (the run stops at once)
        # A Ctrl-C here waits: the save in flight finishes and the logs are closed.
        with outputs.signals_held(reraise=finished):
            if tracing:  # stopped early (a signal, an error): keep what was traced
                jax.profiler.stop_trace()
                if is_main:
                    print(
                        f"--profile_steps: the run stopped in the window: traced steps "
                        f"{profile[0] + 1}..{step + 1} into {trace_dir}",
                        flush=True,
                    )
            if ckpt is not None:
                wait_s = _save_wait_s(sys.exc_info()[1])
                if not ckpt.close(wait_s):
                    print(
                        f"the save in flight did not commit within {wait_s:.0f} s of the "
                        "error (it waits for every process): left unfinished",
                        file=sys.stderr,
                        flush=True,
                    )
            stopped = stop is not None and "save_s" in stop.times  # saved whole
            if stopped:
                stop.lap("close_s")
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
            if stopped and is_main:
                print(stop.line(signal.Signals(preemption.signum).name), flush=True)
            if log is not None:
                log.close()
    return state, history


class _StopTimes:
    """A preemption's stop, timed for whoever sizes the grace period a scheduler gives
    between its SIGTERM and its kill: from the signal (where this process's own handler
    saw it: `at`) to the end of the step in flight, the wait for a save already in
    flight, this step's save, and closing the checkpoints (a dropped checkpoint's
    deletion included), in one line (`line()`)."""

    def __init__(
        self, step: int, at: float | None, kept: int | None = None, step_ended: float | None = None
    ):
        self.step, self.at, self.kept = step, at, kept  # kept: a save in flight, kept
        # step_ended: where the step's work ended and a save's began (default: now); a
        # signal after it started the save's part, not the step's.
        now = time.monotonic()
        ended = now if step_ended is None else step_ended
        self._last = ended if at is None else max(at, ended)
        self.times = {} if at is None else {"signal_to_step_end_s": max(0.0, ended - at)}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.times[name], self._last = now - self._last, now

    def line(self, name: str = "SIGTERM") -> str:
        """`SIGTERM at step N: saved 19.8 s after the signal (the step's end 1.0 s, the
        save in flight 8.8 s, step N's save 10.0 s); closing took 3.6 s more`: the
        checkpoint is whole on disk at "saved", so a kill while closing loses nothing."""
        t = self.times
        names = {
            "signal_to_step_end_s": "the step's end",
            "in_flight_save_s": "the save in flight",
            "save_s": f"step {self.step if self.kept is None else self.kept}'s save",
        }
        parts = ", ".join(f"{what} {t[key]:.1f} s" for key, what in names.items() if key in t)
        saved = sum(t[key] for key in names if key in t)
        took = (
            f"saved in {saved:.1f} s"
            if self.at is None
            else f"saved {saved:.1f} s after the signal"
        )
        close = t["close_s"]
        line = f"{name} at step {self.step}: {took} ({parts}); closing took {close:.1f} s more"
        if self.kept is not None and self.kept != self.step:
            line += (
                f"; step {self.kept}'s save, still being written when the signal came, is "
                f"the one kept (the steps after it are trained again at the resume)"
            )
        return line


def _profile_steps(cfg: TrainConfig, start_step: int, total_steps: int, is_main: bool):
    """`--profile_steps` as the steps this run traces, `(first, stop)` in the loop's
    0-based numbering, or None: the part of the window that this run's steps (from a
    resume's step to the last) cover, with a warning where that is less than asked."""
    window = profile_window(cfg)
    if window is None:
        return None
    first, stop = max(window[0], start_step), min(window[1], total_steps)
    if first >= stop:
        if is_main:
            where = f"this run's steps {start_step + 1}..{total_steps}"
            print(
                f"warning: --profile_steps={cfg.profile.profile_steps!r} lies outside {where} "
                "(as the step lines count, from 1); nothing will be traced",
                file=sys.stderr,
                flush=True,
            )
        return None
    if (first, stop) != window and is_main:
        print(
            f"warning: --profile_steps={cfg.profile.profile_steps!r}: this run's steps are "
            f"{start_step + 1}..{total_steps}; tracing steps {first + 1}..{stop} of the window",
            file=sys.stderr,
            flush=True,
        )
    return first, stop


def _should_eval(cfg: TrainConfig, done: int, total: int, steps_per_epoch: int) -> bool:
    if done == total:
        return True
    if cfg.run.eval_strategy == "epoch":
        return done % steps_per_epoch == 0
    return done % cfg.run.every("eval_steps", total) == 0


def _evaluate(
    t: Trainer, params, done: int, writer, log, bar, preemption: _Preemption | None = None
) -> dict | None:
    """The mean token loss and perplexity over all evaluation rows (sums over batches,
    one division), logged like the training metrics. None where a SIGTERM that this
    process's own handler noted (one process) came during it: the evaluation is left
    unfinished and unlogged, so that the save of the step reached is not held up by it
    (a preemption's grace period can be shorter than an evaluation)."""
    start, sums, pending = time.perf_counter(), [], collections.deque()
    stopping = preemption is not None and not preemption.sync and preemption.save
    # Named in a trace (a --profile_steps window may hold an evaluation): the trace tool
    # leaves what runs inside it out of the training steps.
    with jax.profiler.TraceAnnotation("eval"), _oom_advice(t.cfg):
        # Fetched two batches late: the host prepares the next batch while the device
        # evaluates one (a fetch per batch waited for each), and at most three batches
        # are on the device at once.
        for batch in t.eval_batches():
            if stopping and preemption.noted:
                jax.block_until_ready(list(pending))
                if jax.process_index() == 0:
                    name = signal.Signals(preemption.signum).name
                    line = f"{name} during the evaluation at step {done}: left unfinished"
                    bar.write(line) if bar is not None else print(line, flush=True)
                return None
            pending.append(t.eval_fn(params, batch))
            if len(pending) > 2:
                sums.append(jax.device_get(pending.popleft()))
        sums += jax.device_get(list(pending))
    total = math.fsum(float(loss_sum) for loss_sum, _ in sums)
    count = sum(int(n) for _, n in sums)
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
        "eval_runtime": time.perf_counter() - start,  # seconds, as HF's
    }
    if writer is not None:
        writer.scalars({f"eval/{k[5:]}": v for k, v in record.items() if k != "step"}, done)
    if log is not None:
        log.write(record)
    if jax.process_index() == 0 and t.cfg.run.progress:
        line = f"eval at step {done}: loss {loss:.4f}, perplexity {record['eval_perplexity']:.4g}"
        bar.write(line) if bar is not None else print(line, flush=True)
    return record


def _progress(cfg, is_main, start, total):
    if not (is_main and cfg.run.progress):
        return None
    from tqdm.auto import tqdm

    # disable=None: tqdm turns itself off when stderr is not a terminal (CI logs, pipes).
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, disable=None)


def _step_lines(bar) -> bool:
    """Whether the run prints one line per logging step on stdout: where progress is
    shown (`bar`, from `_progress`, is not None) and stdout is not a terminal (a log
    file, a batch job), or no bar is drawn (stderr is not a terminal: `2>file`)."""
    return bar is not None and (not sys.stdout.isatty() or bool(bar.disable))


def _should_save(cfg: TrainConfig, done: int, total: int, steps_per_epoch: int) -> bool:
    if cfg.run.save_strategy == "no":
        return False
    if cfg.run.save_strategy == "epoch":
        return done % steps_per_epoch == 0 or done == total
    return done % cfg.run.every("save_steps", total) == 0 or done == total


def _oom_error(cfg: TrainConfig, error: BaseException) -> TrainingError:
    offloads = cfg.remat.startswith("offload") or cfg.optim.optimizer_offload
    if offloads and "host" in str(error).lower():
        return TrainingError(
            "out of pinned host memory (--remat_policy "
            f"{cfg.remat!r}, --optimizer_offload "
            f"{cfg.optim.optimizer_offload}): XLA's pinned host pool is capped by "
            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (default 64); raise it below the machine's "
            "RAM, or offload less (offload_full keeps only each layer's input). "
            "`python -m train.tools.capacity` shows the host memory a step needs"
        )
    return TrainingError(
        f"out of device memory{_allocator_advice(error)}. Turn one of: "
        "--per_device_train_batch_size (now "
        f"{cfg.run.per_device_train_batch_size}), --model_max_length (now "
        f"{cfg.data.model_max_length}), a larger seq or fsdp axis in --mesh (now "
        f"{cfg.parallel.mesh!r}), --remat_policy save_attn or full (now {cfg.remat!r}; "
        "memory: none > save_dots > save_attn > full; offload_attn and offload_full keep "
        "their residuals in host memory), --mlp_tile, --optimizer_offload; "
        "on GPUs XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) gives XLA more of the "
        "device. `python -m train.tools.capacity` finds what fits without running"
    )


def _allocator_advice(error: BaseException) -> str:
    """`train.oom.allocator_hint` for the first device, where it reports its memory (and
    the allocator is not already CUDA's pool)."""
    if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "") in ("cuda_async", "platform"):
        return ""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - no statistics on this backend: no advice
        stats = {}
    return allocator_hint(
        failed_allocation_bytes(error), stats.get("bytes_limit"), stats.get("bytes_in_use")
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
            raise _oom_error(cfg, e) from e
        raise


def _step_line(record: dict, total_steps: int, eta: float | None, traced: bool = False) -> str:
    """`step 20/100: loss 4.1234, lr 3.000e-03, 51,234 tokens/s, ETA 0:02:10`; the first
    window (the compilation's step only) has no speed or ETA; a window that holds
    `--profile_steps` says its speed is the profiler's too."""
    parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
    if "tokens_per_s" in record:
        note = " (traced steps in this window: slower under the profiler)" if traced else ""
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s{note}")
    if eta is not None:
        parts.append(f"ETA {datetime.timedelta(seconds=round(eta))}")
    return f"step {record['step']}/{total_steps}: " + ", ".join(parts)


def _logs(cfg: TrainConfig, done: int, total_steps: int) -> bool:
    """Whether step `done` (from 1) logs its metrics: every `--logging_steps`, the last,
    and the first with `--logging_first_step`."""
    every = cfg.run.every("logging_steps", total_steps)
    return done % every == 0 or done == total_steps or (cfg.run.logging_first_step and done == 1)


def _finish(
    pending, cfg, timer: _Timer, flops_of, writer, log, bar, lines: bool, total_steps
) -> dict:
    """Fetches one step's metrics; stops on a non-finite loss or gradient (the update of
    a non-finite gradient makes the parameters non-finite); logs every logging_steps
    and the last step."""
    step, metrics = pending
    with _oom_advice(cfg):
        metrics = jax.device_get(metrics)
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        # The first step's gradient is the initial weights' on the first batch: no update,
        # so no learning rate, has acted yet.
        advice = (
            "It came before any update, so not from the learning rate: check the data and "
            "the model's weights, and rerun with --attention_implementation xla to rule out "
            "the attention kernel."
            if step == 0
            else "Lower --learning_rate or check the data."
        )
        values = (("loss", loss), ("gradient norm", grad_norm))
        bad = " and ".join(f"{name} {x}" for name, x in values if not math.isfinite(x))
        raise TrainingError(
            f"non-finite {bad} at step {step + 1}; "
            "training stopped. No checkpoint was written for this step or later ones (those "
            f"of earlier steps, if any, are intact). {advice}"
        )
    done = step + 1
    if timer.profile and timer.profile[0] <= step < timer.profile[1]:
        timer.traced = True
    # The run's first step (compiled before) runs its one-time work (CUDA modules loaded,
    # command buffers recorded): throughput starts after it.
    flops_token = flops_of(step)  # the step's model FLOPs per token (`Trainer`)
    if timer.start == 0.0:
        timer.start = time.perf_counter()
    else:
        timer.tokens += timer.step_tokens
        timer.flops += timer.step_tokens * flops_token
        timer.steps += 1
    record = {
        "step": done,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": float(metrics["lr"]),
        # The tokens the step's loss averages over (labels not -100), of its step_tokens.
        "labelled_tokens": int(metrics["tokens"]),
    }
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    if _logs(cfg, done, total_steps):
        now = time.perf_counter()
        if timer.tokens:  # the window holds timed steps (the first one is compilation)
            seconds = now - timer.start
            flops = timer.flops / timer.tokens
            record.update(throughput(timer.tokens, seconds, flops, jax.device_count()))
            record["step_s"] = seconds / timer.steps
        record.update(memory())
        if lines:
            eta = (now - timer.start) / timer.steps * (total_steps - done) if timer.steps else None
            print(_step_line(record, total_steps, eta, timer.traced), flush=True)
        timer.start, timer.tokens, timer.flops, timer.steps = now, 0, 0.0, 0
        timer.traced = False
        if writer is not None:
            tags = {f"train/{HF_TAGS.get(k, k)}": v for k, v in record.items() if k != "step"}
            writer.scalars(tags, done)
        if log is not None:
            log.write(record)
    return record
