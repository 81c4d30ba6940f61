"""What a checkpoint records of the run that wrote it, and what a resume checks against
that record: the model, the data (a hash of some rows' tokens and labels), the data
order, the step count, the learning-rate schedule and each step's update. A resume
that would change any of them mid-run is refused in one line naming the setting;
`--resume_from_checkpoint auto` is resolved here too."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import numpy as np

import models
from train import outputs
from train.build import Trainer, data_eos
from train.checkpoint import other_params
from train.config import OptimArgs, TrainConfig
from train.errors import TrainingError
from train.optim import decay_steps, schedule, update_settings, warmup_steps

# Rows whose tokens and labels identify the training data in a checkpoint: spread over
# the data, first and last included, so another file or another order of the same rows
# differs.
FINGERPRINT_ROWS = 16


def _fingerprint(rows, field: int) -> str:
    n = rows.num_rows
    ids = np.unique(np.linspace(0, n - 1, min(n, FINGERPRINT_ROWS)).round().astype(np.int64))
    digest = hashlib.sha256(f"{n} {rows.seq_len}".encode())
    digest.update(np.ascontiguousarray(rows.take(ids)[field], np.int32).tobytes())
    return digest.hexdigest()[:16]


def data_fingerprint(rows) -> str:
    """A short hash of the input ids of `FINGERPRINT_ROWS` rows spread over `rows`
    (and their count and length): what a resume checks the data against, cheaply at
    any size."""
    return _fingerprint(rows, 0)


def label_fingerprint(rows) -> str:
    """The same rows' labels, hashed likewise: the same tokens with other labels (text
    records against prompt/completion records of the same texts) are other data."""
    return _fingerprint(rows, 1)


# HF config keys that change nothing a step computes: a resume may see them differ.
MODEL_KEYS_FREE = (
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
)


def _model_record(config) -> dict:
    """The model a step computes, as HF config keys (JSON values, as a checkpoint's
    metadata holds them)."""
    hf = {k: v for k, v in models.to_hf_config(config).items() if k not in MODEL_KEYS_FREE}
    return json.loads(json.dumps(hf))


# The layout of an optimizer's state where it changed: a checkpoint whose record names
# another (or none, written before) cannot be restored into this one.
OPTIM_STATES = {"adafactor": "hf_adafactor"}  # train.optim.hf_adafactor, per layer


def run_record(t: Trainer) -> dict:
    """What fixes the model, the data order, the schedule and each step's update (the
    optimizer's flags, the compute dtype): a resumed run must match it."""
    return {
        "model": _model_record(t.config),
        "model_max_length": t.cfg.data.model_max_length,
        "packing": t.cfg.data.packing,
        "eos_id": data_eos(t.cfg, t.config),  # the token after each document (None: none)
        "rows_per_step": t.global_batch * t.accum,
        "num_rows": t.rows.num_rows,
        "data": data_fingerprint(t.rows),
        "labels": label_fingerprint(t.rows),
        "seed": t.cfg.run.seed,
        "dataloader_drop_last": t.cfg.data.dataloader_drop_last,
        "steps_per_epoch": t.batches.steps_per_epoch,
        # With --dataloader_drop_last, the whole micro-batches' rows: the same global
        # batch split otherwise drops another number of rows each epoch.
        "rows_per_epoch": (t.batches.rows_per_epoch if t.cfg.data.dataloader_drop_last else None),
        # How this run splits its rows a step (the mesh may change on resume): for the
        # advice where the rows a step or an epoch would differ.
        "split": {
            "per_device_batch": t.cfg.run.per_device_train_batch_size,
            "batch_shards": t.global_batch // t.cfg.run.per_device_train_batch_size,
            "accumulation": t.accum,
        },
        "total_steps": t.total_steps,
        "optim": t.cfg.optim.optim,
        "optim_state": OPTIM_STATES.get(t.cfg.optim.optim),
        "update": {
            **update_settings(t.cfg.optim),
            "compute_dtype": t.config.dtype,
            **_document_settings(t),
        },
        "schedule": _schedule_record(t),
        # What the run evaluates on (None: no evaluation): a resume may change it, said.
        "eval": data_fingerprint(t.eval_rows) if t.eval_rows is not None else None,
    }


def drop_last_warning(meta: dict, run_meta: dict) -> str | None:
    """The warning line where a checkpoint written before the rows an epoch were
    recorded ran with --dataloader_drop_last and this run drops rows: whether it drops
    the same ones (its micro-batch, per-device batch x data x fsdp, the same) cannot be
    checked. None elsewhere."""
    saved = meta.get("run") or {}
    if not saved.get("dataloader_drop_last") or "rows_per_epoch" in saved:
        return None
    if run_meta.get("rows_per_epoch") in (None, run_meta.get("num_rows")):
        return None  # this run drops no row: nor did the checkpoint's, at its global batch
    return (
        f"warning: checkpoint {meta['step']} records no rows an epoch (an earlier jflash "
        f"wrote it): this run drops the last {run_meta['num_rows'] - run_meta['rows_per_epoch']} "
        "rows of each epoch under --dataloader_drop_last, the same as it did only where its "
        "micro-batch (per-device batch x data x fsdp) was this run's"
    )


def update_warning(meta: dict, run_meta: dict) -> str | None:
    """The warning line where a checkpoint written before the update settings were
    recorded (`"update"`) resumes with steps left: whether this run's (weight decay,
    clipping, the optimizer's betas, ...) are the ones its steps used cannot be checked.
    None elsewhere."""
    saved = meta.get("run")
    if not saved or "update" in saved or meta["step"] >= run_meta["total_steps"]:
        return None
    now = run_meta.get("update", {})
    names = update_settings(OptimArgs(optim=run_meta.get("optim", "adamw")))
    flags = ", ".join(f"--{k} {now[k]}" for k in names if k in now)
    return (
        f"warning: checkpoint {meta['step']} records no update settings (an earlier jflash "
        f"wrote it): this run's ({flags}) are not compared with those its first "
        f"{meta['step']} steps used; its run's train_config.yaml named them"
    )


def eval_data_warning(meta: dict, run_meta: dict) -> str | None:
    """The warning line where a resume evaluates on other data than the checkpoint's run
    did (or starts or stops evaluating): its eval_loss series then changes data at the
    resumed step, which the log would not otherwise tell. None where it does not."""
    saved = (meta.get("run") or {}).get("eval", "unrecorded")
    new = run_meta.get("eval")
    if saved == "unrecorded" or saved == new:  # (a checkpoint written before the record)
        return None
    step = meta["step"]
    before = "evaluated on nothing" if saved is None else "evaluated on its --eval_data_path"
    if new is None:
        now = "this one evaluates on nothing"
    elif saved is None:
        now = "this one evaluates from here on"
    else:
        now = "this one on other data"
    return (
        f"warning: checkpoint {step}'s run {before}, {now}: the eval_loss series changes "
        f"data after step {step}"
    )


def _document_settings(t: Trainer) -> dict:
    """What the step makes of packed documents, as it runs (not as flagged): whether the
    attention stays inside each (`--mask_documents`; false where every training row
    holds one document, nothing to mask, whatever the evaluation's rows hold) and where
    RoPE positions count from (`per_document` only where documents are masked). Another
    mask or other positions change every step's gradient, so a resume keeps them."""
    mask = bool(t.spec.mask_documents and t.rows.packed)
    restart = mask and t.cfg.data.packing_positions == "per_document"
    return {"mask_documents": mask, "packing_positions": "per_document" if restart else "running"}


# The flags that shape the learning-rate schedule, and where it is sampled (fractions of
# the run, and the warmup's end) to tell one schedule from another whatever flags spell it.
SCHEDULE_FLAGS = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "min_lr_rate",
    "decay_ratio",
    "decay_type",
)
SCHEDULE_PROBES = 9
# The schedules whose decay takes the last `--decay_ratio` of the run.
WSD_SCHEDULERS = ("wsd", "warmup_stable_decay")


def _schedule_record(t: Trainer) -> dict:
    """The run's learning-rate schedule: its flags and its values at `SCHEDULE_PROBES`
    steps spread over the run (the first and last included) and at the warmup's end."""
    o, total = t.cfg.optim, t.total_steps
    warmup = warmup_steps(o, total)
    steps = sorted(
        {round(i * (total - 1) / (SCHEDULE_PROBES - 1)) for i in range(SCHEDULE_PROBES)}
        | {min(warmup, total - 1)}
    )
    return {
        "flags": {k: getattr(o, k) for k in SCHEDULE_FLAGS},
        "lr": {str(i): float(t.lr_at(i)) for i in steps},
        # The phases' lengths in steps, whatever flags spell them: another warmup moves
        # the rate at steps no sample of both runs may hold.
        "phases": {
            "warmup": None if o.lr_scheduler_type == "constant" else warmup,
            "decay": decay_steps(o, total) if o.lr_scheduler_type in WSD_SCHEDULERS else None,
        },
    }


def _schedule_flag_changes(saved: dict, new: dict) -> list[str]:
    """The schedule flags two records' `flags` set otherwise, as `--flag old -> new`. A
    flag a record lacks (written before the flag was) counts as its default, which is
    what that run used."""
    default = OptimArgs()
    changes = []
    for k in SCHEDULE_FLAGS:
        before, after = (flags.get(k, getattr(default, k)) for flags in (saved, new))
        if before != after:
            changes.append(f"--{k} {before} -> {after}")
    return changes


def _schedule_error(saved: dict, new: dict) -> str | None:
    """What differs between two `_schedule_record`s, or None where the rates agree (to
    float32's precision) at every step either one sampled."""
    steps = [i for i in saved["lr"] if i in new["lr"]]
    apart = [
        i for i in steps if not math.isclose(saved["lr"][i], new["lr"][i], rel_tol=1e-6, abs_tol=0)
    ]
    phases = saved.get("phases"), new.get("phases")  # (records written before: none)
    moved = None not in phases and phases[0] != phases[1]
    if steps and not apart and not moved:
        return None
    flags = _schedule_flag_changes(saved["flags"], new["flags"])
    if apart:
        i = apart[0]
        flags.append(f"lr at step {int(i) + 1}: {saved['lr'][i]:.3g} -> {new['lr'][i]:.3g}")
    elif moved:
        flags += [
            f"{name} {phases[0][name]} -> {phases[1][name]} steps"
            for name in ("warmup", "decay")
            if phases[0][name] != phases[1][name]
        ]
    return ", ".join(flags)


def resolve_auto_resume(cfg: TrainConfig, is_main: bool) -> TrainConfig:
    """`--resume_from_checkpoint auto` (one command for a job's first start and every
    restart, e.g. a scheduler's requeue after a preemption): `latest` where
    `--output_dir` holds a whole checkpoint, where `--overwrite_output_dir` is then
    ignored (it would delete them); else a start from step 0, as without the flag
    (`--overwrite_output_dir` replacing what a run that saved nothing left)."""
    value = cfg.run.resume_from_checkpoint
    if value is None or value.lower() != "auto":
        return cfg
    out = cfg.run.output_dir
    steps = outputs.saved_steps(out)
    if steps:
        run_args = dataclasses.replace(
            cfg.run, resume_from_checkpoint="latest", overwrite_output_dir=False
        )
    else:
        run_args = dataclasses.replace(cfg.run, resume_from_checkpoint=None)
        where = os.path.join(out, "checkpoints")
        found = outputs.previous_outputs(out)
        refused = found and not cfg.run.overwrite_output_dir
        if refused and outputs.PREVIOUS_RUN not in found:  # (else the claim says more)
            raise TrainingError(
                f"--resume_from_checkpoint auto: no checkpoint in {where} to continue, and "
                f"--output_dir={out!r} holds a run that saved none ({', '.join(found)}): "
                "--overwrite_output_dir true replaces it (a requeued job's command carries "
                "both flags), or choose another --output_dir"
            )
        if is_main and not refused:
            print(
                f"--resume_from_checkpoint auto: no checkpoint in {where}; training from the start",
                flush=True,
            )
    return dataclasses.replace(cfg, run=run_args)


def check_model(saved: dict | None, params, step: int, cfg: TrainConfig, where: str) -> None:
    """Refuses a checkpoint of another model (other parameters or shapes) before its
    state is read: Orbax would fail on every array, a screen of tracebacks each."""
    if differ := other_params(saved, params):
        raise TrainingError(
            f"checkpoint {step} in {where} holds another model's parameters ({differ} in "
            f"--model_name_or_path={cfg.model.model_name_or_path!r}); resume with the model "
            "that wrote it"
        )


def _new_run_from(meta: dict, where: str) -> str:
    """The way to train on from the checkpoint of `meta` in `where` (a run's
    `checkpoints` folder) as a new run: its weights exported, then a new run on them."""
    return (
        f"train on as a new run from its weights: python -m train.tools.export "
        f"{os.path.dirname(where)} --step {meta['step']} --out DIR, then "
        "--model_name_or_path DIR and a new --output_dir (a new schedule and optimizer "
        "state; the same data and --seed replay the data order from its start)"
    )


def _keeps_past_rates(saved: dict, run_meta: dict, step: int) -> bool:
    """Whether a run of `saved["total_steps"]` steps, resumed at `step` as a run of
    `run_meta["total_steps"]` with the same schedule flags, keeps the learning rates of
    the steps it trained: the same rate at each step before `step` under both step counts
    (a constant rate; a warmup-stable-decay schedule still before its decay)."""
    args = dataclasses.replace(OptimArgs(), **run_meta["schedule"]["flags"])
    steps = np.arange(step)
    before = np.asarray(schedule(args, saved["total_steps"])(steps))
    after = np.asarray(schedule(args, run_meta["total_steps"])(steps))
    return bool(np.allclose(before, after, rtol=1e-6, atol=0))


# The run record's data-order keys as a refusal names them (the others by their flag).
ORDER_WORDS = {
    "eos_id": "token after each document (--eos_token_id)",
    "rows_per_step": "rows a step (per-device batch x data x fsdp x accumulation)",
    "rows_per_epoch": "rows an epoch (--dataloader_drop_last drops what does not fill a "
    "micro-batch of per-device batch x data x fsdp rows)",
    "steps_per_epoch": "steps an epoch",
    "num_rows": "rows of data",
}


def _split_advice(saved: dict, run_meta: dict, changed: dict) -> str:
    """Where the rows a step (or, with --dataloader_drop_last, its micro-batch) differ
    from the checkpoint's run: the per-device batch and accumulation that give its
    rows on this run's mesh (a requeue on another number of devices), or that none
    does; '' where neither differs."""
    split = run_meta.get("split")
    if split is None or not {"rows_per_step", "rows_per_epoch"} & set(changed):
        return ""
    if {"dataloader_drop_last", "num_rows"} & set(changed):  # no split keeps the rows
        return ""
    rows, shards = saved["rows_per_step"], split["batch_shards"]
    old = saved.get("split")
    if run_meta.get("dataloader_drop_last") and old is not None:
        # The micro-batch decides the rows dropped each epoch: it must be the old one's.
        micro = old["per_device_batch"] * old["batch_shards"]
        options = [(micro // shards, old["accumulation"])] if micro % shards == 0 else []
    else:
        per_device, accum = split["per_device_batch"], split["accumulation"]
        options = [
            (per_device, rows // (per_device * shards)),
            (rows // (shards * accum), accum),
            (1, rows // shards),
        ]
    current = (split["per_device_batch"], split["accumulation"])
    for per_device, accum in options:
        if (per_device, accum) == current:
            continue
        if per_device >= 1 and accum >= 1 and per_device * shards * accum == rows:
            return (
                f"; on this mesh (data x fsdp = {shards}), --per_device_train_batch_size "
                f"{per_device} --gradient_accumulation_steps {accum} gives its {rows} rows a step"
            )
    if run_meta.get("dataloader_drop_last") and old is not None:
        return (
            f"; on this mesh (data x fsdp = {shards}) no per-device batch makes its "
            f"micro-batch of {old['per_device_batch'] * old['batch_shards']} rows"
        )
    return (
        f"; on this mesh (data x fsdp = {shards}) no per-device batch x accumulation gives "
        f"its {rows} rows a step ({rows} is not a multiple of {shards})"
    )


def check_resumable(meta: dict, run_meta: dict, where: str) -> str | None:
    """Refuses (TrainingError) a resume from the checkpoint of `meta` that would change
    what its run recorded (`run_meta`: this run's); returns a line to print where it
    goes on differently as it may (more steps, the rates so far the same), else None."""
    saved = meta.get("run")
    if saved is None:  # checkpoints written before this record existed
        return None
    old_optim = saved.get("optim", "adamw")  # checkpoints from before --optim: adamw
    if old_optim != run_meta["optim"]:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} holds the state of --optim {old_optim}; "
            f"this run asks for --optim {run_meta['optim']}. Resume with --optim "
            f"{old_optim}, or {_new_run_from(meta, where)}"
        )
    if saved.get("optim_state") != run_meta.get("optim_state") and old_optim in OPTIM_STATES:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} holds optax's --optim {old_optim} state, "
            f"which this version replaced by HF's ({run_meta.get('optim_state')}, one layer "
            f"at a time): it does not carry over: {_new_run_from(meta, where)}"
        )
    if "model" in saved and saved["model"] != run_meta["model"]:
        old, new = saved["model"], run_meta["model"]
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        text = ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in keys)
        rope = (
            " and its --rope_theta / --rope_scaling"
            if set(keys) & {"rope_theta", "rope_scaling"}
            else ""
        )
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was trained as another model ({text}); "
            f"resume with the model config that wrote it (the run's model_config.json){rope}"
        )
    # Checked on their own, with their own advice.
    own_checks = (
        "split",  # free: its values advise where the rows a step or an epoch differ
        "eval",  # a warning, `eval_data_warning`
        "total_steps",
        "optim",
        "optim_state",
        "data",
        "labels",
        "schedule",
        "model",
        "update",
    )
    if (
        "steps_per_epoch" not in saved
        and saved.get("dataloader_drop_last")
        and "steps_per_epoch" in run_meta
        and saved.get("num_rows") == run_meta["num_rows"]
        and saved.get("rows_per_step") == run_meta["rows_per_step"]
        and (old := saved["num_rows"] // saved["rows_per_step"]) != run_meta["steps_per_epoch"]
    ):
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written when --dataloader_drop_last "
            f"dropped each epoch's last partial step ({old} steps an epoch); it now drops "
            f"the partial micro-batch only, as HF does ({run_meta['steps_per_epoch']} steps "
            "an epoch), so resuming would not continue its data order: "
            f"{_new_run_from(meta, where)}"
        )
    changed = {
        k: (saved[k], v)
        for k, v in run_meta.items()
        if k in saved and saved[k] != v and k not in own_checks
    }
    if {"dataloader_drop_last", "num_rows"} & set(changed):  # which rows an epoch drops
        changed.pop("rows_per_epoch", None)  # follows from these
    if changed:
        text = ", ".join(
            f"{ORDER_WORDS.get(k, f'--{k}')} {'none' if old is None else old} -> "
            f"{'none' if new is None else new}"
            for k, (old, new) in changed.items()
        )
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written by a run with other settings "
            f"({text}); resuming would not continue its data order. Use the same "
            "--model_max_length, --packing, --eos_token_id, data (its tokenizer and chat "
            "template too), "
            "global batch (per-device batch x data x "
            "fsdp x accumulation), --seed and --dataloader_drop_last"
            + (" (--data_path sample is made from --seed)" if "seed" in changed else "")
            + _split_advice(saved, run_meta, changed)
            + f", or {_new_run_from(meta, where)}"
        )
    if "data" in saved and saved["data"] != run_meta["data"]:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written on other data: as many rows, "
            f"but their tokens differ (data {saved['data']} there, {run_meta['data']} here), "
            "so resuming would not continue its data. Resume with the same --data_path, "
            "tokenizer, chat template (--chat_template, --chat_template_kwargs), "
            f"--model_max_length and --packing, or {_new_run_from(meta, where)}"
        )
    if "labels" in saved and saved["labels"] != run_meta["labels"]:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written on other data: the same "
            f"tokens, but other labels (labels {saved['labels']} there, "
            f"{run_meta['labels']} here: the loss is on other tokens, as with text records "
            "in place of prompt/completion ones), so resuming would not continue its "
            "training. Resume with the same --data_path and chat template (--chat_template), "
            f"or {_new_run_from(meta, where)}"
        )
    old, new = saved.get("total_steps"), run_meta["total_steps"]
    extended = None
    if old is not None and old != new:
        step = meta["step"]
        if new < step:
            why = "which ends before the checkpoint's step"
        elif "schedule" not in saved:
            why = "and the checkpoint records no schedule to compare the rates of its steps with"
        elif changes := _schedule_flag_changes(
            saved["schedule"]["flags"], run_meta["schedule"]["flags"]
        ):
            why = f"and other schedule flags ({', '.join(changes)})"
        elif not _keeps_past_rates(saved, run_meta, step):
            why = "under which the rates of the steps it trained differ"
        else:
            why = None
        if why is not None:
            raise TrainingError(
                f"checkpoint {step} in {where} belongs to a run of {old} steps; this run "
                f"has {new} (--max_steps / --num_train_epochs), {why}: the learning-rate "
                f"schedule would jump mid-run. Resume with the same number of steps "
                f"({old}), or {_new_run_from(meta, where)}"
            )
        if new > step:
            extended = (
                f"checkpoint {step} belongs to a run of {old} steps; this run has {new}: the "
                f"schedule's rates of its first {step} steps are the same under both, so it "
                f"trains on to step {new}"
            )
    # A finished run trains nothing more: no schedule to jump, no update to change.
    left = meta["step"] < run_meta["total_steps"]
    old, new = saved.get("update"), run_meta.get("update")
    # A setting the checkpoint's record has no entry for (written before it was recorded)
    # is not compared.
    keys = sorted(k for k in old or () if k in (new or {}) and old[k] != new[k])
    if left and keys:
        flag = {"compute_dtype": "compute dtype (--bf16 / --fp16)"}
        text = ", ".join(f"{flag.get(k, '--' + k)} {old.get(k)} -> {new.get(k)}" for k in keys)
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was trained with other update settings "
            f"({text}): resuming would change how its remaining steps update the weights, "
            "and its train_config.yaml would name settings its first steps did not use. "
            "Resume with its flags (--config <output_dir>/train_config.yaml), or "
            f"{_new_run_from(meta, where)}"
        )
    if left and "schedule" in saved and extended is None:
        other = _schedule_error(saved["schedule"], run_meta["schedule"])
    else:  # an extended run's past rates are compared above, step by step
        other = None
    if other:
        raise TrainingError(
            f"checkpoint {meta['step']} in {where} was written with another learning-rate "
            f"schedule ({other}): resuming would jump to this one mid-run. Resume with "
            "its flags (its run's train_config.yaml holds them: --config "
            f"<output_dir>/train_config.yaml), or {_new_run_from(meta, where)}"
        )
    return extended
