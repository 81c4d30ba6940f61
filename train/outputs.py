"""The rules of a run's `--output_dir`: what may be written there, when an old run's
outputs go, and how a resumed run drops what its killed predecessor logged after the
checkpoint it resumes from.

Order in `train.loop.run`: `check_writable` and `check_claim` first (they only read),
then everything the run needs is built and compiled, and only then `set_aside` moves a
previous run's outputs into `previous_run/` (`--overwrite_output_dir`): a run that
cannot start leaves the directory as it was. `settle` deletes them once the new run is
known good (it has written a whole checkpoint, or finished) and puts them back where it
stops before that. A run killed halfway through those moves leaves a record of them
(`MOVES`), from which the next run into the directory puts the previous run back whole
(`recover`) before it looks at the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import shutil
import signal
import threading

import jax
import yaml
from jax.experimental import multihost_utils

from models.convert import tokenizer_files as folder_tokenizer_files
from models.files import atomic_write, folder_error
from train.chat import is_template_file, read_chat_template, save_chat_template, template_files
from train.config import NO_EOS, PATH_SETTINGS, TrainConfig
from train.errors import TrainingError
from train.patterns import is_pattern
from train.run_files import LOG_FILE, SETTINGS_FILE
from train.tensorboard import truncate_events

# Where `--overwrite_output_dir` keeps a previous run's outputs until the new run is good.
PREVIOUS_RUN = "previous_run"
# `previous_run/`'s record of what `set_aside` moved there and how far the moves got,
# `{"state": "moving" | "aside" | "returning", "names": [...]}`, written before each
# series of renames: a kill between two renames leaves the previous run split between
# `previous_run/` and the directory, and `recover` makes it whole again from the record.
MOVES = ".moves.json"
# Where a `previous_run/` goes, in one rename, before it is deleted (`_delete`), so that
# a deletion cut off leaves no part of it under its name; `recover` deletes what is left.
DELETING = ".previous_run.deleting"
# What `settle` says where it puts them back (the interrupted line reads it).
PUT_BACK = (
    "--overwrite_output_dir: this run stopped before its first checkpoint; the previous "
    "run's outputs are back in"
)
# The note on an `--overwrite_output_dir` run's exception from before it changed
# anything (the interrupted line reads it).
NOT_STARTED = "the run stopped before it changed the output directory"
# `--chat_template`'s templates as the run read them (`write_chat_templates`), which
# `train.tools.export` carries: a file edited or moved since changes no later export.
RUN_TEMPLATES = "chat_template"
# The tokenizer's files as the run read them (`write_tokenizer`), which the HF exports
# carry (`run_tokenizer`): a tokenizer edited or moved since changes no later export.
RUN_TOKENIZER = "tokenizer"
# The model's config.json as the run built the model (`write_model_config`), which
# `train.tools.export` reads (`run_model_config`): the input model's config.json edited
# or moved since changes no later export.
RUN_MODEL_CONFIG = "model_config.json"
RUN_OUTPUTS = (
    "checkpoints",
    LOG_FILE,
    "tensorboard",
    "wandb",
    "hf",
    SETTINGS_FILE,
    RUN_TEMPLATES,
    RUN_TOKENIZER,
    RUN_MODEL_CONFIG,
    PREVIOUS_RUN,
)


def hf_dir(out: str) -> str:
    """Where a run's HF export goes."""
    return os.path.join(out, "hf")


def has_export(out: str) -> bool:
    """Whether `out` holds a whole HF export: `models.export_hf` renames its
    `config.json` into place after the weights, and the trainer copies the tokenizer
    before both."""
    return os.path.isfile(os.path.join(hf_dir(out), "config.json"))


def check_writable(out: str, flag: str = "--output_dir") -> None:
    """Refuses a directory (`--output_dir`, or `flag`) that is a file, lies under a file,
    or cannot be written (`models.files.folder_error`); creates nothing that stays."""
    if why := folder_error(out, flag):
        raise TrainingError(why)


def previous_outputs(out: str) -> list[str]:
    """The names of `RUN_OUTPUTS` present in `out`."""
    return [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(out, n))]


def _beside_previous_run(out: str) -> list[str]:
    """`previous_outputs` but `previous_run`: the outputs of the run writing into `out`."""
    return [n for n in previous_outputs(out) if n != PREVIOUS_RUN]


def check_claim(
    out: str,
    *,
    continuing: bool,
    overwrite: bool,
    resume_flag: str | None,
    inputs: dict[str, str] | None = None,
    seen: list[int] | None = None,
) -> None:
    """Refuses to mix a new run into a previous run's outputs (Orbax would skip saving
    steps at or below the old run's latest checkpoint), and an `--overwrite_output_dir`
    that could not replace them cleanly; deletes nothing.

    Args:
      out: the output directory.
      continuing: the run resumes from this directory's own checkpoints.
      overwrite: `--overwrite_output_dir`.
      resume_flag: `--resume_from_checkpoint`, for the message.
      inputs: `{flag: path}` the run reads (model, tokenizer, data), which must not lie
        inside the outputs that `--overwrite_output_dir` replaces.
      seen: the whole checkpoints' steps in `out` when the run chose where to start
        (which checkpoint, or a new run): checked again under the directory's lock,
        where another run may have saved since (None: not checked).
    """
    if seen is not None and (now := saved_steps(out)) != seen:
        raise TrainingError(
            f"--output_dir={out!r}: another run saved checkpoints there while this one "
            f"started ({_steps_text(seen)} then, {_steps_text(now)} now); nothing was "
            "changed: start this run again to choose where it starts from what is there now"
        )
    aside = os.path.join(out, PREVIOUS_RUN)
    if os.path.isdir(aside) and _read_moves(aside) is None:
        beside = _beside_previous_run(out)
        back = f"move its contents back into {out}"
        if beside:  # a run that set it aside, stopped before its first checkpoint
            back = f"delete the outputs beside it ({', '.join(beside)}) and {back}"
        raise TrainingError(
            f"--output_dir={out!r} holds {aside} without a record of how it was set aside "
            f"({MOVES}: made by hand, or by a jflash from before that record), so which "
            f"outputs are the previous run's is not known: {back}, or delete {aside} "
            "yourself"
        )
    if continuing:
        if overwrite:
            raise TrainingError(
                f"--overwrite_output_dir would delete the checkpoints that "
                f"--resume_from_checkpoint={resume_flag!r} reads in {out!r}"
            )
        return
    found = previous_outputs(out)
    if found and overwrite:
        _check_replaceable(out, found, inputs or {})
    steps = saved_steps(out)
    if os.path.isdir(aside) and overwrite and steps:
        # Replacing the stopped run would delete the one it had set aside, unasked.
        raise TrainingError(
            f"--output_dir={out!r} holds two runs: one set aside in {aside}, kept when the "
            f"run that replaced it was stopped, and that run ({_steps_text(steps)}): "
            "--overwrite_output_dir would replace the second and delete the first; delete "
            f"{aside} (or move its contents back) first, or continue the second with "
            "--resume_from_checkpoint latest (without --overwrite_output_dir)"
        )
    if os.path.isdir(aside) and not overwrite:
        replaces = (
            "--resume_from_checkpoint latest continues the killed run"
            if steps
            else "--overwrite_output_dir true replaces both (the set-aside run is kept until "
            "the new run has a checkpoint)"
        )
        raise TrainingError(
            f"--output_dir={out!r} holds a run set aside in {aside} by a run that replaced "
            f"it and was killed ({', '.join(_beside_previous_run(out))} beside "
            f"it): {replaces}; or move {PREVIOUS_RUN}/'s contents back"
        )
    if found and not overwrite:
        saved = bool(steps)
        resume = "continue it with --resume_from_checkpoint latest, " if saved else ""
        kept = "" if saved else " (it saved no checkpoint to continue from)"
        raise TrainingError(
            f"--output_dir={out!r} holds a previous run ({', '.join(found)}){kept}: "
            f"{resume}replace it with --overwrite_output_dir true, or choose another "
            "--output_dir"
        )


def _steps_text(steps: list[int]) -> str:
    """`checkpoints 10, 20` / `checkpoint 10` / `no checkpoint`."""
    if not steps:
        return "no checkpoint"
    return f"checkpoint{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}"


def _check_replaceable(out: str, found: list[str], inputs: dict[str, str]) -> None:
    """What `set_aside` cannot replace cleanly: a symlinked output (its target's files
    would stay behind while the new run wrote beside it), a `previous_run` that is not a
    directory, and an input inside the outputs (the run would delete what it reads)."""
    for name in found:
        path = os.path.join(out, name)
        if os.path.islink(path):
            raise TrainingError(
                f"--overwrite_output_dir: {path} is a symlink (to {os.readlink(path)}); "
                "empty or remove it yourself, or choose another --output_dir"
            )
    aside = os.path.join(out, PREVIOUS_RUN)
    if os.path.exists(aside) and not os.path.isdir(aside):
        raise TrainingError(
            f"--overwrite_output_dir: {aside} is a file; the previous run is kept there "
            "until the new one has a checkpoint: move it, or choose another --output_dir"
        )
    for flag, value in inputs.items():
        if not value or not os.path.exists(value):
            continue
        real = os.path.realpath(value)
        for name in found:
            output = os.path.realpath(os.path.join(out, name))
            if real == output or real.startswith(output + os.sep):
                raise TrainingError(
                    f"{flag}={value!r} lies in {os.path.join(out, name)}, which "
                    "--overwrite_output_dir replaces: copy it elsewhere first, or choose "
                    "another --output_dir"
                )


def preemption_service() -> bool:
    """Whether jax's preemption sync manager runs (`jax.distributed.initialize` starts
    it, on by `jax_enable_preemption_service`): its own SIGTERM handler (C++, which
    replaced Python's) notes a preemption for `reached_preemption_sync_point`, so
    Python must not take SIGTERM back."""
    from jax._src import distributed

    return getattr(distributed.global_state, "preemption_sync_manager", None) is not None


def stop_signals() -> tuple:
    """SIGHUP, and SIGTERM unless jax's preemption service takes it
    (`preemption_service`)."""
    return (signal.SIGHUP,) + (() if preemption_service() else (signal.SIGTERM,))


@contextlib.contextmanager
def signals_held(reraise: bool = True, signals: tuple | None = None):
    """Ctrl-C, SIGTERM and SIGHUP (or `signals`) wait until the block is done (then raised, with
    `reraise`; a block that runs while the run is already stopping drops them), so that
    moving, deleting or saving a run's outputs is never cut off halfway. Only in the
    main thread, where Python runs signal handlers; a signal ignored stays so. SIGTERM
    is left to jax's preemption service where it runs (`preemption_service`: it only
    notes the signal, which cuts nothing off)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signals is None:
        signals = (signal.SIGINT, *stop_signals())
    got = []
    held = {}
    for sig in signals:
        if signal.getsignal(sig) not in (signal.SIG_IGN, None):
            held[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if got and reraise:
            signal.raise_signal(got[0])


def _lock(fd: int, out: str) -> None:
    """An exclusive `flock` on `out`'s open directory `fd`; one line where another run
    holds it. A filesystem without such locks: nothing (unguarded)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise TrainingError(
                f"--output_dir={out!r} is in use by another run (it holds the directory's "
                "lock); wait for it, or choose another --output_dir"
            ) from None


def check_not_in_use(out: str) -> None:
    """Refuses, in one line, an `out` whose lock another run holds (`claimed`), before the
    model and data load and before any advice about what the directory holds (a live run
    with no checkpoint yet is not a previous run to replace). Not under `claimed`'s own
    lock: a second open of the directory would conflict with it."""
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError:  # none yet, or not readable: nothing holds it
        return
    try:
        _lock(fd, out)
    finally:
        os.close(fd)  # releases a lock taken here


@contextlib.contextmanager
def claimed(out: str):
    """Holds `out` for this run (an exclusive `flock` on the directory, which the system
    releases whatever way the process ends): a second run into it while this one goes
    on is refused in one line. Where the filesystem has no such locks, runs unguarded.
    The main process's to take (`train.loop`)."""
    os.makedirs(out, exist_ok=True)
    try:
        fd = os.open(out, os.O_RDONLY)
    except OSError:  # a directory that cannot be opened for reading: unguarded
        yield
        return
    try:
        _lock(fd, out)
        yield
    finally:
        os.close(fd)  # releases the lock


def saved_steps(out: str) -> list[int]:
    """The steps of the whole checkpoints in `out/checkpoints`, in order (Orbax's
    unfinished saves carry a suffix), read without opening Orbax."""
    directory = os.path.join(out, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _remove(out: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _write_moves(aside: str, state: str, names: list[str]) -> None:
    """`aside`'s record of its moves (`MOVES`), replaced whole (never half written)."""
    path = os.path.join(aside, MOVES)
    with open(path + ".part", "w") as f:
        json.dump({"state": state, "names": names}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _read_moves(aside: str) -> dict | None:
    """`aside`'s record (`MOVES`), or None where there is none that can be read; an
    empty `aside` (a kill before its record was written) reads as a record of no move."""
    try:
        with open(os.path.join(aside, MOVES)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    if record is None and not set(os.listdir(aside)) - {MOVES + ".part"}:
        return {"state": "moving", "names": []}
    if not isinstance(record, dict) or record.get("state") not in ("moving", "aside", "returning"):
        return None
    names = record.get("names")
    plain = isinstance(names, list) and all(
        isinstance(n, str) and n not in ("", ".", "..") and os.sep not in n for n in names
    )
    return record if plain else None


def _delete(out: str, aside: str) -> None:
    """Deletes `aside`: first renamed to `DELETING` in one step, so that a deletion cut
    off leaves nothing under its name (`recover` deletes the rest)."""
    gone = os.path.join(out, DELETING)
    if os.path.exists(gone):
        shutil.rmtree(gone)
    os.rename(aside, gone)
    shutil.rmtree(gone)


def recover(out: str, is_main: bool) -> str | None:
    """Makes a previous run whole again where a run that replaced it
    (`--overwrite_output_dir`) was killed between two of the renames that set it aside or
    put it back: its outputs are all moved back into `out` (the killed run had written
    nothing yet, or its outputs were deleted already), by `previous_run/`'s record
    (`MOVES`). Also deletes what a deletion cut off left (`DELETING`). Run before
    anything reads `out`; takes `out`'s lock while it moves. Returns the line that says
    what it did, or None."""
    aside, gone = os.path.join(out, PREVIOUS_RUN), os.path.join(out, DELETING)
    line = None
    if is_main and (os.path.isdir(aside) or os.path.isdir(gone)):
        with claimed(out), signals_held():
            if os.path.isdir(gone):
                shutil.rmtree(gone, ignore_errors=True)
            record = _read_moves(aside) if os.path.isdir(aside) else None
            if record is not None and record["state"] != "aside":
                line = _put_back(out, aside, record)
    if jax.process_count() > 1:  # every process waits here, whatever it found
        multihost_utils.sync_global_devices("jflash: output_dir recovered")
    return line


def _put_back(out: str, aside: str, record: dict) -> str | None:
    """`recover`'s moves: the record's names from `aside` back into `out`."""
    names = [n for n in record["names"] if os.path.lexists(os.path.join(aside, n))]
    clash = [n for n in names if os.path.lexists(os.path.join(out, n))]
    extra = sorted(set(os.listdir(aside)) - set(record["names"]) - {MOVES, MOVES + ".part"})
    if clash or extra:
        which = ", ".join(clash or extra)
        where = f"both {out} and {aside}" if clash else f"{aside} (not in its record)"
        raise TrainingError(
            f"--output_dir={out!r}: a run killed while it moved a previous run's outputs "
            f"left {which} in {where}; sort them by hand, then run again"
        )
    for name in names:
        os.rename(os.path.join(aside, name), os.path.join(out, name))
    for name in (MOVES, MOVES + ".part"):
        if os.path.exists(os.path.join(aside, name)):
            os.remove(os.path.join(aside, name))
    os.rmdir(aside)
    if not names:
        return None
    how = "setting them aside" if record["state"] == "moving" else "putting them back"
    return (
        f"--output_dir: a run that was killed while {how} had left part of the previous "
        f"run's outputs in {aside}: {', '.join(names)} back in {out}"
    )


def set_aside(out: str, is_main: bool) -> str | None:
    """Moves a previous run's outputs in `out` into `out/previous_run`
    (`--overwrite_output_dir`); call it only once the new run is known to start (and
    after `recover`). `settle` deletes them or puts them back. Returns that directory
    where it holds a previous run (on the main process), else None. A move that fails
    is undone, and refused in one line; a kill between two moves is undone by the next
    run (`recover`, from the record written before the first move).

    A `previous_run` already there was left by a replacing run that was killed before
    `settle`: the outputs beside it are that run's, dropped where they hold no whole
    checkpoint (where they hold one, `check_claim` refuses the replacement: it would
    delete `previous_run` unasked; were it not refused, `previous_run` is dropped)."""
    aside = os.path.join(out, PREVIOUS_RUN)
    if is_main:
        with signals_held():
            names = _beside_previous_run(out)
            try:
                if os.path.isdir(aside):
                    if saved_steps(out):
                        _delete(out, aside)
                    else:
                        _remove(out, names)
                        names = []
            except OSError as e:
                raise TrainingError(
                    f"--overwrite_output_dir: could not delete {e.filename} ({e.strerror}), "
                    "left by a run that was killed"
                ) from None
            if names:
                os.makedirs(aside)
                _write_moves(aside, "moving", names)
                moved = []
                try:
                    for name in names:
                        os.rename(os.path.join(out, name), os.path.join(aside, name))
                        moved.append(name)
                except OSError as e:
                    for back in moved:
                        os.rename(os.path.join(aside, back), os.path.join(out, back))
                    os.remove(os.path.join(aside, MOVES))
                    os.rmdir(aside)
                    raise TrainingError(
                        f"--overwrite_output_dir: could not move {os.path.join(out, name)} "
                        f"into {aside} ({e.strerror}); {out} is as it was"
                    ) from None
                _write_moves(aside, "aside", names)
    if jax.process_count() > 1:  # every process waits here, whatever it found
        multihost_utils.sync_global_devices("jflash: output_dir set aside")
    return aside if is_main and os.path.isdir(aside) else None


def settle(aside: str | None, out: str, *, good: bool) -> str | None:
    """Ends the keeping of a previous run's outputs (`set_aside`): deleted where the new
    run is good (`good`: it finished; or it has written a whole checkpoint), else the new
    run's outputs are deleted and the previous ones put back (the record says so first:
    a kill midway is finished by the next run's `recover`). Returns the line that says
    which, or None where nothing was kept. A deletion that fails is said, not raised:
    the run goes on, and a resume tries again."""
    if aside is None or not os.path.isdir(aside):
        return None
    with signals_held(reraise=good):
        steps = saved_steps(out)
        if good or steps:
            why = f"has a whole checkpoint (step {steps[0]})" if steps else "finished"
            try:
                _delete(out, aside)
            except OSError as e:
                return (
                    f"warning: this run {why}, but the run it replaces could not all be "
                    f"deleted from {e.filename}: {e.strerror}; delete it yourself"
                )
            return f"this run {why}: deleted the run it replaces ({aside})"
        _remove(out, _beside_previous_run(out))
        names = sorted(set(os.listdir(aside)) - {MOVES, MOVES + ".part"})
        _write_moves(aside, "returning", names)
        for name in names:
            os.rename(os.path.join(aside, name), os.path.join(out, name))
        os.remove(os.path.join(aside, MOVES))
        os.rmdir(aside)
    return f"{PUT_BACK} {out}"


def kept_aside(aside: str, step: int) -> str:
    """The line of a run preempted before its first checkpoint but the preemption's own
    (`step`): the previous run stays in `aside` beside it, for either to go on."""
    return (
        f"--overwrite_output_dir: the run this one replaces is kept in {aside} beside "
        f"this run's checkpoint {step}: --resume_from_checkpoint latest continues this "
        f"run (and deletes {PREVIOUS_RUN}/ once it has another checkpoint); to go back "
        f"to the previous run, delete this run's outputs and move {PREVIOUS_RUN}/'s "
        "contents back"
    )


# Of `PATH_SETTINGS`, the ones the run creates (made absolute whether or not they exist yet).
CREATED_DIRS = ("data_cache_dir", "output_dir", "profile_dir", "compilation_cache_dir")


def write_settings(out: str, cfg: TrainConfig) -> str:
    """Writes every setting of the run (defaults included) as `--config` YAML, by section
    (HF's `training_args`); call it only once the run is known to start.

    Paths are written absolute (`PATH_SETTINGS`). What this invocation did to the
    directory is written reset (`--overwrite_output_dir`, `--resume_from_checkpoint`): the
    file describes the job, so that running it again into the same directory is refused
    like any other run, not allowed to delete it."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, SETTINGS_FILE)
    job = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, resume_from_checkpoint=None, overwrite_output_dir=False),
    )
    record = dataclasses.asdict(job)
    for section, name in PATH_SETTINGS:
        value = record[section][name]
        if value and (name in CREATED_DIRS or os.path.exists(value) or is_pattern(value)):
            record[section][name] = os.path.abspath(value)  # a pattern: its folder's
    if record["data"]["eos_token_id"] == NO_EOS:  # as the flag spells it
        record["data"]["eos_token_id"] = "none"
    text = yaml.safe_dump(record, sort_keys=False, default_flow_style=False)
    header = "# The settings of the run in this directory: python -m train --config <this file>\n"
    with atomic_write(path, "w") as f:  # a rewrite cut off keeps the file it replaces
        f.write(header + text)
    return path


def write_chat_templates(out: str, templates: dict[str, str]) -> str:
    """Writes `templates` (`--chat_template`'s, `{name: text}`) into `<out>/chat_template/`
    as a tokenizer directory holds them (`chat_template.jinja`, the others in
    `additional_chat_templates/`), replacing what a run before it wrote there; returns
    the directory. Call it with `write_settings`."""
    folder = os.path.join(out, RUN_TEMPLATES)
    save_chat_template(folder, templates)  # makes the directories it writes into
    return folder


def run_chat_templates(out: str) -> dict[str, str] | None:
    """The templates the run in `out` rendered its conversations with, as it wrote them
    (`write_chat_templates`); None where it wrote none (no `--chat_template`).
    TrainingError (one line, naming the file) where the copy cannot be read."""
    folder = os.path.join(out, RUN_TEMPLATES)
    try:
        found = read_chat_template(folder) if os.path.isdir(folder) else None
    except ValueError as e:
        raise TrainingError(str(e)) from None
    return None if found is None else found[0]


def tokenizer_source(cfg: TrainConfig) -> str:
    """The tokenizer a run reads: `--tokenizer_name_or_path` (a `tokenizer.json` or its
    directory), else the input model's directory (or preset name)."""
    return cfg.data.tokenizer_name_or_path or cfg.model.model_name_or_path


def write_tokenizer(out: str, cfg: TrainConfig) -> str | None:
    """Copies the tokenizer the run reads (`tokenizer_source`) into
    `<out>/tokenizer/`, its files as `copy_tokenizer` takes them, replacing what a run
    before it wrote there; returns the directory, or None where `source` has no
    tokenizer file (a preset). The copy is written beside it and renamed into place, so
    a run killed meanwhile leaves the last whole copy. Call it with `write_settings`."""
    source = tokenizer_source(cfg)
    if not tokenizer_files(source):
        return None
    folder = os.path.join(out, RUN_TOKENIZER)
    staged = folder + ".partial"
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(staged)
    copy_tokenizer(source, staged)
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.rename(staged, folder)
    return folder


def run_tokenizer(out: str) -> str | None:
    """The directory of the tokenizer the run in `out` read, as it copied it
    (`write_tokenizer`); None where it holds no copy (a preset's run, or one written
    before runs kept it)."""
    folder = os.path.join(out, RUN_TOKENIZER)
    return folder if tokenizer_files(folder) else None


def with_run_tokenizer(cfg: TrainConfig, out: str) -> tuple[TrainConfig, str]:
    """`(cfg, tokenizer)` for exporting the run in `out`: its copy of the tokenizer
    (`run_tokenizer`) in place of `--tokenizer_name_or_path` where it has one, and the
    tokenizer whose files the export carries (that copy, else `tokenizer_source`)."""
    copy = run_tokenizer(out)
    if copy is None:
        return cfg, tokenizer_source(cfg)
    if cfg.data.tokenizer_name_or_path:
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer_name_or_path=copy)
        )
    return cfg, copy


def write_model_config(out: str, hf_config: dict) -> str:
    """Writes the run's model config (`models.to_hf_config` of the model it built) as
    `<out>/model_config.json`, written beside it and renamed into place, replacing what
    a run before it wrote there; returns the path. Call it with `write_settings`."""
    path = os.path.join(out, RUN_MODEL_CONFIG)
    staged = path + ".partial"
    with open(staged, "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(staged, path)
    return path


def run_model_config(out: str) -> str | None:
    """The model config the run in `out` built its model from, as it wrote it
    (`write_model_config`); None where it holds none (a run written before runs kept
    it)."""
    path = os.path.join(out, RUN_MODEL_CONFIG)
    return path if os.path.isfile(path) else None


def logged_eval(out: str, step: int) -> bool:
    """Whether `out`'s log holds an evaluation of `step` (`eval_loss`)."""
    try:
        with open(os.path.join(out, LOG_FILE)) as f:
            for line in f:
                if '"eval_loss"' in line:
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if isinstance(record, dict) and record.get("step") == step:
                            return True
    except OSError:  # no log yet
        return False
    return False


def drop_after(out: str, last_step: int) -> None:
    """Drops the log records and TensorBoard scalars after the checkpoint resumed from
    (a killed run logged steps it never saved; they are run again). Each file is
    rewritten beside itself and then replaces the old one, and Ctrl-C or SIGTERM waits
    until both are done: a stop cuts neither in half."""
    with signals_held():
        truncate_log(os.path.join(out, LOG_FILE), last_step)
        truncate_events(os.path.join(out, "tensorboard"), last_step)


def truncate_log(path: str, last_step: int) -> None:
    """Keeps the records of `path` (JSON lines) at or before `last_step`: written to
    `<path>.part`, which then replaces `path` (a failure or a kill leaves the old log).
    A last line that is no record (torn by the kill) goes; one before it is damage the
    resume refuses, naming the line, instead of dropping it."""
    part = path + ".part"
    if os.path.exists(part):  # left by a kill before it replaced the log
        os.remove(part)
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()

    def step_of(number: int, line: str) -> float:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record["step"]
        if number == len(lines):  # a line torn by the kill
            return math.inf
        raise TrainingError(
            f"{path}, line {number}: not a record of a step ({line.strip()[:60]!r}): the "
            "run's log is damaged; mend or remove that line, then resume"
        )

    keep = [line for n, line in enumerate(lines, 1) if step_of(n, line) <= last_step]
    if len(keep) != len(lines):
        with open(part, "w") as f:
            f.writelines(keep)
        os.replace(part, path)


def copy_tokenizer(
    source: str,
    hf_dir: str,
    chat_templates: dict[str, str] | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
) -> None:
    """The run's tokenizer goes with the export, so it loads as a model: `source` is
    `--tokenizer_name_or_path` (a `tokenizer.json` or its directory) or, without it, the
    input model's directory (nothing to copy for a preset). `chat_templates`: the
    templates the run rendered its conversations with in place of the tokenizer's
    (`--chat_template`, `{name: text}`), written as transformers 5 saves a tokenizer's
    (`train.chat.save_chat_template`) instead of the tokenizer's own, so that
    `apply_chat_template` renders what training saw. `eos_token_id`: the export's
    config.json's, which a `generation_config.json` copied with it takes first, before
    the other stop tokens it lists (what transformers' `generate` stops on)."""
    if os.path.isfile(source):
        shutil.copy2(source, os.path.join(hf_dir, "tokenizer.json"))
    else:
        for name in tokenizer_files(source, chat_templates):
            if chat_templates is not None and is_template_file(name):
                continue  # written below
            os.makedirs(os.path.dirname(os.path.join(hf_dir, name)), exist_ok=True)
            shutil.copy2(os.path.join(source, name), os.path.join(hf_dir, name))
    if chat_templates is not None:
        save_chat_template(hf_dir, chat_templates)
    generation = os.path.join(hf_dir, GENERATION_CONFIG)
    if eos_token_id is not None and os.path.isfile(generation):
        try:
            with open(generation, encoding="utf-8") as f:
                settings = json.load(f)
        except ValueError:  # not JSON: transformers refuses it as it was
            return
        if not isinstance(settings, dict):
            return
        # The export's EOS first; the stop tokens the file listed beside it stay (the
        # same tokenizer's: Llama 3's <|eom_id|>, <|eot_id|>).
        ids = list(eos_token_id) if isinstance(eos_token_id, (tuple, list)) else [eos_token_id]
        listed = settings.get("eos_token_id")
        listed = listed if isinstance(listed, list) else [] if listed is None else [listed]
        ids += [i for i in listed if i not in ids]
        eos = ids[0] if len(ids) == 1 else ids
        if settings.get("eos_token_id") != eos:
            settings["eos_token_id"] = eos
            with open(generation, "w", encoding="utf-8") as f:
                json.dump(settings, f, indent=2)
                f.write("\n")


# transformers' generation settings of a model directory (copied with its tokenizer).
GENERATION_CONFIG = "generation_config.json"


def tokenizer_files(source: str, chat_templates: dict[str, str] | None = None) -> list[str]:
    """The paths (relative to `hf_dir`) of the files `copy_tokenizer` writes from
    `source`: a directory's `models.convert.TOKENIZER_FILES`, the named chat templates
    in its `additional_chat_templates/` included; with `chat_templates`, theirs in place
    of the tokenizer's (`train.chat.template_files`)."""
    if os.path.isfile(source):
        found = ["tokenizer.json"]
    elif os.path.isdir(source):
        found = folder_tokenizer_files(source)
    else:
        found = []
    if chat_templates is None:
        return found
    return [n for n in found if not is_template_file(n)] + template_files(list(chat_templates))


# Flags a demo (`make demo`, `make demo-text`) sets itself; the others pass through.
DEMO_FLAGS = (
    "--config",
    "--model_name_or_path",
    "--data_path",
    "--eval_data_path",
    "--output_dir",
    "--overwrite_output_dir",
)


def demo_flag_error(argv: list[str], run_dir: str) -> str | None:
    """The one-line error for a demo given a flag it owns (`DEMO_FLAGS`), else None: a
    demo writes only under `run_dir`, and would otherwise train into (and replace) a
    directory the user named."""
    owned = [a.split("=")[0] for a in argv if a.split("=")[0] in DEMO_FLAGS]
    if not owned:
        return None
    return (
        f"error: {owned[0]} is the demo's own (it writes under {run_dir}/); train your "
        "own model, data or directory with `python -m train`"
    )


def demo_help(argv: list[str], doc: str, run_dir: str, own: tuple[str, ...] = ()) -> str | None:
    """A demo's `--help` / `-h` (before it writes anything), else None: what it does
    (`doc`, its module docstring), its own flags (`own`, "--flag: what"), and which of
    the trainer's flags pass through."""
    if not {"-h", "--help"} & set(argv):
        return None
    flags = "".join(f"\n  {line}" for line in own)
    return (
        f"{doc.strip()}\n\nflags:{flags}\n  any `python -m train` flag (`python -m train "
        f"--help` lists them) but {', '.join(DEMO_FLAGS)}: the demo's own (it writes "
        f"under {run_dir}/)"
    )


def demo_resumes(argv: list[str]) -> bool:
    """Whether a demo's flags resume its last run (`--resume_from_checkpoint`, either
    form): it then keeps that run's outputs instead of replacing them."""
    return any(a.split("=")[0] == "--resume_from_checkpoint" for a in argv)
