"""Orbax checkpoints: async saves of the train state and the data position, resume.

Layout: `<output_dir>/checkpoints/<step>/{state,meta}`. `--save_total_limit` keeps the
newest N: Orbax moves an older one into `checkpoints/.deleted/` in one rename, and it is
deleted from there at the next save and at the end, so that a kill during a deletion
leaves no half-deleted checkpoint under a step's name. A checkpoint is only written for a
finite loss, so the last one is always good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import traceback
import uuid

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from train.errors import DISK_FULL_TEXT


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Only critical records from logger `name` inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def first_non_finite(tree) -> str | None:
    """The path of the first floating-point array of `tree` that holds a NaN or an
    infinity, None where none does; arrays in host memory (an offloaded optimizer
    state) are not read. One compiled reduction over the arrays, each device its part."""
    leaves = [
        (path, x)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if isinstance(x, jax.Array)
        and jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
        and x.sharding.memory_kind in (None, "device")
    ]
    if not leaves:
        return None
    check = jax.jit(lambda xs: jax.numpy.stack([jax.numpy.isfinite(x).all() for x in xs]))
    finite = jax.device_get(check([x for _, x in leaves]))
    bad = [
        jax.tree_util.keystr(path) for (path, _), ok in zip(leaves, finite, strict=True) if not ok
    ]
    return bad[0] if bad else None


def _root_cause(e: BaseException, width: int = 300) -> str:
    """The innermost cause of `e` as `Type: first line`, cut to `width` characters (the
    outer ones only wrap it; TensorStore appends a dump of its spec)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).split("See full TensorStore details")[0].strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": .")
    return line if len(line) <= width else line[: width - 3] + "..."


class _Notes(logging.Filter):
    """Drops the log records whose message holds one of `phrases`."""

    def __init__(self, *phrases: str):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:  # and its traceback's
            text += "".join(traceback.format_exception(record.exc_info[1]))
        return not any(phrase in text for phrase in self.phrases)


# Orbax's two warnings that a manager opened read only is read only: they read as a
# problem with a directory that is writable and asked for read-only.
READ_ONLY_NOTES = ("read_only=True, setting save_interval_steps", "is read only=")
# Orbax's warning on a checkpoint directory without its metadata (empty, or cut off),
# logged from its threads as well: the trainer's error where such a checkpoint cannot be
# read names it and what to read instead. Dropped for the whole process (`Checkpoints`).
NO_METADATA = _Notes("Metadata file does not exist")
# A full disk under a save: orbax's threads log it with tracebacks, four times over, and
# the save's error reaches the trainer, which ends in one line (`train.errors.disk_error`).
# Dropped for the whole process (`Checkpoints`).
DISK_FULL = _Notes(DISK_FULL_TEXT)


@contextlib.contextmanager
def _quiet_orbax_notes(*phrases: str):
    """Drops orbax's warnings (absl's logger) that hold one of `phrases` in the block."""
    notes = _Notes(*phrases)
    logger = logging.getLogger("absl")
    logger.addFilter(notes)
    try:
        yield
    finally:
        logger.removeFilter(notes)


# Orbax's name for a save in progress, `<step>.orbax-checkpoint-tmp` (older versions
# append `-<timestamp>`): renamed to `<step>` when the save is complete, so one left
# behind is a save cut off by a kill.
PARTIAL_SAVE = re.compile(r"\d+\.orbax-checkpoint-tmp(-\d+)?")


# Where Orbax moves the checkpoints that `--save_total_limit` drops (`todelete_subdir`),
# and the names it is renamed to while a thread beside the training deletes it.
DELETED = ".deleted"
EMPTYING = ".deleted-emptying-"


def remove_partial_saves(output_dir: str) -> list[str]:
    """Deletes the directories of saves cut off in `<output_dir>/checkpoints` (orbax's
    temporary names only, nothing else there) and returns their names, sorted; and what
    a kill left of dropped checkpoints (`DELETED`). Called before the run writes a
    checkpoint, so none of them is a save in progress."""
    directory = os.path.join(output_dir, "checkpoints")
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(directory, name)
        if name == DELETED or name.startswith(EMPTYING):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if PARTIAL_SAVE.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(name)
    return removed


def _every_process_here() -> None:
    """A collective of every process of a multi-process run (each saves the same steps),
    before the wait for the save before: that save commits only when every process
    does, so with one process stopped the wait would hold until jax's heartbeat timeout
    (100 s, then a C++ abort); the collective fails at once there (gloo, on CPUs), and
    the run ends with its line. A process stopped during the wait is not seen."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jflash: checkpoint save")


class Checkpoints:
    """`<output_dir>/checkpoints`; `read_only` for another run's (nothing is created)."""

    def __init__(self, output_dir: str, save_total_limit: int | None, read_only: bool = False):
        self.directory = os.path.abspath(os.path.join(output_dir, "checkpoints"))
        self._read_only = read_only
        logging.getLogger("absl").addFilter(NO_METADATA)  # once: the same filter object
        logging.getLogger("absl").addFilter(DISK_FULL)
        if read_only and not os.path.isdir(self.directory):
            raise ValueError(f"--resume_from_checkpoint: {self.directory} does not exist")
        with _quiet_orbax_notes(*READ_ONLY_NOTES) if read_only else contextlib.nullcontext():
            options = ocp.CheckpointManagerOptions(
                max_to_keep=save_total_limit,
                todelete_subdir=None if read_only else DELETED,
                enable_async_checkpointing=True,
                create=not read_only,
                read_only=read_only,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._emptying: threading.Thread | None = None

    def save(self, step: int, state, meta: dict, unless=None) -> bool:
        """Issues the (asynchronous) save of `step`, once the save before it is whole;
        False, and nothing issued, where `unless()` then says so (a stop asked
        meanwhile)."""
        _every_process_here()
        self.wait()  # as Orbax's save would: then what it dropped is deleted
        if unless is not None and unless():
            return False
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )
        if not saved:  # Orbax skips a step at or below its latest one: never silently
            raise RuntimeError(
                f"checkpoint {step} was not written to {self.directory} (latest there: "
                f"{self.latest_step()})"
            )
        return True

    def saving(self) -> bool:
        """Whether a save is still being written (asynchronously)."""
        return self._manager.is_saving_in_progress()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def meta(self, step: int) -> dict | None:
        """The meta record of `step` alone (what wrote it), read before the state;
        None where it cannot be read (`restore` then names the problem)."""
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception:  # noqa: BLE001 - restore() reports an unreadable checkpoint
            return None
        meta = restored["meta"]
        return meta if isinstance(meta, dict) and "step" in meta else None

    def param_shapes(self, step: int) -> dict[str, tuple[int, ...]] | None:
        """`{path: shape}` of the parameters saved at `step`, from the checkpoint's
        metadata (no array is read); None where it cannot be read (`restore` then names
        the problem)."""
        state = epath.Path(self.directory) / str(step) / "state"
        try:
            return shapes_by_path(ocp.StandardCheckpointHandler().metadata(state)["params"])
        except Exception:  # noqa: BLE001 - restore() reports an unreadable checkpoint
            return None

    def restore(self, step: int, abstract_state):
        """`(state, meta)` of `step`, placed with the shardings of `abstract_state`.

        Raises ValueError naming the checkpoint when it is missing or unreadable."""
        return self._restore(
            step,
            ocp.args.StandardRestore(abstract_state),
            lambda earlier: (
                f"--resume_from_checkpoint {os.path.join(self.directory, str(earlier))} "
                "(into a new --output_dir)"
            ),
        )

    def restore_params(self, step: int, abstract_params):
        """`(params, meta)` of `step`: only the `params` subtree of the saved state is
        read (the optimizer state, two or three times its size, stays on disk), placed
        with the shardings of `abstract_params` (whatever the mesh that saved it).

        Raises ValueError naming the checkpoint when it is missing or unreadable."""
        item = {"params": abstract_params}
        restore_args = jax.tree.map(
            lambda x: ocp.ArrayRestoreArgs(
                sharding=x.sharding, global_shape=x.shape, dtype=x.dtype
            ),
            item,
        )
        args = ocp.args.PyTreeRestore(item, restore_args=restore_args, partial_restore=True)
        state, meta = self._restore(step, args, lambda earlier: f"--step {earlier}")
        return state["params"], meta

    def _restore(self, step: int, state_args, advise):
        """`(state, meta)` of `step`, the state read with `state_args`; `advise(earlier)`
        words the advice to read the checkpoint `earlier` where `step` cannot be read."""
        steps = self.all_steps()
        if step not in steps:
            raise ValueError(f"no checkpoint {step} in {self.directory}; it has {steps}")
        where = os.path.join(self.directory, str(step))
        earlier = [s for s in steps if s < step]
        advice = f"; an earlier one: {advise(earlier[-1])}" if earlier else ""
        try:
            # A damaged checkpoint fails every array's read: asyncio logs each failed
            # task with its traceback (thousands of lines) before the error arrives.
            with _quiet_logger("asyncio"):
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonRestore()),
                )
        except Exception as e:  # noqa: BLE001 - any read failure: name the checkpoint
            raise ValueError(
                f"checkpoint {where} could not be restored, damaged or incomplete "
                f"({_root_cause(e)}){advice}"
            ) from e
        if not isinstance(restored["meta"], dict) or "step" not in restored["meta"]:
            raise ValueError(f"checkpoint {step} in {self.directory} has no valid meta")
        if (name := first_non_finite(restored["state"])) is not None:
            # The loop saves no non-finite step: such values are the files' damage,
            # which would otherwise surface steps later as a non-finite loss.
            raise ValueError(
                f"checkpoint {where} holds non-finite values ({name}), which no step saves: "
                f"its files are damaged{advice}"
            )
        return restored["state"], restored["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()
        self._empty_deleted()

    def close(self, wait_s: float | None = None) -> bool:
        """Waits for the save in flight, then closes. With `wait_s`, takes at most that
        long: a save still in flight then is left (False), for a process about to end
        whose save may never commit (a multi-process save commits at a barrier of every
        process); what it wrote is removed at the next start (`remove_partial_saves`)."""
        if wait_s is None:
            self._close()
            return True
        failed: list[BaseException] = []

        def close() -> None:
            try:
                self._close()
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller
                failed.append(e)

        closing = threading.Thread(target=close, name="checkpoint-close", daemon=True)
        closing.start()
        closing.join(wait_s)
        if closing.is_alive():
            return False
        if failed:
            raise failed[0]
        return True

    def _close(self) -> None:
        self.wait()
        self._manager.close()
        self._join_emptying()

    def _empty_deleted(self) -> None:
        """Deletes the checkpoints Orbax has dropped (`DELETED`; its primary process's)
        in a thread, so that the training goes on meanwhile (a checkpoint of a large
        model takes seconds to delete): `DELETED` is renamed first, for Orbax's next
        drops, and one deletion runs at a time; `close` waits for the last. What a kill
        leaves of one is removed when a run next starts there (`remove_partial_saves`)."""
        src = os.path.join(self.directory, DELETED)
        if self._read_only or jax.process_index() != 0 or not os.path.isdir(src):
            return
        self._join_emptying()
        dst = os.path.join(self.directory, f"{EMPTYING}{uuid.uuid4().hex[:8]}")
        os.rename(src, dst)
        self._emptying = threading.Thread(
            target=shutil.rmtree, args=(dst,), kwargs={"ignore_errors": True}, daemon=True
        )
        self._emptying.start()

    def _join_emptying(self) -> None:
        if self._emptying is not None:
            self._emptying.join()
            self._emptying = None


def shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
    """`{"['layers']['mlp']...": shape}` of a tree of arrays (or of their metadata)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in leaves}


def other_params(saved: dict | None, params) -> str | None:
    """Where a checkpoint's parameter shapes (`Checkpoints.param_shapes`; None: unknown)
    differ from those of `params`: `"<path>: <shape> there, <shape>"` for the first
    path in order (`absent` on the side that lacks it), to which the caller adds where
    the second shape comes from; None where they are the same."""
    if saved is None:
        return None
    now = shapes_by_path(params)
    differ = [k for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
    if not differ:
        return None
    k = differ[0]
    return f"{k}: {saved.get(k, 'absent')} there, {now.get(k, 'absent')}"


RESUME_OFF = ("false", "no", "none")  # --resume_from_checkpoint: start from step 0
RESUME_LATEST = ("latest", "true", "yes")  # this run's own latest checkpoint


def resumes(value: str | None) -> bool:
    """Whether a `--resume_from_checkpoint` value starts from a checkpoint (or, `auto`,
    may)."""
    return bool(value) and value.lower() not in RESUME_OFF


def resume_path(value: str | None) -> str | None:
    """The directory a `--resume_from_checkpoint` value names, None where it names none
    (off, `latest`, `auto`: the run's own `--output_dir`)."""
    if not value or value.lower() in (*RESUME_OFF, *RESUME_LATEST, "auto"):
        return None
    return value


def resolve_resume(value: str | None, output_dir: str) -> tuple[str, int | None] | None:
    """`--resume_from_checkpoint` -> `(output_dir to read, step or None=latest)`.

    Accepts "latest"/"true" (this run's own checkpoints), a `.../checkpoints` directory,
    or one step directory `.../checkpoints/<step>`.
    """
    if not resumes(value):
        return None
    if value.lower() in RESUME_LATEST:
        return output_dir, None
    path = os.path.abspath(value.rstrip("/"))
    base = os.path.basename(path)
    if base.isdigit() and os.path.basename(os.path.dirname(path)) == "checkpoints":
        if not os.path.isdir(path):
            # A relative path is the working directory's; the run's own is likelier meant.
            own = os.path.join(output_dir, value)
            hint = (
                f" (its --output_dir has {own}: give that path)"
                if not os.path.isabs(value) and os.path.isdir(own)
                else ""
            )
            there = os.path.dirname(path)
            steps = (
                sorted(int(n) for n in os.listdir(there) if n.isdigit())
                if (not hint and os.path.isdir(there))
                else []
            )
            if steps:
                hint = f" (the steps there: {', '.join(map(str, steps))})"
            raise ValueError(f"--resume_from_checkpoint={value!r}: {path} does not exist{hint}")
        return os.path.dirname(os.path.dirname(path)), int(base)
    if base == "checkpoints":
        return os.path.dirname(path), None
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return path, None
    missing = f"{path} does not exist, so it is " if not os.path.exists(path) else ""
    raise ValueError(
        f"--resume_from_checkpoint={value!r}: {missing}not 'latest', 'auto', a run's "
        "--output_dir, a checkpoints directory or a checkpoints/<step> directory"
    )
