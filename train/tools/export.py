"""`python -m train.tools.export RUN_DIR --out DIR`: one saved checkpoint of a run as an
HF directory, the one the run's end-of-run export (`<output_dir>/hf`) would be had the
run ended at that step.

    python -m train.tools.export RUN_DIR --out DIR [--step N | --step latest]
        [--dtype float32|bfloat16|float16] [--max-shard-gb N] [--overwrite]

RUN_DIR is a run's `--output_dir`: its `train_config.yaml` gives the model and the
tokenizer (the model's config as the run built it, with the EOS it packed documents
with: `train.build.export_config`; the tokenizer's files as the run copied them into
its `tokenizer/`, and the run's `--chat_template` in place of the tokenizer's template,
as the run saved it in its `chat_template/`, so that a tokenizer or template edited or
moved since changes nothing), its `checkpoints/<step>` the weights. Only the
checkpoint's parameters are read (not the optimizer state), onto the host CPU, whatever
mesh saved them. The run's outputs are only read: an `--out` inside them (RUN_DIR
itself, its `checkpoints/`, `hf/`, ...) is always refused; a new folder beside them is
taken; another run's output directory is refused. An `--out` that already holds a model
(its config, weights or tokenizer files) is refused unless `--overwrite` is given. The
export is written whole into a staging folder in `--out` before it replaces anything
there: one cut off leaves the model that was there as it was.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid

import jax
import numpy as np

import models
from models.config import DTYPES
from models.convert import (
    TOKENIZER_FILES,
    remove_other_tokenizer_files,
    remove_other_weights,
    replace_refusal,
    replaced_files,
    shard_bytes,
    shard_gb_error,
)
from train import outputs
from train.build import chat_templates, export_config, model_config
from train.checkpoint import Checkpoints, other_params
from train.config import OneLineParser, from_overrides, load_yaml
from train.errors import (
    STOP_SIGNALS,
    TrainingError,
    signals_as_interrupts,
    stop_status,
    stopped_how,
)
from train.run_files import is_run_output


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="python -m train.tools.export",
        description="Export one saved checkpoint of a run as an HF directory.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's --output_dir")
    p.add_argument("--out", required=True, metavar="DIR", help="the HF directory to write")
    p.add_argument(
        "--step", default="latest", help="the checkpoint's step, or latest (default: latest)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="dtype of the written tensors (default float32, as the run's own export)",
    )
    p.add_argument(
        "--max-shard-gb",
        type=float,
        default=None,
        help="split the weights into shards of at most this many GB (default: one file)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model and tokenizer files already in --out",
    )
    return p


# The files an export writes into `--out` or, with `--overwrite`, removes there: the
# config, and every tokenizer file (the run's are copied in, another model's dropped);
# the weight files are `replaced_files`'s.
WRITTEN = ("config.json", *TOKENIZER_FILES)


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory + os.sep)


def _check_out(run_dir: str, out: str, overwrite: bool) -> None:
    """Refuses an `--out` that is a file, the run's directory or inside its outputs (the
    export never writes into the run), or that holds a model, without `overwrite`."""
    if not out.strip():
        raise TrainingError(f"--out={out!r} is empty: give the directory to write")
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out={out!r} is a file, not a directory")
    if os.path.realpath(out) == os.path.realpath(run_dir):
        raise TrainingError(
            f"--out={out!r} is the run directory itself ({run_dir!r}), which the export only reads"
        )
    for name in outputs.RUN_OUTPUTS:
        if _inside(out, os.path.join(run_dir, name)):
            raise TrainingError(
                f"--out={out!r} lies in the run's {os.path.join(run_dir, name)}, which the "
                "export only reads: choose a directory outside the run's outputs"
            )
    if is_run_output(out):  # its checkpoints and logs beside another model's files
        raise TrainingError(
            f"--out={out!r} is another training run's output directory: give a directory "
            "of its own for the export"
        )
    held = [] if overwrite else replaced_files(out, WRITTEN, weights=True)
    if held:
        raise TrainingError(replace_refusal(out, held, "the export"))
    outputs.check_writable(out, "--out")


def _settings(run_dir: str):
    """The run's `TrainConfig`, from its `train_config.yaml`."""
    path = os.path.join(run_dir, outputs.SETTINGS_FILE)
    if not os.path.isdir(run_dir):
        raise TrainingError(f"RUN_DIR={run_dir!r} is not a directory")
    if not os.path.isfile(path):
        raise TrainingError(
            f"RUN_DIR={run_dir!r} is not a run's --output_dir: it has no {outputs.SETTINGS_FILE}"
        )
    try:
        return from_overrides(load_yaml(path), {}, where=path)
    except (ValueError, TypeError) as e:
        raise TrainingError(f"{path}: not the settings of a run this trainer reads ({e})") from None


def _step(value: str, checkpoints: Checkpoints) -> int:
    """`--step`: `latest`, or one of the saved steps."""
    steps = checkpoints.all_steps()
    if not steps:
        raise TrainingError(f"no checkpoint in {checkpoints.directory}")
    if value == "latest":
        return steps[-1]
    if not value.isdigit() or int(value) not in steps:
        raise TrainingError(
            f"--step={value!r}: no such checkpoint in {checkpoints.directory}; it has "
            f"{', '.join(map(str, steps))} (or latest)"
        )
    return int(value)


def export(
    run_dir: str,
    out: str,
    step: str = "latest",
    *,
    dtype: str = "float32",
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> tuple[int, int]:
    """Writes checkpoint `step` (a step, or "latest") of the run in `run_dir` as an HF
    directory `out`, with the run's tokenizer; returns `(step, parameter count)`.

    Raises TrainingError (one line, naming the value) where `run_dir` is no run's
    directory, `step` is not saved there, the checkpoint cannot be read, or `out` cannot
    take the export (see `_check_out`)."""
    if dtype not in DTYPES:
        raise TrainingError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    # The run's copy of its tokenizer, where it has one, for the EOS and the files.
    cfg, tokenizer = outputs.with_run_tokenizer(_settings(run_dir), run_dir)
    _check_out(run_dir, out, overwrite)
    if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise TrainingError(f"RUN_DIR={run_dir!r} has no checkpoints/ (the run saved none)")
    # The run's model config as it built it (its copy, where it has one), and what its
    # own export changes there.
    try:
        config = export_config(cfg, model_config(cfg, outputs.run_model_config(run_dir)))
        # --chat_template's, which the export carries: as the run saved them (where the
        # run directory holds no copy: the file, read now).
        templates = outputs.run_chat_templates(run_dir) or chat_templates(cfg)
    except TrainingError as e:  # the model, tokenizer or chat template the run read is gone
        raise TrainingError(f"{os.path.join(run_dir, outputs.SETTINGS_FILE)}: {e}") from None
    checkpoints = Checkpoints(run_dir, None, read_only=True)
    try:
        chosen = _step(step, checkpoints)
        abstract = models.abstract_params(config)
        if differ := other_params(checkpoints.param_shapes(chosen), abstract):
            raise TrainingError(
                f"checkpoint {chosen} in {checkpoints.directory} holds another model's "
                f"parameters ({differ} in the run's "
                f"--model_name_or_path={cfg.model.model_name_or_path!r} now)"
            )
        cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), abstract
        )
        try:
            params, _ = checkpoints.restore_params(chosen, abstract)
        except ValueError as e:
            raise TrainingError(str(e)) from None
    finally:
        checkpoints.close()
    params = jax.tree.map(np.asarray, params)
    # The whole export is written into a staging folder inside `out` first; only then
    # does it replace what `out` holds (`_publish`): an export cut off while writing
    # leaves the model that was there whole (and the staging folder, which the next
    # export removes), never a directory that loads as no model or a mixed one.
    os.makedirs(out, exist_ok=True)
    _remove_stale_staging(out)
    staging = os.path.join(out, f"{STAGING}{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(staging)
        outputs.copy_tokenizer(tokenizer, staging, templates, eos_token_id=config.eos_token_id)
        try:
            models.export_hf(params, config, staging, dtype=dtype, max_shard_bytes=max_shard_bytes)
        except ValueError as e:  # a weight --dtype cannot hold
            raise TrainingError(f"checkpoint {chosen}: {e}") from None
        # Moments of renames; a stop asked meanwhile is dropped: the export is whole.
        with outputs.signals_held(reraise=False, signals=(signal.SIGINT, *STOP_SIGNALS)):
            _publish(staging, out, outputs.tokenizer_files(tokenizer, templates))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return chosen, sum(int(np.size(x)) for x in jax.tree.leaves(params))


# The folder inside `--out` an export is written into before it replaces `--out`'s files.
STAGING = ".export-staging-"


def _remove_stale_staging(out: str) -> None:
    """Removes the staging folders an export killed part way left in `out`."""
    for name in os.listdir(out):
        if name.startswith(STAGING) and os.path.isdir(os.path.join(out, name)):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


def _publish(staging: str, out: str, tokenizer_files: list[str]) -> None:
    """Moves the whole export in `staging` into `out`: the `config.json` there (which
    marks a whole model) goes first, then every new file but the config replaces its
    name, another model's tokenizer and weight files are removed, and the new
    `config.json` comes last. Renames within one filesystem: moments, not the write."""
    written = sorted(
        os.path.relpath(os.path.join(root, name), staging)
        for root, _, names in os.walk(staging)
        for name in names
    )
    if os.path.lexists(os.path.join(out, "config.json")):
        os.remove(os.path.join(out, "config.json"))
    for name in written:
        if name != "config.json":
            os.makedirs(os.path.dirname(os.path.join(out, name)) or out, exist_ok=True)
            os.replace(os.path.join(staging, name), os.path.join(out, name))
    remove_other_tokenizer_files(out, tokenizer_files)  # another model's (--overwrite)
    remove_other_weights(out, set(written))
    os.replace(os.path.join(staging, "config.json"), os.path.join(out, "config.json"))


def kept(out: str) -> str:
    """What an export stopped before it was moved into place leaves in `out`."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return f"{out} holds the model it held before"
    return f"nothing was exported to {out}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if error := shard_gb_error(args.max_shard_gb):
        parser.error(error)
    try:
        with signals_as_interrupts():  # SIGTERM and SIGHUP end it as Ctrl-C does
            step, count = export(
                args.run_dir,
                args.out,
                args.step,
                dtype=args.dtype,
                max_shard_bytes=shard_bytes(args.max_shard_gb),
                overwrite=args.overwrite,
            )
    except KeyboardInterrupt as e:  # before the export was moved into place
        print(f"{stopped_how(e)}: the export was not finished; {kept(args.out)}", file=sys.stderr)
        sys.stdout.flush()
        sys.exit(stop_status(e))
    except TrainingError as e:
        parser.exit(2, f"error: {e}\n")
    except OSError as e:  # a full disk, a file size limit: which file, and which flag
        where = str(e.filename) if e.filename else args.out
        if e.filename and _inside(where, args.run_dir) and not _inside(where, args.out):
            what = f"RUN_DIR: cannot read {where}"
        else:
            what = f"--out: cannot write {where}"
        parser.exit(1, f"error: {what} ({e.strerror or e})\n")
    print(
        f"exported checkpoint {step} of {args.run_dir} -> {args.out}: {count:,} parameters, "
        f"{args.dtype}"
    )
    return 0


if __name__ == "__main__":
    # The export reads and writes on the host: it leaves any accelerator (perhaps
    # training this run) alone.
    jax.config.update("jax_platforms", "cpu")
    sys.exit(main())
