"""`python -m train.tools.gradcheck`: one step's gradients under several layouts, per parameter.

    python -m train.tools.gradcheck --config configs/llama3_2_1b_32k.yaml \\
        --model_max_length 32768 --data_path data.npy \\
        --layout "--mesh data=1,fsdp=1,seq=1" \\
        --layout "--mesh data=1,fsdp=1,seq=2 --shard_over_seq false --gather_once false" \\
        --layout "--mesh data=1,fsdp=1,seq=2 --shard_over_seq true --gather_once true"

Every layout starts from the same parameters (one random initialisation) and takes the
same batch (step 0): only how the step is split over devices differs, so the gradients
should agree to rounding. The first layout is the reference; make it an f32 one (`--bf16 false`) to
tell rounding from a bug: in bf16 some gradients move between layouts far more than the
loss does (Llama-3.2-1B's tied embedding by 5-14%; BENCHMARKS.md, trainer),
while in f32 every layout agrees to ~1e-4. For each other layout it prints the loss,
the gradient norm, and the parameters whose gradients differ most from the
reference's (L2 norm of the difference ÷ the reference's norm); `--out` writes all of it
as JSON (an `--out` that cannot be written, that exists without `--overwrite`, or that
is a file of the model directory, is refused before the first layout). Layouts whose
model, seed or data flags differ from the reference's are refused before any runs. Flags
other than `--layout`, `--top` and `--out` go to every layout's trainer configuration
(`python -m train --help`); a layout's own flags come last and win. Nothing
is trained or saved: `--output_dir` is a temporary directory. `--data_path` is required
as in the trainer (`--data_path sample` for made-up data, the same for every layout).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile

import numpy as np

from train.tools.files import out_error, refuse, write_json


def _tree_paths(tree) -> dict[str, np.ndarray]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf, np.float32) for path, leaf in flat}


def layout_gradients(argv: list[str]) -> dict:
    """`{"loss", "tokens", "rows", "grads"}` of step 0 for trainer flags `argv`, on as
    many local devices as its `--mesh` needs; `grads` maps parameter paths to host
    arrays."""
    import functools

    import jax

    from train.build import build
    from train.config import parse_args
    from train.mesh import mesh_device_count
    from train.step import gradients

    cfg = parse_args(argv)
    devices = jax.devices()[: mesh_device_count(cfg.parallel.mesh, jax.device_count())]
    trainer = build(cfg, devices=devices)
    step = jax.jit(functools.partial(gradients, spec=trainer.spec))
    with jax.set_mesh(trainer.mesh):
        grads, (loss, count) = step(trainer.state["params"], trainer.batch(0))
    return {
        "loss": float(loss),
        "tokens": int(count),
        "rows": trainer.global_batch * trainer.accum,
        "grads": _tree_paths(grads),
    }


def compare(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> list[dict]:
    """Per parameter: the two gradients' norms and their relative L2 difference,
    largest difference first."""
    if reference.keys() != other.keys():
        raise ValueError(
            f"the layouts have different parameters: {sorted(reference.keys() ^ other.keys())}"
        )
    rows = []
    for path, ref in reference.items():
        got = other[path]
        ref_norm = float(np.linalg.norm(ref))
        diff = float(np.linalg.norm(got.astype(np.float64) - ref))
        rows.append(
            {
                "param": path,
                "reference_norm": ref_norm,
                "norm": float(np.linalg.norm(got)),
                "rel_diff": diff / ref_norm if ref_norm else (0.0 if diff == 0 else float("inf")),
            }
        )
    return sorted(rows, key=lambda r: -r["rel_diff"])


def global_norm(grads: dict[str, np.ndarray]) -> float:
    return float(
        np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
    )


def build_parser() -> argparse.ArgumentParser:
    from train.config import OneLineParser  # errors in one line, as the trainer's

    p = OneLineParser(
        prog="python -m train.tools.gradcheck",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags are trainer flags, shared by every layout.",
    )
    p.add_argument(
        "--layout",
        action="append",
        required=True,
        help="trainer flags of one layout, quoted (repeat; the first is the reference)",
    )
    p.add_argument("--top", type=int, default=10, help="parameters listed per layout")
    p.add_argument("--overwrite", action="store_true", help="replace a file already at --out")
    p.add_argument(
        "--out",
        default="",
        help="write the comparison as JSON here (its directory must exist and be writable)",
    )
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    """`python -m train.tools.gradcheck`: a stop (Ctrl-C, SIGTERM) ends it in one line."""
    from train.errors import until_stopped

    return until_stopped(lambda: _compare(argv), "no comparison was written")


def _compare(argv: list[str] | None) -> list[dict]:
    parser = build_parser()
    args, common = parser.parse_known_args(argv)
    if len(args.layout) < 2:
        parser.error(f"need at least 2 --layout to compare, got {len(args.layout)}")
    if args.top < 0:
        parser.error(f"--top={args.top} must be >= 0")
    layouts = _layout_flags(args.layout, common)
    from train.config import parse_args

    if args.out:  # not a file of the model directory it reads
        model = parse_args([*common, "--output_dir", "unused"]).model.model_name_or_path
        inputs = [os.path.join(model, f) for f in os.listdir(model)] if os.path.isdir(model) else []
        if error := out_error(args.out, overwrite=args.overwrite, inputs=inputs):
            refuse(error)
    import jax

    from train.errors import USER_ERRORS

    if jax.process_count() > 1:
        parser.error("runs in one process (it copies every gradient to the host)")
    results = []
    # One scratch --output_dir for every layout (nothing is written there).
    with tempfile.TemporaryDirectory(prefix="jflash-gradcheck-") as work:
        reference = None
        for layout, flags in layouts.items():
            flags = [*common, "--output_dir", work, *flags]
            try:
                got = layout_gradients(flags)
            except USER_ERRORS as e:
                refuse(f"layout {layout!r}: {e}")
            row = {
                "layout": layout,
                "loss": got["loss"],
                "tokens": got["tokens"],
                "grad_norm": global_norm(got["grads"]),
            }
            if reference is None:
                reference = got
            else:  # the same batch: `_layout_flags` compared the flags that make it
                params = compare(reference["grads"], got["grads"])
                row["params"] = params
                row["max_rel_diff"] = params[0]["rel_diff"] if params else 0.0
            results.append(row)
            _print(row, results[0], args.top)
            del got
    if args.out:
        write_json(args.out, results, "--out")
        print(f"wrote {args.out}")
    return results


def _layout_flags(layouts: list[str], common: list[str]) -> dict[str, list[str]]:
    """Each `--layout`'s trainer flags, every one read and its mesh counted before any
    layout runs: a bad second layout fails at once, not after the reference's run."""
    import jax

    from train.config import parse_args
    from train.mesh import mesh_device_count, parse_mesh

    out, reference = {}, None
    for layout in layouts:
        try:
            flags = shlex.split(layout)  # an unbalanced quote: ValueError
            cfg = parse_args([*common, "--output_dir", "unused", *flags])
            count = mesh_device_count(cfg.parallel.mesh, jax.device_count())
            sizes = parse_mesh(cfg.parallel.mesh, count, fsdp=bool(cfg.parallel.fsdp))
        except ValueError as e:
            refuse(f"layout {layout!r}: {e} (nothing was run)")
        # The rows of one step, as the trainer's `global_batch` x accumulation.
        run = cfg.run
        rows = run.per_device_train_batch_size * sizes["data"] * sizes["fsdp"]
        rows *= run.gradient_accumulation_steps
        shared = _shared_settings(cfg)
        reference = reference or (shared, rows)
        if different := [name for name, value in shared.items() if value != reference[0][name]]:
            name = different[0]
            refuse(
                f"layout {layout!r}: --{name} {shared[name]!r}, the reference's "
                f"{reference[0][name]!r}: every layout starts from the same parameters and "
                "takes the same batch, so only its split over devices may differ "
                "(nothing was run)"
            )
        if rows != reference[1]:
            refuse(
                f"layout {layout!r}: takes {rows} rows per step, the reference's "
                f"{reference[1]}: give every layout the same global batch (data x "
                "fsdp x --per_device_train_batch_size x accumulation) (nothing was run)"
            )
        out[layout] = flags
    return out


def _shared_settings(cfg) -> dict:
    """The trainer flags every layout must share: the model (its initialisation), the
    seed, and every data flag (the batch)."""
    import dataclasses

    model = ("model_name_or_path", "rope_theta", "rope_scaling")
    return {
        **{name: getattr(cfg.model, name) for name in model},
        "seed": cfg.run.seed,
        **{f.name: getattr(cfg.data, f.name) for f in dataclasses.fields(cfg.data)},
    }


def _print(row: dict, reference: dict, top: int) -> None:
    print(f"== {row['layout']}")
    print(f"   loss {row['loss']:.6f}, gradient norm {row['grad_norm']:.6f}", end="")
    if row is reference:
        print(" (reference)")
        return
    rel = row["grad_norm"] / reference["grad_norm"] - 1 if reference["grad_norm"] else 0.0
    print(f" ({rel:+.3%} against the reference)")
    for p in row["params"][:top]:
        print(
            f"   {p['rel_diff']:10.3e}  {p['param']}  (norm {p['norm']:.4g}, "
            f"reference {p['reference_norm']:.4g})"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
