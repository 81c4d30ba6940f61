"""The files that mark a training run's output directory: what `train.outputs` writes
there, and what a data folder's walk (`train.readers`) leaves out."""

from __future__ import annotations

from pathlib import Path

# The run's resolved settings, every field of every section: `--config` reads it back.
SETTINGS_FILE = "train_config.yaml"
# The run's metrics, a line a step (what a data folder or pattern must not read).
LOG_FILE = "log.jsonl"


def is_run_output(path: str | Path) -> bool:
    """Whether ``path`` is a training run's output directory: its settings file
    (``train_config.yaml``) beside its metrics (``log.jsonl``, no data)."""
    return (Path(path) / SETTINGS_FILE).is_file() and (Path(path) / LOG_FILE).is_file()
