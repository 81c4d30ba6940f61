"""The longest context a training step fits in, per model and mesh:
`python -m train.tools.capacity`.

    python -m train.tools.capacity --models llama3.2-1b --mesh seq=1 --mesh seq=2
    python -m train.tools.capacity --models llama2-7b --mesh seq=2 --shard-over-seq --start 16k

For each model x mesh the trainer's own step (`train.build.plan_step`: the same mesh,
shardings, remat policy and ring attention as `python -m train`) is compiled on abstract
state, never run, and XLA's memory analysis (arguments + outputs + temporaries -
aliased, per device) is compared with the device's allocator limit (or `--limit-gib`).
The context doubles from `--start` until a step does not fit, then bisects `--refine`
times; a search that reaches `--max` with every probe fitting reports a lower bound (`≥
N (reached --max)`, `"capped_by_max": true` in the JSON). A `--start` that a mesh's
sequence axes do not divide, an `--mlp-tile` that does not divide its share, and an
`--out` that is a directory, lies under a file, exists (without `--overwrite`) or is a
file of a model directory it reads, are refused before anything compiles; the rows so
far go to `--out.partial` after every probe, and `--out` once the search ends.
`--ring-strategy` is the trainer's (`auto` resolved as it resolves it; each row records
the one it ran). The long-context knobs are the
trainer's: `--mlp-tile`, `--remat offload_attn` / `offload_full` (residuals in pinned
host memory) and `--optimizer-offload`; a step fits when its device bytes fit the device
and its host bytes (offloaded residuals and state) fit `--host-limit-gib`. "GiB/1k
tokens" is the growth per 1024 tokens of context between the shortest and the longest
probe that fit (the marginal cost: what one more 1k tokens needs), device and host. A
mesh naming fewer devices than the machine has uses the first ones, so `--mesh seq=1
--mesh seq=2` answers "how much longer on 2 GPUs than on 1" (a line under the table says
how to train such a row: the trainer's mesh takes every visible device).

Compiled memory is XLA's plan, not a run: check the winner with `python -m train`.

    python -m train.tools.capacity plot RESULT.json [RESULT.json ...] --out memory.png
    python -m train.tools.capacity plot capacity.json --measured runs/1b-512k --out memory.png

draws the probes of capacity results (one `--out` file each, or a list of them as
`benchmarks/long_context.sh` gathers) against the context: one panel per model, per remat
policy a solid line of device GiB and a dashed line of host GiB, an x where a probe does
not fit, a > on the longest probe of a search that reached `--max`, the device limit as
a horizontal line. `--measured` adds a training run's
measured peak (`peak_memory_gib` in its output directory's log.jsonl, at the context and
remat policy of its train_config.yaml) as a star.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable

from models.attention import ATTENTION_KINDS
from models.config import REMAT_POLICIES
from train.config import ModelArgs
from train.oom import is_oom
from train.tools.files import out_error, write_json, write_whole

# Where a search's rows so far go, beside `--out`: `--out` is written once the search ends.
PARTIAL = ".partial"


def search_longest(
    fits_at: Callable[[int], dict],
    start: int,
    maximum: int,
    refine: int = 0,
    granule: int = 1,
    on_probe: Callable[[list[dict]], None] | None = None,
) -> tuple[int | None, list[dict]]:
    """The longest length `fits_at` accepts, and every probe made.

    Doubles from `start` until a length does not fit (or passes `maximum`), then
    bisects `refine` times between the last length that fit and the first that did
    not, on multiples of `granule`: the answer is within (1/2)**refine of the doubling
    interval instead of a power of two.

    Args:
      fits_at: `length -> {"fits": bool, ...}` (extra keys are kept in the probe).
      start, maximum: the first and the largest length tried.
      refine: bisection steps after the doubling.
      granule: every bisection length is a multiple of it.
      on_probe: called with the probes so far after each one.
    """
    probes: list[dict] = []

    def probe(length: int) -> bool:
        result = fits_at(length)
        probes.append({"seq": length, **result})
        if on_probe is not None:
            on_probe(probes)
        return bool(result["fits"])

    best, length, too_long = None, start, None
    while length <= maximum:
        if not probe(length):
            too_long = length
            break
        best, length = length, length * 2
    if best is not None and too_long is not None:
        lo, hi = best, too_long
        for _ in range(refine):
            mid = (lo + hi) // 2 // granule * granule
            if mid <= lo or mid >= hi:
                break
            if probe(mid):
                lo = mid
            else:
                hi = mid
        best = lo
    return best, probes


def _tokens(text: str) -> int:
    """`16k`, `1m`, `8192`: a context in tokens (argparse names the flag where it is
    not one)."""
    raw, text = text, text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(text[-1:], 1)
    try:
        value = float(text.rstrip("km")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not a number of tokens (e.g. 8192, 16k, 1m)"
        ) from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number of tokens")
    return int(value)


def host_bytes(compiled, abstract_state) -> tuple[int, bool]:
    """Per-device bytes one compiled step keeps in host memory: XLA's host-side sizes
    where the backend reports them (GPU); else (the CPU backend has one memory space
    and reports none) the stored state placed in pinned host memory, shard by shard.
    The flag says which: True when XLA reported it."""
    import jax

    mem = compiled.memory_analysis()
    reported = 0
    if mem is not None:
        reported = (
            getattr(mem, "host_argument_size_in_bytes", 0)
            + getattr(mem, "host_output_size_in_bytes", 0)
            + getattr(mem, "host_temp_size_in_bytes", 0)
            - getattr(mem, "host_alias_size_in_bytes", 0)
        )
    if reported:
        return reported, True
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and sharding.memory_kind == "pinned_host":
            total += math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total, False


def _trainer_config(model: str, context: int, mesh: str, args):
    """The trainer's settings for one probe: `model` at `context` tokens over `mesh`."""
    from train.config import parse_args

    return parse_args(
        [
            "--model_name_or_path",
            model,
            "--model_max_length",
            str(context),
            "--mesh",
            mesh,
            "--attention",
            args.attention,
            "--ring_strategy",
            args.ring_strategy,
            "--remat_policy",
            args.remat,
            "--per_device_train_batch_size",
            "1",
            "--shard_over_seq",
            str(args.shard_over_seq).lower(),
            "--gather_once",
            str(args.gather_once).lower(),
            "--optimizer_offload",
            str(args.optimizer_offload).lower(),
            "--scan_layers",
            str(not args.unroll_layers).lower(),
            *(["--mlp_tile", str(args.mlp_tile)] if args.mlp_tile is not None else []),
        ]
    )


def ring_strategy(model: str, context: int, mesh: str, args) -> str:
    """The strategy the trainer runs `model` with over `mesh` (`--ring-strategy`, `auto`
    resolved as the trainer resolves it)."""
    import jax

    from train.build import model_config, resolve_strategy
    from train.mesh import mesh_device_count, parse_mesh

    cfg = _trainer_config(model, context, mesh, args)
    count = mesh_device_count(mesh, jax.device_count())
    sizes = parse_mesh(mesh, count, fsdp=bool(cfg.parallel.fsdp))
    return resolve_strategy(
        cfg, model_config(cfg), sizes, jax.devices()[:count]
    ).model.ring_strategy


def layout_error(model: str, context: int, mesh: str, args) -> str | None:
    """Why the trainer's step cannot split `context` tokens over `mesh` (the trainer's own
    check, made before compiling: the sequence axes must divide the context), or None."""
    import jax

    from train.build import check_layout, model_config, resolve_strategy
    from train.errors import TrainingError
    from train.mesh import mesh_device_count, parse_mesh

    cfg = _trainer_config(model, context, mesh, args)
    count = mesh_device_count(mesh, jax.device_count())
    sizes = parse_mesh(mesh, count, fsdp=bool(cfg.parallel.fsdp))
    try:
        check_layout(resolve_strategy(cfg, model_config(cfg), sizes, jax.devices()[:count]), sizes)
    except TrainingError as e:
        return str(e)
    return None


def step_memory_gib(model: str, context: int, mesh: str, args) -> dict[str, float]:
    """Compiled per-device memory of one training step: `{"device", "host"}` GiB (the
    state kept in host memory is not counted on the device); raises if it won't compile."""
    import jax

    from train.build import model_config, plan_step
    from train.mesh import mesh_device_count
    from train.metrics import compiled_bytes

    cfg = _trainer_config(model, context, mesh, args)
    config = model_config(cfg)
    if args.layers:
        config = config.replace(num_layers=args.layers)
    devices = jax.devices()[: mesh_device_count(mesh, jax.device_count())]
    plan = plan_step(cfg, config, devices)
    global_batch = plan.sizes["data"] * plan.sizes["fsdp"]
    with jax.set_mesh(plan.mesh):
        batch = plan.abstract_batch(global_batch, 1, context)
        compiled = plan.step_fn.lower(plan.abstract_state, batch).compile()
    host, reported = host_bytes(compiled, plan.abstract_state)
    device = compiled_bytes(compiled)
    if not reported:  # one memory space (CPU): the host-placed state is in the device sizes
        device -= host
    return {"device": device / 2**30, "host": host / 2**30}


def device_limit_gib(override: float | None) -> float:
    import jax

    if override is not None:
        return override
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise SystemExit(
            f"{jax.devices()[0].platform}: the device reports no memory limit; pass --limit-gib"
        )
    return stats["bytes_limit"] / 2**30


# XLA's pinned host pool on GPUs (what offloaded residuals and optimizer state live in):
# `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB per process, 64 unless set.
HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
HOST_POOL_DEFAULT_GIB = 64


def host_limit_gib(override: float | None) -> float:
    """Host memory one device may use: `--host-limit-gib`, else the machine's physical
    memory, and on GPUs also XLA's pinned host pool (`HOST_POOL_ENV`), shared by the
    process's local devices."""
    import jax

    if override is not None:
        return override
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    if jax.default_backend() == "gpu":
        raw = os.environ.get(HOST_POOL_ENV, str(HOST_POOL_DEFAULT_GIB))
        try:
            pool = float(raw)
        except ValueError:
            raise SystemExit(f"{HOST_POOL_ENV}={raw!r} is not a number of GB") from None
        total = min(total, pool)
    return total / jax.local_device_count()


def per_1k_tokens(probes: list[dict], key: str) -> float | None:
    """GiB per 1024 more tokens between the shortest and the longest probe that fit
    (the memory that grows with the context); None with fewer than two."""
    fit = sorted((p for p in probes if p["fits"]), key=lambda p: p["seq"])
    if len(fit) < 2:
        return None
    lo, hi = fit[0], fit[-1]
    return (hi[key] - lo[key]) / ((hi["seq"] - lo["seq"]) / 1024)


def reached_max(row: dict) -> bool:
    """Whether the row's search stopped at `--max` with every probe fitting: `longest`
    is then a lower bound, not the longest context that fits."""
    if "capped_by_max" in row:
        return bool(row["capped_by_max"])
    probes = row.get("probes") or []
    return (
        row.get("longest") is not None
        and not row.get("incomplete")
        and all(p.get("fits") for p in probes)
    )


def longest_text(row: dict) -> str:
    """The table's "longest context" cell: `≥ N (reached --max)` for a lower bound, and
    for a row where nothing fits, why (the first probe's error where it did not compile
    for another reason than memory)."""
    if row["longest"] is None:
        error = next((p.get("error") for p in row.get("probes") or []), None)
        if error and not is_oom(error):
            return f"none: {error}"
        return "none from --start"
    if reached_max(row):
        return f"≥ {row['longest']:,} (reached --max)"
    return f"{row['longest']:,}"


def _row(model: str, mesh: str, best: int | None, probes: list[dict], searching: bool) -> dict:
    at_best = next((p for p in probes if p["seq"] == best), {})
    row = {
        "model": model,
        "mesh": mesh,
        "longest": best,
        # every probe fit up to --max: `longest` is a lower bound
        "capped_by_max": not searching and best is not None and all(p["fits"] for p in probes),
        "gib": at_best.get("gib"),
        "host_gib": at_best.get("host_gib"),
        "gib_per_1k": per_1k_tokens(probes, "gib"),
        "host_gib_per_1k": per_1k_tokens(probes, "host_gib"),
        "probes": probes,
    }
    if searching:  # written while the search runs: `longest` is a lower bound
        row["incomplete"] = True
    return row


def longest(
    model: str,
    mesh: str,
    args,
    limit_gib: float,
    host_limit: float = math.inf,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """The longest context of `model` on `mesh` within the limits; `progress` gets the
    row so far (marked `incomplete`) after every probe."""
    import jax

    from train.mesh import mesh_device_count, parse_mesh, seq_shards

    seq = seq_shards(parse_mesh(mesh, mesh_device_count(mesh, jax.device_count())))

    def fits_at(context: int) -> dict:
        try:
            mem = step_memory_gib(model, context, mesh, args)
        except Exception as e:  # noqa: BLE001 - a context that fails to compile is a probe
            text = str(e)
            error = text.splitlines()[0][:200] if text else type(e).__name__
            if is_oom(text):
                error = "out of memory at compile time"
            print(f"  {model} {mesh} {context:>9,}: {error}", flush=True)
            return {"fits": False, "gib": None, "host_gib": None, "error": error}
        gib, host = mem["device"], mem["host"]
        ok = gib <= limit_gib and host <= host_limit
        print(
            f"  {model} {mesh} {context:>9,}: {gib:8.2f} GiB/device {host:8.2f} GiB host "
            f"{'fits' if ok else 'does not fit'}",
            flush=True,
        )
        return {"fits": ok, "gib": gib, "host_gib": host}

    def report(probes: list[dict]) -> None:
        fit = [p["seq"] for p in probes if p["fits"]]
        progress(_row(model, mesh, max(fit, default=None), list(probes), searching=True))

    granule = math.lcm(1024, 2 * seq)
    best, probes = search_longest(
        fits_at, args.start, args.max, args.refine, granule, report if progress else None
    )
    return _row(model, mesh, best, probes, searching=False)


def build_parser() -> argparse.ArgumentParser:
    from jflash import STRATEGIES
    from train.config import OneLineParser  # errors in one line, as the trainer's

    p = OneLineParser(
        prog="python -m train.tools.capacity",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--models",
        default="llama3.2-1b",
        help="comma-separated presets or HF dirs (default: %(default)s)",
    )
    p.add_argument("--mesh", action="append", help="repeatable; default seq=1 and all devices")
    p.add_argument("--shard-over-seq", action="store_true", help="ZeRO-3 over seq as well")
    p.add_argument(
        "--gather-once",
        action="store_true",
        help="with --shard-over-seq: weights gathered once per step (the trainer's --gather_once)",
    )
    p.add_argument(
        "--attention",
        default=ModelArgs.attention,
        choices=ATTENTION_KINDS,
        help="the trainer's --attention (default: %(default)s)",
    )
    p.add_argument(
        "--ring-strategy",
        default=ModelArgs.ring_strategy,
        choices=("auto", *STRATEGIES),
        help="the trainer's --ring_strategy (default: %(default)s, the trainer's: ulysses "
        "where seq divides the heads on one host; each row records the one it ran)",
    )
    p.add_argument(
        "--remat",
        default=ModelArgs.remat_policy,
        choices=REMAT_POLICIES,
        help="the trainer's --remat_policy (default: %(default)s)",
    )
    p.add_argument(
        "--mlp-tile",
        type=int,
        default=None,
        help="MLP tokens per sequence tile (the trainer's --mlp_tile; default: its default)",
    )
    p.add_argument(
        "--optimizer-offload",
        action="store_true",
        help="optimizer state in pinned host memory (the trainer's --optimizer_offload)",
    )
    p.add_argument(
        "--unroll-layers",
        action="store_true",
        help="the trainer's --scan_layers false (as configs/llama3_2_1b_32k.yaml)",
    )
    p.add_argument("--layers", type=int, default=0, help="shrink every model (tests)")
    p.add_argument("--overwrite", action="store_true", help="replace a file already at --out")
    p.add_argument(
        "--start", type=_tokens, default=8192, help="first context (e.g. 16k; default: 8k)"
    )
    p.add_argument(
        "--max", type=_tokens, default=4 * 1024 * 1024, help="largest context (default: 4M)"
    )
    p.add_argument(
        "--refine",
        type=int,
        default=3,
        help="bisection steps after doubling, each on multiples of lcm(1024, 2 x the "
        "sequence shards) tokens: fewer where the interval is that fine already "
        "(default: %(default)s)",
    )
    p.add_argument("--limit-gib", type=float, default=None, help="default: the device's")
    p.add_argument(
        "--host-limit-gib",
        type=float,
        default=None,
        help=(
            "host memory per device (default: physical memory, on GPUs at most XLA's pinned "
            f"host pool, ${HOST_POOL_ENV} or {HOST_POOL_DEFAULT_GIB} GiB, over the local devices)"
        ),
    )
    p.add_argument("--out", default="", help="write the result JSON here")
    return p


def main(argv: list[str] | None = None) -> dict:
    """`python -m train.tools.capacity`: a stop (Ctrl-C, SIGTERM) ends it in one line
    saying what it left."""
    from train.errors import until_stopped

    out = build_parser().parse_known_args(argv)[0].out
    kept = "the search was not finished"
    if out:
        was = f"{out} is as it was" if os.path.lexists(out) else f"nothing was written to {out}"
        kept += f"; {was}, the rows so far are in {out}{PARTIAL}"
    return until_stopped(lambda: _search(argv), kept)


def _search(argv: list[str] | None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    from train.config import gather_once_error

    if error := gather_once_error(args.shard_over_seq, args.gather_once, dashes=True):
        parser.error(error)
    if not 1 <= args.start <= args.max:
        parser.error(f"need 1 <= --start={args.start} <= --max={args.max} tokens")
    if args.refine < 0:
        parser.error(f"--refine={args.refine} must be >= 0")
    for flag, gib in (("--limit-gib", args.limit_gib), ("--host-limit-gib", args.host_limit_gib)):
        if gib is not None and not gib > 0:
            parser.error(f"{flag}={gib} must be > 0")
    names = list(filter(None, args.models.split(",")))
    if not names:
        parser.error(f"--models={args.models!r} names no model")
    # A model directory's files (its config.json) are inputs: never the result's place.
    inputs = [os.path.join(m, f) for m in names if os.path.isdir(m) for f in os.listdir(m)]
    if args.out and (
        error := out_error(
            args.out, what="the report", overwrite=args.overwrite, inputs=inputs, make_parent=True
        )
    ):
        parser.error(error)
    if args.layers < 0:
        parser.error(f"--layers={args.layers} must be >= 1 (or 0: the model's own)")
    if len(set(names)) != len(names):
        parser.error(f"--models={args.models!r} names a model twice")
    if args.mlp_tile is not None and args.mlp_tile < -1:
        parser.error(f"--mlp-tile={args.mlp_tile} must be -1 (auto), 0 (off) or > 0")
    import jax

    import jflash
    from train.build import model_config
    from train.config import parse_args
    from train.errors import TrainingError
    from train.mesh import mesh_device_count, parse_mesh

    meshes = args.mesh or sorted({"seq=1", f"seq={jax.device_count()}"})
    configs = {}
    try:  # refuse an unknown model or a mesh these devices cannot form before probing
        tile = ["--mlp_tile", str(args.mlp_tile)] if args.mlp_tile is not None else []
        for model in names:
            try:
                configs[model] = model_config(parse_args(["--model_name_or_path", model, *tile]))
            except (TrainingError, ValueError) as e:  # in this tool's flag's name
                raise ValueError(str(e).replace("--model_name_or_path", "--models")) from None
        for mesh in meshes:
            count = mesh_device_count(mesh, jax.device_count(), jax.default_backend())
            parse_mesh(mesh, count)
    except (TrainingError, ValueError) as e:
        parser.error(str(e))
    # Doubling keeps what divides --start, and the bisection's lengths are multiples of
    # 2 x the sequence shards: where the mesh divides --start, it divides every probe.
    for model in names:
        for mesh in meshes:
            if error := layout_error(model, args.start, mesh, args):
                parser.error(
                    f"--mesh {mesh}: the trainer refuses it at --start={args.start}: {error}"
                )
            sizes = parse_mesh(mesh, mesh_device_count(mesh, jax.device_count()))
            local = args.start // (sizes["seq"] * sizes["seq_a2a"])
            try:  # the model's own rule (`LlamaConfig.mlp_tile_for`)
                configs[model].mlp_tile_for(local)
            except ValueError:
                parser.error(
                    f"--mlp-tile={args.mlp_tile} does not divide the {local} tokens a device "
                    f"holds of --start={args.start} over --mesh {mesh}"
                )
    if args.out:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        except OSError as e:
            parser.error(f"--out {args.out}: cannot create its directory ({e.strerror or e})")
    limit = device_limit_gib(args.limit_gib)
    host_limit = host_limit_gib(args.host_limit_gib)
    print(
        f"capacity on {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"limit {limit:.2f} GiB/device and {host_limit:.2f} GiB host/device, "
        f"attention={args.attention}, ring_strategy={args.ring_strategy}, remat={args.remat}, "
        f"mlp_tile={'the trainer default' if args.mlp_tile is None else args.mlp_tile}, "
        f"optimizer_offload={args.optimizer_offload}, "
        f"layers {'unrolled' if args.unroll_layers else 'scanned'}",
        flush=True,
    )
    if args.remat.startswith("offload") and jax.default_backend() == "cpu":
        on_device = {"offload_attn": "save_attn", "offload_full": "full"}[args.remat]
        print(
            f"warning: --remat {args.remat} on the cpu backend: its one memory space keeps "
            "the residuals the policy offloads on the device in XLA's plan, so the device "
            f"GiB below are {on_device}'s and the host GiB leave them out; plan offload on a "
            "GPU",
            flush=True,
        )

    def write(rows: list[dict], done: bool = False) -> dict:
        """The result so far; where `--out` is given, into `--out` + PARTIAL while the
        search runs (a run stopped early keeps what it found there, and a result already
        at `--out` stays whole), and into `--out` once `done` (the partial file removed)."""
        result = {
            "device": jax.devices()[0].device_kind,
            "devices": jax.device_count(),
            "jax": jax.__version__,
            "jflash": jflash.__version__,
            "limit_gib": limit,
            "host_limit_gib": host_limit,
            "method": "compiled memory analysis of the training step, not run",
            "settings": {
                "ring_strategy": args.ring_strategy,
                "shard_over_seq": args.shard_over_seq,
                "gather_once": args.gather_once,
                "attention": args.attention,
                "remat": args.remat,
                "mlp_tile": args.mlp_tile,
                "optimizer_offload": args.optimizer_offload,
                "scan_layers": not args.unroll_layers,
                "layers": args.layers or None,
            },
            "argv": sys.argv[1:] if argv is None else argv,
            "rows": rows,
        }
        if args.out:
            write_json(args.out if done else args.out + PARTIAL, result, "--out")
            if done and os.path.lexists(args.out + PARTIAL):
                os.remove(args.out + PARTIAL)
        return result

    rows = []
    for model in names:
        base = None
        for mesh in meshes:
            row = longest(
                model, mesh, args, limit, host_limit, progress=lambda r: write([*rows, r])
            )
            # Only the ring's attention splits by a strategy (None: XLA's or cuDNN's).
            ring = args.attention == "ring"
            row["ring_strategy"] = ring_strategy(model, args.start, mesh, args) if ring else None
            row["devices"] = mesh_device_count(mesh, jax.device_count())
            base = base or row["longest"]
            row["vs_first_mesh"] = row["longest"] / base if row["longest"] and base else None
            rows.append(row)
            write(rows)  # a run stopped by a timeout keeps the rows it finished
    print(
        "\n| model | mesh | strategy | longest context | GiB/device | GiB host | "
        "GiB/1k tokens device | GiB/1k tokens host | vs first mesh |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def num(value, fmt=".3g"):
        return "–" if value is None else format(value, fmt)

    for r in rows:
        ratio = f"{r['vs_first_mesh']:.2f}" if r["vs_first_mesh"] else "–"
        strategy = r["ring_strategy"] or f"– ({args.attention})"
        print(
            f"| {r['model']} | {r['mesh']} | {strategy} | {longest_text(r)} | "
            f"{num(r['gib'])} | "
            f"{num(r['host_gib'])} | {num(r['gib_per_1k'], '.4f')} | "
            f"{num(r['host_gib_per_1k'], '.4f')} | {ratio} |"
        )
    for mesh in meshes:  # the trainer's mesh takes every visible device
        used, total = mesh_device_count(mesh, jax.device_count()), jax.device_count()
        if used < total:
            print(
                f"--mesh {mesh} plans {used} of the {total} devices (the first ones): "
                f"`python -m train` takes every visible device, so make only {used} "
                f"visible to train it (CUDA_VISIBLE_DEVICES={','.join(map(str, range(used)))} "
                "on GPUs)"
            )
    result = write(rows, done=True)
    if args.out:
        print(f"wrote {args.out}")
    return result


def _tokens_label(tokens: float) -> str:
    """128k, 1M: a context length as the tick labels show it."""
    n = int(round(tokens))
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}k"
    return str(n)


def load_results(path: str) -> list[dict]:
    """The capacity results in one JSON file: one result (`--out`) or a list of them
    (benchmarks/long_context.sh's capacity.json). Anything else is refused in one line
    that names the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"error: {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: not a capacity result JSON ({e})") from None
    results = data if isinstance(data, list) else [data]
    well_formed = all(
        isinstance(r, dict)
        and isinstance(r.get("rows"), list)
        and all(isinstance(row, dict) and isinstance(row.get("probes"), list) for row in r["rows"])
        for r in results
    )
    if not well_formed or not any(r["rows"] for r in results):
        raise SystemExit(
            f"error: {path}: not a capacity result (no rows with probes; "
            "`python -m train.tools.capacity --out FILE` writes one)"
        )
    return results


def load_measured(run: str) -> dict:
    """A training run's measured peak from its output directory (or its log.jsonl):
    `{"name", "model", "remat", "seq", "gib"}`, "gib" the largest `peak_memory_gib` in
    log.jsonl (None where the device reported none, as on CPU); the model, context and
    remat policy from the train_config.yaml beside it."""
    import yaml

    from train.outputs import SETTINGS_FILE

    run_dir = os.path.dirname(run) if os.path.isfile(run) else run
    log, settings = os.path.join(run_dir, "log.jsonl"), os.path.join(run_dir, SETTINGS_FILE)
    for path in (log, settings):
        if not os.path.isfile(path):
            raise SystemExit(f"error: --measured {run}: no {path} (a `python -m train` output_dir)")
    try:
        with open(settings) as f:
            cfg = yaml.safe_load(f)
        model = cfg["model"]
        remat = model["remat_policy"]
        if remat == "none" and model.get("gradient_checkpointing"):
            remat = "full"  # the trainer's effective policy (TrainConfig.remat)
        seq = int(cfg["data"]["model_max_length"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError) as e:
        raise SystemExit(
            f"error: {settings}: not a run's settings ({type(e).__name__}: {e})"
        ) from None
    try:
        with open(log) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {log}: not a run's log ({e})") from None
    peaks = [r["peak_memory_gib"] for r in records if "peak_memory_gib" in r]
    return {
        "name": os.path.basename(os.path.normpath(run_dir)),
        "path": log,
        "model": model["model_name_or_path"],
        "remat": remat,
        "seq": seq,
        "gib": max(peaks) if peaks else None,
    }


def plot_memory(paths: list[str], out: str, measured: list[str] = ()) -> str:
    """Draws the capacity results in `paths` (and the measured peaks of the training
    runs in `measured`) into the PNG `out` and returns it: one panel per model, x the
    context (log2), y GiB; per remat policy (and mesh, where there are several) a solid
    line of device GiB and a dashed one of host GiB over the probes that compiled, an x
    on those that do not fit; the device limit (and the host limit, where the host lines
    come near it) as horizontal lines."""
    loaded = [(path, result) for path in paths for result in load_results(path)]
    results = [result for _, result in loaded]
    runs = [load_measured(run) for run in measured]
    unfinished = set()  # (model, remat, mesh) of rows written while their search ran
    for path, result in loaded:
        remat = (result.get("settings") or {}).get("remat", "?")
        for row in result["rows"]:
            if row.get("incomplete"):
                unfinished.add((row["model"], remat, row.get("mesh", "")))
                print(
                    f"note: {path}: an unfinished search (written while `capacity` ran, or "
                    f"by one that was stopped): {row['model']} on {row.get('mesh', '?')} is "
                    "drawn as far as it got, and the models and meshes it had not reached are "
                    "missing",
                    flush=True,
                )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    panels: dict[str, dict] = {}
    for result in results:
        remat = (result.get("settings") or {}).get("remat", "?")
        for row in result["rows"]:
            panel = panels.setdefault(
                row["model"],
                {"series": {}, "failed": {}, "capped": {}, "limit": set(), "host": set()},
            )
            for key, into in (("limit_gib", "limit"), ("host_limit_gib", "host")):
                if result.get(key) is not None:
                    panel[into].add(result[key])
            series = (remat, row.get("mesh", ""))
            probes = panel["series"].setdefault(series, {})
            failed = panel["failed"].setdefault(series, set())
            if reached_max(row):  # the search stopped at --max: longer contexts may fit
                panel["capped"].setdefault(series, set()).add(row["longest"])
            for p in row["probes"]:
                if p.get("gib") is not None:
                    probes.setdefault(p["seq"], p)  # one probe per length
                elif not p.get("fits"):  # ran out of memory while compiling
                    failed.add(p["seq"])
    if not any(probes for panel in panels.values() for probes in panel["series"].values()):
        raise SystemExit(f"error: {', '.join(paths)}: no probe compiled; nothing to plot")

    def order(key):
        policy, mesh = key
        rank = REMAT_POLICIES.index(policy) if policy in REMAT_POLICIES else len(REMAT_POLICIES)
        return rank, policy, mesh

    keys = sorted({k for panel in panels.values() for k in panel["series"]}, key=order)
    several_meshes = len({mesh for _, mesh in keys}) > 1
    colors = {k: f"C{i % 10}" for i, k in enumerate(keys)}
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.5 * len(panels), 6.0), squeeze=False, layout="constrained"
    )
    for ax, (model, panel) in zip(axes[0], panels.items(), strict=True):
        top = 0.0
        for key in sorted(panel["series"], key=order):
            probes = [panel["series"][key][s] for s in sorted(panel["series"][key])]
            if not probes:
                continue
            name = f"{key[0]} {key[1]}" if several_meshes else key[0]
            if (model, *key) in unfinished:
                name += " (unfinished)"
            for field, style, what in (("gib", "-", "device"), ("host_gib", "--", "host")):
                pts = [(p["seq"], p[field], p.get("fits")) for p in probes]
                pts = [pt for pt in pts if pt[1] is not None]
                if not pts:
                    continue
                ax.plot(
                    [s for s, _, _ in pts], [g for _, g, _ in pts], style,
                    color=colors[key], label=f"{name} {what}",
                )  # fmt: skip
                for fits, marker, size in ((True, "o", 18), (False, "x", 60)):
                    xy = [(s, g) for s, g, ok in pts if bool(ok) == fits]
                    if xy:
                        ax.scatter(*zip(*xy, strict=True), marker=marker, s=size, color=colors[key])
                top = max(top, *(g for _, g, _ in pts))
            # Probes that ran out of memory while compiling have no size: an x on the
            # device limit (the line they did not fit under).
            failed = sorted(panel["failed"][key] - set(panel["series"][key]))
            if failed and panel["limit"]:
                at = [max(panel["limit"])] * len(failed)
                ax.scatter(failed, at, marker="x", s=60, color=colors[key], clip_on=False)
            # A search that stopped at --max: its longest probe is a lower bound, a > on it.
            capped = [panel["series"][key].get(s) for s in sorted(panel["capped"].get(key, ()))]
            capped = [(p["seq"], p["gib"]) for p in capped if p and p.get("gib") is not None]
            if capped:
                ax.scatter(
                    *zip(*capped, strict=True), marker=">", s=90, color=colors[key], zorder=4
                )
        for limit in sorted(panel["limit"]):
            ax.axhline(limit, color="0.25", lw=1.2, label=f"device limit {limit:.3g} GiB")
            top = max(top, limit)
        for limit in sorted(panel["host"]):
            if limit <= 1.25 * top:
                ax.axhline(limit, color="0.25", lw=1.2, ls=":", label=f"host limit {limit:.3g} GiB")
        for run in runs:
            if run["model"] != model or run["gib"] is None:
                continue
            color = next((colors[k] for k in keys if k[0] == run["remat"]), "k")
            ax.scatter(
                [run["seq"]], [run["gib"]], marker="*", s=180, color=color, edgecolors="k",
                zorder=4, label=f"measured: {run['name']} ({run['remat']})",
            )  # fmt: skip
        handles, _ = ax.get_legend_handles_labels()
        if any(not p.get("fits") for s in panel["series"].values() for p in s.values()):
            handles.append(Line2D([], [], ls="", marker="x", color="0.25", label="does not fit"))
        if panel["capped"]:
            label = "reached --max: longer may fit"
            handles.append(Line2D([], [], ls="", marker=">", color="0.25", label=label))
        ax.legend(  # below the panel: the lines rise into every corner
            handles=handles, fontsize="small", loc="upper center",
            bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False,
        )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=2))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _tokens_label(v)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("GiB per device (compiled step)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
    for run in runs:
        if run["gib"] is None:
            print(f"{run['path']}: no peak_memory_gib (the device reports none); not drawn")
        elif run["model"] not in panels:
            print(f"{run['path']}: no capacity result for {run['model']}; not drawn")
    devices = sorted({str(r["device"]) for r in results if r.get("device")})
    title = f"Step memory against context: {', '.join(panels)}"
    if devices:
        title += f" on {', '.join(devices)}"
    shared = []  # the settings every result has in common, bar the remat policy
    for key in ("attention", "mlp_tile", "optimizer_offload", "shard_over_seq", "layers"):
        values = {json.dumps((r.get("settings") or {}).get(key)) for r in results}
        if len(values) == 1 and (value := json.loads(values.pop())) is not None:
            shared.append(f"{key}={value}")
    if shared:
        title += "\n" + ", ".join(shared)
    fig.suptitle(title)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as e:
        plt.close(fig)
        raise SystemExit(f"error: --out: cannot write {out} ({e.strerror or e})") from None
    try:
        write_whole(out, lambda f: fig.savefig(f, format="png", dpi=110), "--out", binary=True)
    finally:
        plt.close(fig)
    print(f"wrote {out}")
    return out


def main_plot(argv: list[str] | None = None) -> str:
    """`python -m train.tools.capacity plot RESULT.json ... --out memory.png`."""
    from train.config import OneLineParser

    p = OneLineParser(
        prog="python -m train.tools.capacity plot",
        description="Capacity probes' device and host GiB against the context, per remat policy.",
    )
    p.add_argument(
        "results", nargs="+", help="capacity JSON files: one result (--out) or a list of them"
    )
    p.add_argument(
        "--measured",
        nargs="+",
        action="extend",
        default=[],
        metavar="RUN_DIR",
        help="training output dirs (or their log.jsonl): the measured peak, as a star",
    )
    p.add_argument("--out", default="capacity-memory.png", help="the PNG to write")
    p.add_argument("--overwrite", action="store_true", help="replace a file already at --out")
    args = p.parse_args(argv)
    if error := out_error(
        args.out, what="the PNG", overwrite=args.overwrite, inputs=args.results, make_parent=True
    ):
        p.error(error)
    if not args.out.lower().endswith(".png"):
        p.error(f"--out {args.out}: the plot is a PNG; give a file name ending in .png")
    return plot_memory(args.results, args.out, args.measured)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        main_plot(sys.argv[2:])
    else:
        main()
