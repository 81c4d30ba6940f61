"""Trainer configuration: one frozen dataclass per concern, the only source of defaults.

Command-line flags mirror HuggingFace Trainer's (`--learning_rate`,
`--per_device_train_batch_size`, ...), so HF Trainer command lines translate one to one.
`--config X.yaml` overrides fields by section (`model:`, `data:`, `parallel:`, `optim:`,
`run:`, `profile:`); explicit flags override the YAML. Unknown keys are an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import sys
import types
import typing
from typing import Any

import yaml

import jflash
from models.attention import ATTENTION_KINDS
from models.cli import OneLineParser
from models.config import REMAT_POLICIES
from train.chat import CHAT_TURNS, parse_template_kwargs
from train.dataset import PACKINGS
from train.mesh import mesh_sizes


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Which model, and how its layers execute."""

    model_name_or_path: str = "tiny"  # a local HF directory or a preset name (models.PRESETS)
    attention: str = "ring"  # xla | cudnn | jflash | ring
    attention_implementation: str | None = None  # jflash implementation (None: per device)
    ring_layout: str = "zigzag"  # zigzag | striped (balanced with packed documents) | contiguous
    # auto: ulysses on one host where seq divides the heads, else ring (hybrid with a
    # seq_a2a axis)
    ring_strategy: str = "auto"
    remat_policy: str = "save_attn"  # models.config.REMAT_POLICIES
    gradient_checkpointing: bool = False  # HF's flag: with remat_policy none, means full
    bf16: bool = True  # bf16 compute with f32 master weights
    fp16: bool = False  # HF Trainer's flag: runs as bf16 compute (no loss scaling needed)
    scan_layers: bool = True  # the layers as one jax.lax.scan: compiled once, not per layer
    mlp_tile: int = -1  # MLP tokens per sequence tile: -1 auto (8192 from 256k per device), 0 off
    rope_theta: float | None = None  # RoPE's base; None: the model's (raise it for longer context)
    # JSON: HF's rope_scaling, e.g. '{"rope_type": "linear", "factor": 4}'; "": the model's
    rope_scaling: str = ""


@dataclasses.dataclass(frozen=True)
class DataArgs:
    data_path: str = ""  # required: data file(s): a file, folder or glob; a token cache; "sample"
    model_max_length: int = 2048  # tokens per training sequence
    mask_documents: bool = True  # attention stays inside each packed example; false: crosses
    packing_positions: str = "per_document"  # RoPE positions: per_document (restart) | running
    packing: str = "stream"  # stream: cut at row ends | whole: an example fitting a row is not cut
    sample_vocab_size: int = 0  # sample data: 0 means the model's vocabulary
    sample_num_examples: int = 256  # --data_path sample: rows of one example each
    eval_data_path: str = ""  # validation data (formats as data_path); empty: no evaluation
    tokenizer_name_or_path: str = ""  # tokenizer.json or its directory; empty: the model dir's
    # The token after each packed document: an id, none (no token: documents already end as
    # they should, or are pieces of longer ones), or unset: the tokenizer's / model's EOS
    eos_token_id: int | None = None
    data_cache_dir: str = ""  # tokenize data files once into token caches here; empty: in memory
    # The chat template that renders every conversation in place of the tokenizer's (a
    # base model's has none; TRL's chat_template_path): a Jinja file, or a tokenizer
    # directory whose template(s) to use; the HF export carries it (train.chat)
    chat_template: str = ""  # replaces the tokenizer's chat template: .jinja file or tokenizer dir
    # Every conversation's, as apply_chat_template(**kwargs) takes them (a JSON object;
    # a record's own chat_template_kwargs win over them); empty: none
    chat_template_kwargs: str = ""  # chat template variables (JSON): {"enable_thinking": false}
    # A conversation whose chat template rewrites its earlier turns (Qwen3's drops their
    # reasoning) is split into one example per assistant turn, the conversation rendered
    # through that turn as at inference: auto splits only those (a log line counts
    # them), whole refuses them, split splits every conversation (train.chat)
    chat_turns: str = "auto"  # auto: split what the template rewrites | whole: refuse | split: all
    # HF's: drop each epoch's last micro-batch where the rows do not fill it (false: the
    # last batch is filled up with rows of nothing to learn, every row trained once an epoch)
    dataloader_drop_last: bool = False  # drop each epoch's partial last micro-batch (HF's flag)


@dataclasses.dataclass(frozen=True)
class ParallelArgs:
    mesh: str = "data=1,fsdp=-1,seq=1"  # data, fsdp, seq, seq_a2a sizes; one -1 takes the rest
    fsdp: str = "full_shard"  # HF flag; "full_shard" (with or without auto_wrap) or ""
    shard_over_seq: bool = False  # FSDP also over the seq axis (the 4-GPU PyTorch + LightSeq setup)
    # With shard_over_seq: gather the weights over seq once per step (a compute-dtype
    # copy, kept for the backward) instead of in every layer's forward and backward.
    gather_once: bool = False
    coordinator_address: str | None = None  # multi-host: host:port of process 0
    num_processes: int | None = None  # multi-host: how many processes (one per host)
    process_id: int | None = None  # multi-host: this process's index, 0 .. num_processes-1
    # HF's flag: seconds the processes of a multi-host run wait at start for each other
    ddp_timeout: int = 1800


# HF's schedules by its names (transformers' `get_scheduler`; all but
# reduce_lr_on_plateau and greedy, which follow the evaluation loss), and wsd, jflash's
# warmup-stable-decay spelt with flags. Each with the keyword arguments it takes from
# `--lr_scheduler_kwargs` (HF's `scheduler_specific_kwargs`) and their defaults.
SCHEDULER_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "cosine_warmup_with_min_lr": {
        "num_cycles": 0.5,
        "min_lr": None,
        "min_lr_rate": None,
        "warmup_lr_rate": None,
    },
    "warmup_stable_decay": {
        "num_decay_steps": None,
        "num_stable_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "min_lr_ratio": 0.0,
        "num_cycles": 0.5,
    },
    "wsd": {},
}
LR_SCHEDULERS = tuple(SCHEDULER_KWARGS)
# Schedules that decay to a floor rather than to 0 (or not at all): `--min_lr_rate`, or
# their own keyword argument (`min_lr_rate` / `min_lr`, `min_lr_ratio`).
FLOORED_SCHEDULERS = (
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "wsd",
)
WARMUP_DECAY_TYPES = ("linear", "cosine", "1-sqrt")
OPTIMIZERS = ("adamw", "adafactor", "lion")
# HF Trainer's names for the same optimizers, taken as written in HF command lines.
OPTIMIZER_ALIASES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw"}
REPORT_TO = ("tensorboard", "wandb")


@dataclasses.dataclass(frozen=True)
class OptimArgs:
    learning_rate: float = 5e-5  # HF's default (docs/trainer.md: the five that differ)
    weight_decay: float = 0.0  # decoupled weight decay, on all but the norms' scales
    adam_beta1: float = 0.9  # AdamW's (and Lion's) first-moment decay
    adam_beta2: float = 0.999  # AdamW's (and Lion's) second-moment decay
    adam_epsilon: float = 1e-8  # AdamW's epsilon
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0: no clipping
    warmup_ratio: float = 0.0  # transformers 4's: a fraction of the run's steps
    # Steps, or below 1 a fraction of the run's steps (transformers 5's, which has no
    # warmup_ratio); wins over warmup_ratio when > 0.
    warmup_steps: float = 0
    lr_scheduler_type: str = "linear"  # train.config.LR_SCHEDULERS: HF's names, and wsd
    lr_scheduler_kwargs: str = ""  # HF's scheduler arguments as JSON, e.g. '{"num_cycles": 3}'
    min_lr_rate: float = 0.0  # the floored schedules' floor, a fraction of learning_rate
    decay_ratio: float = 0.0  # wsd: the fraction of the steps that decays (the last ones)
    decay_type: str = "cosine"  # wsd's decay to the floor: linear | cosine | 1-sqrt
    # adamw | adafactor | lion (betas: --adam_beta1/2; adafactor has none)
    optim: str = "adamw"  # also HF's adamw_torch, adamw_torch_fused and adamw_hf: adamw
    optimizer_offload: bool = False  # optimizer state in pinned host memory, on device to update

    def __post_init__(self) -> None:
        # A whole number of warmup steps reads as one (`1`, not `1.0`), a fraction stays.
        steps = self.warmup_steps
        if isinstance(steps, float) and steps >= 1 and steps == int(steps):
            object.__setattr__(self, "warmup_steps", int(steps))


# Intervals in steps, which HF also takes as a fraction of the run (a value below 1).
STEP_COUNTS = ("logging_steps", "save_steps", "eval_steps")


@dataclasses.dataclass(frozen=True)
class RunArgs:
    output_dir: str = "runs/train"  # checkpoints, logs, TensorBoard, the HF export
    num_train_epochs: float = 3.0  # passes over the data (a fraction: part of one)
    max_steps: int = -1  # -1: train for num_train_epochs; > 0 overrides it
    per_device_train_batch_size: int = 1  # sequences per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-batches summed into one update
    logging_steps: float = 10  # steps, or below 1 a fraction of the run's steps (HF's)
    logging_first_step: bool = False  # also log step 1's metrics (HF's)
    save_strategy: str = "steps"  # steps and epoch also save at the last step
    save_steps: float = 500  # steps, or below 1 a fraction of the run's (HF's)
    eval_strategy: str = "steps"  # with --eval_data_path; steps and epoch also at the last step
    eval_steps: float = 0  # as save_steps; 0: every logging_steps (HF's)
    eval_on_start: bool = False  # evaluate before a new run's first step (the loss to beat)
    save_total_limit: int | None = None  # keep the latest N checkpoints (None: all)
    save_on_preemption: bool = True  # SIGTERM while training: save the step reached, exit 143
    # a checkpoint dir, "latest" (or HF's true), or "auto"
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False  # replace a previous run once this one is good
    export_hf: bool = True  # write an HF directory at the end
    seed: int = 42  # initialisation and the data's order
    progress: bool = True  # process 0: tqdm bar on a terminal, else step lines on stdout
    report_to: str = "tensorboard"  # tensorboard | wandb | none; several: tensorboard,wandb
    run_name: str = ""  # the wandb run's name ("": the output directory's last folder)
    compilation_cache_dir: str = ""  # XLA's compiled programs kept for restarts; empty: off

    def __post_init__(self) -> None:
        # A whole number of steps reads as one (`10`, not `10.0`), a fraction stays.
        for name in STEP_COUNTS:
            value = getattr(self, name)
            if isinstance(value, float) and math.isfinite(value) and value == int(value):
                object.__setattr__(self, name, int(value))

    def every(self, name: str, total_steps: int) -> int:
        """The interval `name` (one of `STEP_COUNTS`; `eval_steps` 0: `logging_steps`'s)
        in steps of a run of `total_steps`: a value below 1 is that fraction of the run,
        rounded up as HF rounds it (at least 1)."""
        value = getattr(self, name)
        if name == "eval_steps" and value == 0:
            value = self.logging_steps
        return int(value) if value >= 1 else max(1, math.ceil(value * total_steps))


@dataclasses.dataclass(frozen=True)
class ProfileArgs:
    profile_steps: str = ""  # e.g. "5,8": jax.profiler trace of steps 5..7 (from 1)
    profile_dir: str = ""  # where traces go ("": <output_dir>/tensorboard, TensorBoard's)


# The settings that take one of a few values (checked in `TrainConfig`, listed in --help).
CHOICES: dict[tuple[str, str], tuple] = {
    ("model", "attention"): ATTENTION_KINDS,
    ("model", "ring_layout"): jflash.LAYOUTS,
    ("model", "ring_strategy"): ("auto", *jflash.STRATEGIES),
    ("model", "attention_implementation"): (None, *jflash.IMPLEMENTATIONS),
    ("model", "remat_policy"): REMAT_POLICIES,
    ("data", "packing_positions"): ("per_document", "running"),
    ("data", "packing"): PACKINGS,
    ("data", "chat_turns"): CHAT_TURNS,
    ("optim", "lr_scheduler_type"): LR_SCHEDULERS,
    ("optim", "decay_type"): WARMUP_DECAY_TYPES,
    ("optim", "optim"): OPTIMIZERS,
    ("run", "save_strategy"): ("steps", "epoch", "no"),
    ("run", "eval_strategy"): ("steps", "epoch", "no"),
}


def rope_scaling(model: ModelArgs) -> dict[str, Any] | None:
    """`--rope_scaling` as an object (None where not given); ValueError naming the flag
    for text that is not a JSON object. The values are checked where the model's config
    takes them (`models.config.with_rope`)."""
    if not model.rope_scaling:
        return None
    try:
        scaling = json.loads(model.rope_scaling)
    except ValueError as e:
        raise ValueError(f"--rope_scaling={model.rope_scaling!r}: not JSON ({e})") from None
    if not isinstance(scaling, dict):
        raise ValueError(
            f"--rope_scaling={model.rope_scaling!r} must be a JSON object, such as "
            '\'{"rope_type": "linear", "factor": 4}\''
        )
    inner = scaling.get("rope_theta")
    if model.rope_theta is not None and inner is not None and inner != model.rope_theta:
        raise ValueError(
            f"--rope_scaling={model.rope_scaling!r} gives rope_theta={inner} and "
            f"--rope_theta={model.rope_theta}: give the base once"
        )
    return scaling


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelArgs = ModelArgs()
    data: DataArgs = DataArgs()
    parallel: ParallelArgs = ParallelArgs()
    optim: OptimArgs = OptimArgs()
    run: RunArgs = RunArgs()
    profile: ProfileArgs = ProfileArgs()

    def __post_init__(self):
        for (section, name), allowed in CHOICES.items():
            value = getattr(getattr(self, section), name)
            if value not in allowed:
                hint = (  # what other trainers' values mean here
                    " (rows are always packed, documents kept apart by --mask_documents: "
                    "TRL's true/false --packing has no counterpart)"
                    if name == "packing" and str(value).lower() in ("true", "false")
                    else f" (or HF's {', '.join(OPTIMIZER_ALIASES)}, which are adamw)"
                    if name == "optim"
                    else ""
                )
                raise ValueError(f"--{name}={value!r} must be one of {allowed}{hint}")
        positive = [
            ("data", "model_max_length"),
            ("data", "sample_num_examples"),
            ("run", "per_device_train_batch_size"),
            ("run", "gradient_accumulation_steps"),
            ("run", "logging_steps"),
            ("run", "save_steps"),
            ("parallel", "ddp_timeout"),
        ]
        for section, name in positive:
            value = getattr(getattr(self, section), name)
            if value <= 0:
                raise ValueError(f"--{name}={value} must be positive")
        ranges = [
            ("run", "num_train_epochs", "> 0", lambda x: x > 0),
            ("optim", "learning_rate", ">= 0", lambda x: x >= 0),
            ("optim", "warmup_ratio", "in [0, 1]", lambda x: 0 <= x <= 1),
            ("optim", "warmup_steps", ">= 0", lambda x: x >= 0),
            ("optim", "max_grad_norm", ">= 0 (0: no clipping)", lambda x: x >= 0),
            ("optim", "weight_decay", ">= 0", lambda x: x >= 0),
            ("optim", "adam_beta1", "in [0, 1)", lambda x: 0 <= x < 1),
            ("optim", "adam_beta2", "in [0, 1)", lambda x: 0 <= x < 1),
            ("optim", "adam_epsilon", "> 0", lambda x: x > 0),
            ("run", "seed", "in [0, 2**63)", lambda x: 0 <= x < 2**63),
        ]
        for section, name, rule, ok in ranges:
            value = getattr(getattr(self, section), name)
            if not math.isfinite(value):
                raise ValueError(f"--{name}={value} must be a finite number {rule}")
            if not ok(value):
                raise ValueError(f"--{name}={value} must be {rule}")
        for section, name in [("optim", "warmup_steps")] + [("run", n) for n in STEP_COUNTS]:
            steps = getattr(getattr(self, section), name)
            if not math.isfinite(steps) or (steps >= 1 and steps != int(steps)):
                raise ValueError(
                    f"--{name}={steps} must be a whole number of steps, or below 1 a "
                    "fraction of the run's steps"
                )
        if self.run.max_steps != -1 and self.run.max_steps < 1:
            raise ValueError(
                f"--max_steps={self.run.max_steps} must be a positive int, or -1 to train "
                "for --num_train_epochs"
            )
        _check_schedule(self.optim)
        theta = self.model.rope_theta
        if theta is not None and not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"--rope_theta={theta} must be a finite number > 0")
        rope_scaling(self.model)  # JSON of an object, or its one-line error
        if not self.run.output_dir.strip():
            raise ValueError(
                f"--output_dir={self.run.output_dir!r} is empty: give the run's directory "
                "(. for the working directory)"
            )
        reports = self.run.report_to.split(",")
        if self.run.report_to != "none" and (
            not set(reports) <= set(REPORT_TO) or len(set(reports)) != len(reports)
        ):
            every = " (HF's all, every integration installed, is not taken: name them)"
            raise ValueError(
                f"--report_to={self.run.report_to!r} must be none or one or more of "
                f"{REPORT_TO}, comma-separated, each once" + every * ("all" in reports)
            )
        if self.run.eval_steps < 0:
            raise ValueError(
                f"--eval_steps={self.run.eval_steps} must be >= 0 (0: --logging_steps)"
            )
        if error := fsdp_error(self.parallel.fsdp):
            raise ValueError(error)
        error = gather_once_error(self.parallel.shard_over_seq, self.parallel.gather_once)
        if error:
            raise ValueError(error)
        if self.data.packing_positions == "per_document" and not self.data.mask_documents:
            raise ValueError(
                "--packing_positions per_document needs --mask_documents true (positions "
                "that restart mid-row with attention across documents mean nothing); pass "
                "--packing_positions running with --mask_documents false"
            )
        parse_template_kwargs(self.data.chat_template_kwargs, "--chat_template_kwargs")
        if self.model.mlp_tile < -1:
            raise ValueError(f"--mlp_tile={self.model.mlp_tile} must be -1 (auto), 0 (off) or > 0")
        if self.run.save_total_limit is not None and self.run.save_total_limit < 1:
            raise ValueError(f"--save_total_limit={self.run.save_total_limit} must be >= 1")
        _check_unused(self)

    @property
    def remat(self) -> str:
        """The effective remat policy: `--gradient_checkpointing True` turns `none` into
        `full` (HF's meaning); the other policies already checkpoint every layer."""
        if self.model.gradient_checkpointing and self.model.remat_policy == "none":
            return "full"
        return self.model.remat_policy


def _check_schedule(o: OptimArgs) -> None:
    """The schedule's own knobs: each is refused where the schedule would ignore it."""
    kind = o.lr_scheduler_type
    if not 0 <= o.min_lr_rate <= 1:
        raise ValueError(
            f"--min_lr_rate={o.min_lr_rate} must be in [0, 1] (a fraction of the peak)"
        )
    if o.min_lr_rate > 0 and kind not in FLOORED_SCHEDULERS:
        raise ValueError(
            f"--min_lr_rate={o.min_lr_rate} is used by --lr_scheduler_type "
            f"{', '.join(FLOORED_SCHEDULERS)}, not {kind!r}"
        )
    if kind == "wsd":
        steps = o.warmup_steps
        warm = 0 if steps >= 1 else steps if steps > 0 else o.warmup_ratio  # a fraction
        if not 0 < o.decay_ratio <= 1 - warm:
            raise ValueError(
                f"--lr_scheduler_type wsd needs --decay_ratio in (0, 1 - --warmup_ratio]; "
                f"got --decay_ratio={o.decay_ratio} with --warmup_ratio={warm}"
            )
    elif o.decay_ratio != 0:
        raise ValueError(
            f"--decay_ratio={o.decay_ratio} is used by --lr_scheduler_type wsd, not {kind!r}"
            + _IN_KWARGS.get(kind, "")
        )
    if kind != "wsd" and o.decay_type != OptimArgs.decay_type:
        raise ValueError(
            f"--decay_type={o.decay_type!r} is used by --lr_scheduler_type wsd, not {kind!r}"
            + _IN_KWARGS.get(kind, "")
        )
    if kind == "constant" and (o.warmup_steps > 0 or o.warmup_ratio > 0):
        raise ValueError(
            f"--lr_scheduler_type constant has no warmup (as in HF; --warmup_steps="
            f"{o.warmup_steps}, --warmup_ratio={o.warmup_ratio}): use constant_with_warmup"
        )
    scheduler_kwargs(o)


_IN_KWARGS = {
    "warmup_stable_decay": (
        " (warmup_stable_decay takes num_decay_steps and decay_type in --lr_scheduler_kwargs)"
    )
}


def scheduler_kwargs(o: OptimArgs) -> dict[str, Any]:
    """`--lr_scheduler_kwargs` for `--lr_scheduler_type`, checked, over the schedule's
    defaults (`SCHEDULER_KWARGS`), with `floor`: the rate it decays to, a fraction of the
    peak (`--min_lr_rate`, or the schedule's own `min_lr_rate`, `min_lr` or
    `min_lr_ratio`; 0 for the schedules without one). ValueError naming the value where
    an argument is unknown to the schedule, of the wrong kind, or given twice."""
    kind, text = o.lr_scheduler_type, o.lr_scheduler_kwargs
    flag = f"--lr_scheduler_kwargs={text!r}"
    given: Any = {}
    if text:
        try:
            given = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON ({e}); give an object") from None
        if not isinstance(given, dict):
            raise ValueError(f"{flag} must be a JSON object of {kind}'s arguments")
    known = SCHEDULER_KWARGS.get(kind, {})
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = f"its arguments: {', '.join(known)}" if known else "it takes none"
        raise ValueError(
            f"{flag}: --lr_scheduler_type {kind} has no {', '.join(unknown)} ({takes})"
        )
    args = {**known, **given}

    def number(name: str, rule: str, ok, whole: bool = False, optional: bool = False):
        value = args[name]
        if value is None and optional:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or (whole and value != int(value))
            or not ok(value)
        ):
            raise ValueError(f"{flag}: {name}={value!r} must be {rule}")
        if whole:
            args[name] = int(value)

    lr = o.learning_rate
    if "num_cycles" in args:
        if kind == "cosine_with_restarts":
            number("num_cycles", "a whole number >= 1 (of restarts)", lambda x: x >= 1, True)
        else:
            number("num_cycles", "a number > 0 (of cosine waves)", lambda x: x > 0)
    if kind == "polynomial":
        number("lr_end", f"in [0, --learning_rate={lr}) (as in HF)", lambda x: 0 <= x < lr)
        number("power", "a number > 0", lambda x: x > 0)
    if kind == "inverse_sqrt":
        number("timescale", "a whole number of steps >= 1", lambda x: x >= 1, True, True)
    if "min_lr" in args:
        number("min_lr", f"in [0, --learning_rate={lr}]", lambda x: 0 <= x <= lr, False, True)
        number("min_lr_rate", "in [0, 1]", lambda x: 0 <= x <= 1, False, True)
    if "warmup_lr_rate" in args:
        number("warmup_lr_rate", "in [0, 1]", lambda x: 0 <= x <= 1, False, True)
    if kind == "warmup_stable_decay":
        if args["num_decay_steps"] is None:
            raise ValueError(
                f"{flag}: --lr_scheduler_type warmup_stable_decay needs num_decay_steps "
                "(as in HF), e.g. --lr_scheduler_kwargs '{\"num_decay_steps\": 100}'"
            )
        number("num_decay_steps", "a whole number of steps >= 0", lambda x: x >= 0, True)
        number("num_stable_steps", "a whole number of steps >= 0", lambda x: x >= 0, True, True)
        number("min_lr_ratio", "in [0, 1]", lambda x: 0 <= x <= 1)
        for name in ("warmup_type", "decay_type"):
            if args[name] not in WARMUP_DECAY_TYPES:
                raise ValueError(
                    f"{flag}: {name}={args[name]!r} must be one of {WARMUP_DECAY_TYPES}"
                )

    floor = o.min_lr_rate
    own = [k for k in ("min_lr", "min_lr_rate", "min_lr_ratio") if given.get(k) is not None]
    if len(own) > 1:
        raise ValueError(f"{flag}: give one of {' and '.join(own)} (both set the floor)")
    if own and floor > 0:
        raise ValueError(
            f"--min_lr_rate={floor} and {own[0]} in {flag} both set the floor: give one"
        )
    if own:
        name = own[0]
        if name == "min_lr" and lr == 0:
            raise ValueError(f"{flag}: min_lr needs --learning_rate > 0 (it is a fraction of it)")
        floor = given[name] / lr if name == "min_lr" else given[name]
    elif kind in ("cosine_with_min_lr", "cosine_warmup_with_min_lr") and floor == 0:
        raise ValueError(
            f"--lr_scheduler_type {kind} needs --min_lr_rate in (0, 1] (its floor, a fraction "
            "of --learning_rate), or min_lr_rate or min_lr in --lr_scheduler_kwargs (HF "
            "refuses it without one): for a decay to 0 use cosine"
        )
    args["floor"] = float(floor)
    return args


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in SECTIONS}


def _parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "t", "yes", "y"):  # HF's spellings (string_to_bool)
        return True
    if lowered in ("0", "false", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


# `--eos_token_id none`: no token between packed documents (None: the tokenizer's EOS).
NO_EOS = -1


def _token_id(text: Any) -> int:
    """`--eos_token_id`'s value: a token id, or `none` (`NO_EOS`, as a run's
    `train_config.yaml` writes it)."""
    if str(text).lower() == "none":
        return NO_EOS
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if isinstance(text, (bool, float)) or value is None or value < NO_EOS:
        raise argparse.ArgumentTypeError(f"expected a token id (0 or more) or none, got {text!r}")
    return value


def _token_id_text(text: str) -> str:
    """`--eos_token_id`'s text, checked on the command line (`_coerce` reads it; -1,
    how `train_config.yaml` writes none, is for the YAML)."""
    if _token_id(text) == NO_EOS and text.lower() != "none":
        raise argparse.ArgumentTypeError(f"expected a token id (0 or more) or none, got {text!r}")
    return text


def _step_count(text: str) -> int | float:
    """A number of steps, or below 1 a fraction of the run's (HF's form)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of steps (or below 1 a fraction of the run's), got {text!r}"
        ) from None


def _parser_type(annotation) -> tuple[Any, bool]:
    """`(converter, optional)` for a dataclass field annotation."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = True, args[0]
    if annotation is bool:
        return _parse_bool, optional
    return annotation, optional


@functools.cache
def _field_comments(cls) -> types.MappingProxyType:
    """The `# ...` comment after each field in the dataclass source, or the comment lines
    right above a field that has none after it: one place for docs. Read once per class:
    `inspect.getsource` parses the whole module on each call (about 13 ms), and the
    parser asks for each of its flags."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return types.MappingProxyType({})
    field = re.compile(r"^\s+(\w+):[^#\n=]*=[^#\n]*(?:#\s*(.+))?$")
    comments, above = {}, []
    for line in source.splitlines():
        if (text := line.strip()).startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        if match := field.match(line):
            name, after = match.groups()
            if after or above:
                comments[name] = after or " ".join(above)
        above = []
    return types.MappingProxyType(comments)


def _field_help(section: str, section_cls, field) -> str:
    comment = _field_comments(section_cls).get(field.name)
    default = f"default: {field.default!r}"
    allowed = CHOICES.get((section, field.name))
    if allowed and not all(str(a) in (comment or "") for a in allowed if a is not None):
        comment = " | ".join(str(a) for a in allowed) + (f"; {comment}" if comment else "")
    return f"{comment} ({default})" if comment else default


def _join_negative_numbers(argv: list[str]) -> list[str]:
    """`--flag -1e-3` as `--flag=-1e-3`: argparse takes `-1e-3` (unlike `-0.001`) for
    an option and refuses the flag for want of a value."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if prev.startswith("--") and "=" not in prev and arg.startswith("-"):
            try:
                float(arg)
            except ValueError:
                pass
            else:
                out[-1] = f"{prev}={arg}"
                continue
        out.append(arg)
    return out


# HF's --fsdp words other than full_shard and auto_wrap, and what does their work here.
FSDP_WORDS = {
    "offload": "parameters stay on the device: --optimizer_offload true moves the "
    "optimizer state to the host, --remat_policy offload_attn the activations",
    "shard_grad_op": "parameters, gradients and optimizer state are sharded alike (full_shard)",
    "no_shard": "--fsdp '' shards nothing (a -1 in --mesh goes to data)",
    "hybrid_shard": "--mesh data=D,fsdp=F shards over fsdp and replicates over data",
    "hybrid_shard_zero2": "--mesh data=D,fsdp=F shards over fsdp and replicates over data",
}


def fsdp_error(fsdp: str) -> str | None:
    """Why an `--fsdp` value is refused, or None: 'full_shard' (with or without
    'auto_wrap') and '' are taken; HF's other words are told what does their work, so
    that none is dropped unsaid (`full_shard offload` would not offload)."""
    words = fsdp.split()
    if not words or ("full_shard" in words and set(words) <= {"full_shard", "auto_wrap"}):
        return None
    known = [f"{w}: {FSDP_WORDS[w]}" for w in dict.fromkeys(words) if w in FSDP_WORDS]
    return (
        f"--fsdp={fsdp!r}: supported are 'full_shard' (with or without 'auto_wrap') and '' "
        "(no FSDP: a -1 in --mesh goes to data, not fsdp)" + "".join(f"; {k}" for k in known)
    )


# HF TrainingArguments' flags that have no place here, and what does their work: an HF
# command line that passes one is told, in the one-line error, instead of "unrecognized".
HF_ONLY_FLAGS = {
    "--do_train": "the trainer always trains; leave it out",
    "--do_eval": "evaluation runs where --eval_data_path is given (--eval_strategy)",
    "--do_predict": "no prediction: export the model (--export_hf) and run it elsewhere",
    "--per_device_eval_batch_size": "evaluation runs the training's global batch",
    "--eval_accumulation_steps": "evaluation sums its losses batch by batch; leave it out",
    "--prediction_loss_only": "evaluation computes the loss only; leave it out",
    "--load_best_model_at_end": "no best-model selection: --save_total_limit keeps the latest",
    "--metric_for_best_model": "no best-model selection: --save_total_limit keeps the latest",
    "--greater_is_better": "no best-model selection: --save_total_limit keeps the latest",
    "--logging_dir": "TensorBoard's events go to <output_dir>/tensorboard",
    "--logging_strategy": "the metrics are logged every --logging_steps steps",
    "--tf32": "the matmuls run in --bf16 (or --fp16) on the GPU; leave it out",
    "--torch_compile": "every step is compiled by XLA (jax.jit); leave it out",
    "--dataloader_num_workers": "rows are memory-mapped and batched in process; leave it out",
    "--dataloader_pin_memory": "rows are memory-mapped and batched in process; leave it out",
    "--deepspeed": "sharding is --mesh with --fsdp full_shard (docs/trainer.md)",
    "--fsdp_config": "sharding is --mesh with --fsdp full_shard (docs/trainer.md)",
    "--fsdp_transformer_layer_cls_to_wrap": "every decoder layer is sharded with --fsdp "
    "full_shard; leave it out",
    "--fsdp_min_num_params": "every decoder layer is sharded with --fsdp full_shard; leave it out",
    "--torch_dtype": "the weights load and train in float32, computing in --bf16; leave it out",
    "--ddp_backend": "data parallelism is --mesh's data axis; leave it out",
    "--ddp_find_unused_parameters": "data parallelism is --mesh's data axis; leave it out",
    "--local_rank": "several hosts: --coordinator_address, --num_processes, --process_id",
    "--gradient_checkpointing_kwargs": "--remat_policy picks what the layers keep",
    "--save_safetensors": "checkpoints are Orbax's; --export_hf writes safetensors",
    "--save_only_model": "checkpoints hold the optimizer state (a resume needs it)",
    "--push_to_hub": "nothing is uploaded: --export_hf writes the HF directory to upload",
    "--hub_model_id": "nothing is uploaded: --export_hf writes the HF directory to upload",
    "--remove_unused_columns": "records are read by their own keys; leave it out",
    "--group_by_length": "rows are packed to --model_max_length; nothing to group",
    "--use_cpu": "jax picks the devices: JAX_PLATFORMS=cpu for the CPU",
    "--optim_args": "each optimizer setting is a flag of its own (--adam_beta1, ...)",
    "--data_seed": "--seed sets the data order too",
    "--label_smoothing_factor": "the loss is the plain token cross-entropy; leave it out",
    "--neftune_noise_alpha": "no embedding noise; leave it out",
    "--use_liger_kernel": "the loss and layers are fused by XLA and jflash's kernels; leave it out",
    "--include_num_input_tokens_seen": "log.jsonl counts the tokens (labelled_tokens, tokens/s)",
    "--max_seq_length": "the row length is --model_max_length",
    "--max_length": "the row length is --model_max_length",
    "--dataset_text_field": "records are read by their own keys (docs/trainer.md, Data)",
    "--disable_tqdm": "--progress false turns the bar (and the step lines printed off a "
    "terminal) off; log.jsonl and TensorBoard keep the metrics",
    "--log_level": "the trainer prints its lines on process 0; leave it out",
    "--full_determinism": "set XLA_FLAGS=--xla_gpu_deterministic_ops=true (the attention's "
    "deterministic backward included)",
    "--auto_find_batch_size": "python -m train.tools.capacity finds what fits",
    "--eval_delay": "the first evaluation is at --eval_steps (--eval_on_start adds step 0); "
    "a larger --eval_steps starts later",
    "--eval_do_concat_batches": "evaluation computes the loss only; leave it out",
    "--batch_eval_metrics": "evaluation computes the loss only; leave it out",
    "--include_for_metrics": "evaluation computes the loss only; leave it out",
    "--logging_nan_inf_filter": "a non-finite loss or gradient stops the run at its step, "
    "naming it, so nothing is filtered",
    "--skip_memory_metrics": "log.jsonl records the device memory (memory_gib, "
    "peak_memory_gib) where the backend reports it; leave it out",
    "--include_tokens_per_second": "tokens_per_s is always logged; leave it out",
    "--average_tokens_across_devices": "the loss is the mean over the global batch's "
    "labelled tokens (every device's, every accumulation step's) already; leave it out",
    "--log_on_each_node": "the trainer prints its lines on process 0; leave it out",
    "--completion_only_loss": "prompt/completion records are learned on the completion "
    "alone; give text records to learn every token",
    "--assistant_only_loss": "conversations are learned on the assistant turns alone",
    "--bf16_full_eval": "evaluation runs in the training's dtype (--bf16)",
    "--fp16_full_eval": "evaluation runs in the training's dtype (--bf16)",
    "--attn_implementation": "the attention is --attention (jflash, ring, xla, cudnn) with "
    "--attention_implementation (pallas_mosaic, pallas_triton, xla)",
}


# Other trainers' and scripts' names for the trainer's flags: said as "did you mean".
FLAG_ALIASES = {
    "--lr": "--learning_rate",
    "--epochs": "--num_train_epochs",
    "--num_epochs": "--num_train_epochs",
    "--batch_size": "--per_device_train_batch_size",
    "--train_batch_size": "--per_device_train_batch_size",
    "--micro_batch_size": "--per_device_train_batch_size",
    "--grad_accum": "--gradient_accumulation_steps",
    "--warmup": "--warmup_steps (or --warmup_ratio)",
    "--steps": "--max_steps",
    "--seq_len": "--model_max_length",
    "--max_seq_len": "--model_max_length",
    "--context_length": "--model_max_length",
    "--out": "--output_dir",
    "--model": "--model_name_or_path",
    "--data": "--data_path",
    "--tokenizer": "--tokenizer_name_or_path",
    "--block_size": "--model_max_length",
}

# HF's former names of the trainer's flags, taken as those flags (and as YAML keys).
FORMER_NAMES = {"eval_strategy": "--evaluation_strategy"}


def _command() -> str:
    """How the trainer was started, for its usage line: `jflash-train` or `python -m train`."""
    started = os.path.basename(sys.argv[0] or "")
    return "jflash-train" if started == "jflash-train" else "python -m train"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=_command(),
        description="Train a Llama on long sequences over a device mesh (jflash ring attention).",
        allow_abbrev=False,
    )
    parser.explained = HF_ONLY_FLAGS
    parser.aliases = FLAG_ALIASES
    parser.add_argument(
        "--config", action="append", help="YAML file of overrides, by section (one file)"
    )
    for section, cls in _section_types().items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            conv, optional = _parser_type(hints[field.name])
            kwargs: dict[str, Any] = dict(
                default=None, help=_field_help(section, cls, field), metavar=field.name.upper()
            )
            if conv is _parse_bool:
                kwargs.update(nargs="?", const=True, type=_parse_bool)
            elif field.name in STEP_COUNTS:
                kwargs["type"] = _step_count
            elif field.name == "eos_token_id":
                kwargs["type"] = _token_id_text
            elif field.name == "report_to":  # HF's list: several words, or one with commas
                kwargs.update(type=str, nargs="+")
            else:
                kwargs["type"] = conv
            former = FORMER_NAMES.get(field.name)
            names = [f"--{field.name}", *([former] if former else [])]
            group.add_argument(*names, dest=f"{section}.{field.name}", **kwargs)
    return parser


# Settings whose flag takes a JSON object, which a YAML config may give as a mapping.
JSON_FIELDS = ("chat_template_kwargs", "lr_scheduler_kwargs", "rope_scaling")
# Of those, the ones whose values are numbers (a chat template's variables may be text).
NUMBER_MAPPINGS = ("lr_scheduler_kwargs", "rope_scaling")


def _yaml_number(value: Any) -> Any:
    """A string YAML left unread that spells a number (`5e5`), as that number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _coerce(value: Any, annotation, key: str, where: str) -> Any:
    """A YAML value as its field's type: YAML 1.1 reads `1e-8` as a string and
    `"false"` would be truthy, so every value is converted and checked by name."""
    conv, optional = _parser_type(annotation)
    kind = {_parse_bool: "a boolean", int: "an integer", float: "a number"}.get(conv, "a string")
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where}: {key}=None is not allowed ({kind} is)")
    if key in JSON_FIELDS and isinstance(value, dict):  # a YAML mapping: the flag's JSON
        if key in NUMBER_MAPPINGS:  # YAML 1.1 reads `5e5` as a string: these are numbers
            value = {k: _yaml_number(v) for k, v in value.items()}
        return json.dumps(value)
    if key == "report_to" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # HF's list, as the flag's words
    if key == "eos_token_id":
        try:
            return _token_id(value)
        except argparse.ArgumentTypeError:
            raise ValueError(f"{where}: {key}={value!r} is not a token id or none") from None
    allowed = next((c for (_, name), c in CHOICES.items() if name == key), ())
    if optional and None in allowed and isinstance(value, str) and value in ("None", "none"):
        return None  # the choice `--help` lists as None, typed
    if isinstance(value, bool) and conv is str:  # YAML 1.1 reads an unquoted no as false
        if value is False and "no" in allowed:
            return "no"
        raise ValueError(
            f"{where}: {key}={value!r}: YAML reads an unquoted yes/no/on/off/true/false as "
            f'a boolean; quote the text ({key}: "...")'
        )
    try:
        if conv is _parse_bool:
            return value if isinstance(value, bool) else _parse_bool(value)
        if isinstance(value, bool) and conv is not str:
            raise ValueError
        if conv is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if conv is float:
            return float(value)
        if isinstance(value, (dict, list)):
            raise ValueError
        return conv(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ValueError(f"{where}: {key}={value!r} is not {kind}") from None


def _homes() -> dict[str, str]:
    """Each setting's section (`output_dir`: `run`)."""
    return {
        name: section
        for section, cls in _section_types().items()
        for name in (f.name for f in dataclasses.fields(cls))
    }


def _sections_of(keys) -> str:
    """Where `keys` that are settings of some section belong, as a hint to add to an
    error: ` (settings go under their section: learning_rate under optim:)`, and what
    does the work of HF-only keys and other trainers' names (`HF_ONLY_FLAGS`,
    `FLAG_ALIASES`), or ''."""
    homes = _homes()
    homes |= {former[2:]: homes[name] for name, former in FORMER_NAMES.items()}
    found = [f"{k} under {homes[k]}:" for k in keys if k in homes]
    hint = f" (settings go under their section: {', '.join(found)})" if found else ""
    # HF TrainingArguments' keys with no place here, and other trainers' names, as the
    # command line explains them
    told = [f"{k}: {HF_ONLY_FLAGS[f'--{k}']}" for k in keys if f"--{k}" in HF_ONLY_FLAGS]
    for k in keys:
        if alias := FLAG_ALIASES.get(f"--{k}"):
            name = alias.split()[0][2:]
            told.append(f"{k}: did you mean {name} (under {homes[name]}:)?")
    return hint + "".join(f"; {t}" for t in told)


def _replace_section(section_obj, overrides: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(section_obj)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {unknown}; known: {sorted(names)}{_sections_of(unknown)}"
        )
    hints = typing.get_type_hints(type(section_obj))
    values = {k: _coerce(v, hints[k], k, where) for k, v in overrides.items()}
    return dataclasses.replace(section_obj, **values)


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, but a key given twice in one mapping is an error (PyYAML keeps
    the last silently: a second `optim:` section would drop the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """YAML 1.1's integers, but one it reads as another number than it shows is
        refused: a leading zero is octal (`seed: 010` is 8), a colon base 60 (`1:30`)."""
        read = super().construct_yaml_int(node)
        text = str(node.value).replace("_", "")
        if ":" in text or (re.fullmatch(r"[-+]?0[0-7]+", text) and int(text, 10) != read):
            raise AmbiguousNumber(node, read)
        return read

    def construct_yaml_float(self, node):
        read = super().construct_yaml_float(node)
        if ":" in str(node.value):  # base 60, as above
            raise AmbiguousNumber(node, read)
        return read


class AmbiguousNumber(yaml.YAMLError):
    """A YAML 1.1 number that reads as another than it shows (`_UniqueKeyLoader`)."""

    def __init__(self, node, read):
        text = str(node.value)
        if ":" in text:
            what = f'base 60 (a colon); quote it ("{text}") where it is text, else write the number'
        else:
            meant = int(text.replace("_", ""), 10)
            what = f"octal (a leading zero); write {meant}, or {read} where octal was meant"
        super().__init__(
            f"line {node.start_mark.line + 1}: {text} reads as the number {read} in YAML "
            f"1.1, {what}"
        )


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def shipped_config(name: str) -> str:
    """The path of ``configs/<name>``, the example configs jflash ships: the source
    tree's folder (a clone, an editable install), else the installed package's copy
    (``train/configs`` in a wheel, `pyproject.toml`'s package data)."""
    package = os.path.dirname(os.path.abspath(__file__))
    tree = os.path.join(os.path.dirname(package), "configs", name)
    return tree if os.path.exists(tree) else os.path.join(package, "configs", name)


def config_file(path: str) -> str:
    """`--config`'s file: `path`, or where no such file is here and it is the docs'
    relative `configs/<name>`, the copy jflash ships (`shipped_config`), with a note."""
    head, name = os.path.split(os.path.normpath(path))
    shipped = shipped_config(name)
    if os.path.exists(path) or head != "configs" or not os.path.isfile(shipped):
        return path
    print(f"note: --config={path!r} is not here: reading jflash's copy {shipped}", file=sys.stderr)
    return shipped


def load_yaml(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--config={path!r}: byte {e.start} is not UTF-8 ({e.reason}); save it as UTF-8"
        ) from None
    except FileNotFoundError as e:
        # `configs/x.yaml` of the docs, outside a clone: name the installed copy
        shipped = shipped_config(os.path.basename(path))
        hint = f" (jflash's copy: --config {shipped})" if os.path.isfile(shipped) else ""
        raise ValueError(f"--config={path!r}: {e.strerror}{hint}") from None
    except OSError as e:
        raise ValueError(f"--config={path!r}: {e.strerror}") from None
    except AmbiguousNumber as e:
        raise ValueError(f"--config={path!r}, {e}") from None
    except yaml.YAMLError as e:
        where = " ".join(str(e).split())  # PyYAML puts the position on lines of its own
        raise ValueError(f"--config={path!r} is not valid YAML: {where}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(
            f"{path}: unknown sections {unknown}; known: {sorted(SECTIONS)}" + _sections_of(unknown)
        )
    homes = _homes()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"{path}: section {section!r} must be a mapping")
        for name, former in FORMER_NAMES.items():
            if (key := former[2:]) in values and homes[name] == section:
                if name in values:
                    raise ValueError(f"{path}: {key} and {name} are one setting; give {name}")
                values[name] = values.pop(key)
    return data


def from_overrides(
    yaml_overrides: dict[str, dict[str, Any]],
    flags: dict[str, dict[str, Any]],
    where: str = "config",
) -> TrainConfig:
    base = TrainConfig()
    sections = {}
    for section in SECTIONS:
        obj = getattr(base, section)
        obj = _replace_section(obj, yaml_overrides.get(section, {}), where)
        obj = _replace_section(obj, flags.get(section, {}), "command line")
        sections[section] = obj
    optim = sections["optim"]
    if optim.optim in OPTIMIZER_ALIASES:
        sections["optim"] = dataclasses.replace(optim, optim=OPTIMIZER_ALIASES[optim.optim])
    return TrainConfig(**sections)


def _check_unused(cfg: TrainConfig) -> None:
    """Settings away from their defaults that this run would ignore (a value equal to
    the default is allowed: a run's saved settings hold every field)."""
    optim_defaults, run_defaults = OptimArgs(), RunArgs()
    unused = {
        "adafactor": ("adam_beta1", "adam_beta2", "adam_epsilon"),  # no momentum, own epsilons
        "lion": ("adam_epsilon",),  # sign updates: no division
    }.get(cfg.optim.optim, ())
    for name in unused:
        if getattr(cfg.optim, name) != getattr(optim_defaults, name):
            raise ValueError(
                f"--{name}={getattr(cfg.optim, name)} is not used by --optim {cfg.optim.optim}"
            )
    if cfg.run.eval_on_start and cfg.run.eval_strategy == "no":
        raise ValueError("--eval_on_start evaluates, which --eval_strategy no turns off")
    if cfg.data.eval_data_path or cfg.run.eval_strategy == "no":
        return
    if cfg.run.eval_on_start:
        raise ValueError("--eval_on_start needs --eval_data_path (no evaluation data given)")
    for name in ("eval_steps", "eval_strategy"):
        if getattr(cfg.run, name) != getattr(run_defaults, name):
            raise ValueError(
                f"--{name}={getattr(cfg.run, name)} needs --eval_data_path (no evaluation "
                "data given); pass one, or --eval_strategy no"
            )


def ignored_settings(cfg: TrainConfig, given: set[str]) -> list[str]:
    """Warning lines for `--save_steps` / `--eval_steps` in `given` (the settings the
    user gave) while their strategy is `no` or `epoch`: accepted, as HF accepts them,
    but unused; for `--save_total_limit` with no saves, `--warmup_ratio` beside
    `--warmup_steps`, the sample data's flags with other data, `--fsdp full_shard` on a
    mesh whose fsdp axis is 1, and a `--profile_dir` without `--profile_steps`; a note
    that `--fp16` runs as bf16."""
    run = cfg.run
    lines = []
    if "fp16" in given and cfg.model.fp16:
        lines.append(
            "note: --fp16 runs the model in bfloat16: half precision with float32's range, "
            "so no loss scaling"
        )
    if cfg.profile.profile_dir and not cfg.profile.profile_steps:
        lines.append(
            f"warning: --profile_dir={cfg.profile.profile_dir!r} has no effect without "
            "--profile_steps (nothing is traced)"
        )
    if "save_steps" in given and run.save_strategy == "no":
        lines.append(
            f"warning: --save_steps={run.save_steps} has no effect with --save_strategy no "
            "(no checkpoints are saved)"
        )
    if "eval_steps" in given and run.eval_strategy == "no":
        lines.append(
            f"warning: --eval_steps={run.eval_steps} has no effect with --eval_strategy no "
            "(no evaluation is run)"
        )
    if "eval_steps" in given and run.eval_strategy == "epoch":
        lines.append(
            f"warning: --eval_steps={run.eval_steps} has no effect with --eval_strategy epoch "
            "(evaluation runs at each epoch's end and at the run's)"
        )
    if "save_total_limit" in given and run.save_strategy == "no":
        lines.append(
            f"warning: --save_total_limit={run.save_total_limit} has no effect with "
            "--save_strategy no (no checkpoints are saved)"
        )
    if "warmup_ratio" in given and cfg.optim.warmup_ratio > 0 and cfg.optim.warmup_steps > 0:
        lines.append(
            f"warning: --warmup_ratio={cfg.optim.warmup_ratio} has no effect beside "
            f"--warmup_steps={cfg.optim.warmup_steps}, which sets the warmup (as in HF)"
        )
    for name in ("sample_num_examples", "sample_vocab_size"):
        if name in given and cfg.data.data_path != "sample":
            lines.append(
                f"warning: --{name}={getattr(cfg.data, name)} has no effect: it shapes "
                f"--data_path sample, and the data is {cfg.data.data_path!r}"
            )
    parallel = cfg.parallel
    if "fsdp" in given and parallel.fsdp and not parallel.shard_over_seq:
        try:
            fsdp = mesh_sizes(parallel.mesh).get("fsdp", 1)
        except ValueError:  # the build names the spec's fault
            fsdp = None
        if fsdp == 1:
            lines.append(
                f"warning: --fsdp={parallel.fsdp!r} has no effect with --mesh "
                f"{parallel.mesh!r}, whose fsdp axis is 1: parameters, gradients and "
                "optimizer state are not sharded (fsdp=-1 or a size above 1 shards them)"
            )
    if "save_steps" in given and run.save_strategy == "epoch":
        lines.append(
            f"warning: --save_steps={run.save_steps} has no effect with --save_strategy epoch "
            "(a checkpoint is saved at each epoch's end)"
        )
    return lines


# The settings that name files or directories: `~` and `$VAR` expanded when read,
# written absolute so that `--config` runs the same job from any directory (a preset
# name, `sample`, stays).
PATH_SETTINGS = (
    ("model", "model_name_or_path"),
    ("data", "data_path"),
    ("data", "eval_data_path"),
    ("data", "tokenizer_name_or_path"),
    ("data", "chat_template"),
    ("data", "data_cache_dir"),
    ("run", "output_dir"),
    ("run", "compilation_cache_dir"),
    ("profile", "profile_dir"),
)


def expand_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with `~` and `$VAR` / `${VAR}` in its path settings expanded, as a shell
    expands them on a command line (a YAML file's are not); ValueError naming the
    setting where a variable is not set (a folder named `$HOME` would be made)."""
    sections = {}
    for section, name in PATH_SETTINGS:
        obj = sections.get(section, getattr(cfg, section))
        value = getattr(obj, name)
        if not value or ("~" not in value and "$" not in value):
            continue
        expanded = os.path.expandvars(os.path.expanduser(value))
        if unset := re.search(r"\$(\w+|\{\w+\})", expanded):
            raise ValueError(f"--{name}={value!r}: {unset.group(0)} is not set in the environment")
        sections[section] = dataclasses.replace(obj, **{name: expanded})
    return dataclasses.replace(cfg, **sections) if sections else cfg


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Flags (and `--config` YAML) -> `TrainConfig`; explicit flags win over the YAML.
    A setting that another leaves unused gets a warning line on stderr
    (`ignored_settings`)."""
    if argv is None:
        argv = sys.argv[1:]
    ns = build_parser().parse_args(_join_negative_numbers(list(argv)))
    flags: dict[str, dict[str, Any]] = {}
    for key, value in vars(ns).items():
        if key == "config" or value is None:
            continue
        section, name = key.split(".")
        flags.setdefault(section, {})[name] = ",".join(value) if isinstance(value, list) else value
    configs = ns.config or []
    if len(configs) > 1:
        given = " and ".join(f"--config={c!r}" for c in configs)
        raise ValueError(f"{given}: pass one --config file (flags override it)")
    if configs and not configs[0].strip():
        raise ValueError(f"--config={configs[0]!r} names no file")
    config = config_file(configs[0]) if configs else None
    overrides = load_yaml(config) if config else {}
    cfg = expand_paths(from_overrides(overrides, flags, where=config or "config"))
    # Given: on the command line, or in the YAML away from the default (a run's saved
    # train_config.yaml holds every setting).
    given = {
        name
        for section, cls in _section_types().items()
        for name in {*flags.get(section, {}), *overrides.get(section, {})}
        if name in flags.get(section, {})
        or getattr(getattr(cfg, section), name) != getattr(cls(), name)
    }
    # A strategy that evaluates, asked for on the command line, needs evaluation data
    # (as HF refuses it), though it is the default (`_check_unused` catches the rest).
    asked = flags.get("run", {}).get("eval_strategy")
    if asked is not None and asked != "no" and not cfg.data.eval_data_path:
        raise ValueError(
            f"--eval_strategy={asked} needs --eval_data_path (no evaluation data given); "
            "pass one, or --eval_strategy no"
        )
    named = {*flags.get("model", {}), *overrides.get("model", {})}  # their defaults too
    if {"bf16", "fp16"} <= named and cfg.model.bf16 and cfg.model.fp16:
        raise ValueError(
            "--bf16 and --fp16 are both true: give one (as HF refuses both; --fp16 runs "
            "as bf16 here)"
        )
    for line in ignored_settings(cfg, given):
        print(line, file=sys.stderr, flush=True)
    return cfg


def gather_once_error(shard_over_seq: bool, gather_once: bool, *, dashes: bool = False):
    """The rule between the two flags (the trainer's, and `train.tools.profile`'s and
    `train.tools.capacity`'s spelled with dashes): None, or what is wrong."""
    if not gather_once or shard_over_seq:
        return None
    once, seq = ("--gather-once", "--shard-over-seq")
    if not dashes:
        once, seq = ("--gather_once true", "--shard_over_seq true")
    return (
        f"{once} needs {seq}: without it the parameters are not sharded over seq, "
        "so there is nothing to gather"
    )
