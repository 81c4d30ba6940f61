"""jflash trainer: configuration, data, training loop, checkpoints, metrics."""

import importlib.util as _util
import os as _os
import sys as _sys


def _as_command() -> bool:
    """Started as a command (`python -m train...`, `jflash-train`), not imported by a
    program: a fault is then its one line, not an ImportError's traceback."""
    return _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] or "") == "jflash-train"


def _check_models_package() -> None:
    """The trainer imports jflash's `models`, installed beside it; a `models` folder of
    the working directory (Python imports it first) would fail deep inside an import."""
    spec = _util.find_spec("models")
    beside = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    places = list(spec.submodule_search_locations or []) if spec else []
    if not any(_os.path.dirname(_os.path.abspath(p)) == beside for p in places[:1]):
        found = places[0] if places else (spec.origin if spec else None)
        words = (
            f"jflash's trainer needs jflash's package 'models' (in {beside}), but 'models' "
            f"is {found}, which comes first on sys.path; run the command from another "
            "directory (the trainer itself: jflash-train runs from anywhere)"
        )
        if _as_command():
            raise SystemExit(f"error: {words}")
        raise ImportError(words)


# The `train` extra: module -> its distribution's name (`import jflash` needs none).
_TRAIN_EXTRA = {
    "flax": "flax",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
    "etils": "etils",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
    "ml_dtypes": "ml_dtypes",
}


def _check_train_extra() -> None:
    missing = [dist for module, dist in _TRAIN_EXTRA.items() if _util.find_spec(module) is None]
    if missing:
        words = (
            f"jflash's trainer needs {', '.join(missing)}, not installed: "
            "pip install 'jflash[train]'"
        )
        if _as_command():
            raise SystemExit(f"error: {words}")
        raise ImportError(words)


_check_train_extra()
_check_models_package()
