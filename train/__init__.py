"""jflash trainer: configuration, data, training loop, checkpoints, metrics."""

import importlib.util as _util
import os as _os


def _check_models_package() -> None:
    """The trainer imports jflash's `models`, installed beside it; a `models` folder of
    the working directory (Python imports it first) would fail deep inside an import."""
    spec = _util.find_spec("models")
    beside = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    places = list(spec.submodule_search_locations or []) if spec else []
    if not any(_os.path.dirname(_os.path.abspath(p)) == beside for p in places[:1]):
        found = places[0] if places else "nowhere"
        raise ImportError(
            f"jflash's trainer needs jflash's package 'models' (in {beside}), but 'models' "
            f"is {found}: a folder there comes first on sys.path; run jflash-train, or "
            "from another directory"
        )


_check_models_package()
