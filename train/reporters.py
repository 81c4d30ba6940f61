"""Where the training scalars go (`--report_to`): TensorBoard event files (written here,
no TensorFlow), Weights & Biases (an optional import), or nowhere. Only process 0
reports; the JSONL log is written whatever `--report_to` says."""

from __future__ import annotations

import dataclasses
import importlib
import os
import uuid
from collections.abc import Mapping
from typing import Any

from train.config import TrainConfig
from train.errors import TrainingError
from train.tensorboard import SummaryWriter

INSTALL_WANDB = "pip install 'jflash[wandb]' (or pip install wandb)"


def destinations(report_to: str) -> tuple[str, ...]:
    """`"tensorboard,wandb"` -> `("tensorboard", "wandb")`; `"none"` -> `()`."""
    return () if report_to == "none" else tuple(report_to.split(","))


def import_wandb() -> Any:
    """The `wandb` module, or a one-line error saying how to install it."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise TrainingError(
            f"--report_to wandb needs the wandb package, which is not installed: {INSTALL_WANDB}"
        ) from None


def check(report_to: str) -> None:
    """Refuses a destination that cannot work, before the run touches its directory."""
    if "wandb" in destinations(report_to):
        import_wandb()


# The wandb run of an output directory, kept there: a resume logs into the same run.
WANDB_ID_FILE = os.path.join("wandb", "jflash_run_id")


def _read_id(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


class WandbWriter:
    """`SummaryWriter`'s interface over a wandb run (`WANDB_PROJECT`, default "jflash";
    `WANDB_MODE=offline` keeps everything under `<output_dir>/wandb` with no network).
    One run per output directory: its id is kept in `<output_dir>/wandb/jflash_run_id`,
    and a resume continues that run (wandb skips the steps it has already, those a
    kill left logged past the checkpoint); `WANDB_RUN_ID` set picks the run instead.
    `--overwrite_output_dir` sets the old id aside with the old run: a new wandb run."""

    def __init__(self, out: str, cfg: TrainConfig):
        self._wandb = import_wandb()
        path = os.path.join(out, WANDB_ID_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.environ.get("WANDB_RUN_ID"):  # the user's choice, which wandb reads
            ids = {}
        elif kept := _read_id(path):
            ids = {"id": kept, "resume": "allow"}
        else:
            ids = {"id": uuid.uuid4().hex[:12]}
        self._run = self._wandb.init(
            project=os.environ.get("WANDB_PROJECT", "jflash"),
            name=cfg.run.run_name or os.path.basename(os.path.abspath(out)),
            dir=out,
            config=dataclasses.asdict(cfg),
            **ids,
        )
        if "id" in ids and "resume" not in ids:
            with open(path, "w") as f:
                f.write(ids["id"] + "\n")

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def flush(self) -> None:
        """wandb sends on its own schedule; nothing to do."""

    def close(self) -> None:
        self._run.finish()


class Reporters:
    """Every destination of `--report_to` behind one `scalars / flush / close`."""

    def __init__(self, writers: list):
        self._writers = writers

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        for w in self._writers:
            w.scalars(values, step)

    def flush(self) -> None:
        for w in self._writers:
            w.flush()

    def close(self) -> None:
        for w in self._writers:
            w.close()


def open_reporters(cfg: TrainConfig) -> Reporters | None:
    """The writers of `--report_to` under `--output_dir`; None when it is `none`."""
    out = cfg.run.output_dir
    writers: list = []
    for name in destinations(cfg.run.report_to):
        if name == "tensorboard":
            writers.append(SummaryWriter(os.path.join(out, "tensorboard")))
        else:
            writers.append(WandbWriter(out, cfg))
    return Reporters(writers) if writers else None
