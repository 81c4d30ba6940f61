"""Clocks and power while each attention implementation runs: is a kernel's speed its
own, or the GPU's power limit's?

    python benchmarks/power.py                                  # jflash, FA3: causal 4k/16k/64k
    python benchmarks/power.py --shapes causal:16384:128 --impls jflash_mosaic,fa3,cudnn
    python benchmarks/power.py --passes fwd,fwdbwd --rounds 4 --seconds 3
    python benchmarks/power.py --shapes "" --documents          # packed documents only

A Hopper GPU running attention's matmuls flat out draws its board power limit (700 W
on an H200) and lowers its SM clock until it fits: two kernels with the same time per
clock cycle then run at different speeds if one needs more energy per cycle. So this
script times each implementation's forward and/or forward+backward (`--passes`) on
each shape (`mask:S:D`, `--tokens` tokens per call, 32/8 heads, bf16; `--documents`
adds `kernel.py --documents`'s packed row, FA3 as its varlen kernel), after `--heat`
seconds of load (`common.heat`), for at least
`--seconds` per reading, in `--rounds` interleaved rounds whose order alternates,
while `nvidia-smi` samples the SM clock, power draw, temperature and the active clock
throttle reasons every 20 ms. Per reading: ms per call, TFLOP/s (causal FLOPs, as in
`kernel.py`), the mean SM clock and power over the reading (its first 0.3 s left out),
the energy per call (mean power × time), TFLOP/s per GHz of SM clock (work per cycle)
and per kW (work per joule), and the throttle reasons seen. The table shows each
implementation's median-time round, not its best: a reading that follows an idle GPU
(compilation) starts cool and runs a higher clock than the ones after it, and
nvidia-smi's power draw is averaged over about a second, so that reading's power reads
low too. The JSON has every round. On one GPU; the device is the first visible one.
Outputs are not checked against each other here; `kernel.py` and `ab.py` check them.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    HEAT_S,
    check_out,
    device_name,
    heat,
    jit_passes,
    parse_specs,
    table,
    time_fn,
    write_json,
)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
SAMPLE_MS = 20
SETTLE_S = 0.3  # a reading's first samples still show the previous one's clock
# nvidia-smi's clocks_throttle_reasons bits (NVML's nvmlClocksEventReasons).
THROTTLE_REASONS = {
    0x1: "idle",
    0x2: "application clocks",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal (software)",
    0x40: "thermal (hardware)",
    0x80: "power brake",
    0x100: "display clocks",
}


def throttle_names(mask: int) -> list[str]:
    """The reasons set in an nvidia-smi throttle mask; unknown bits as hex."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([hex(rest)] if rest else [])


def parse_sample(line: str) -> dict | None:
    """One `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` line ->
    `{sm_mhz, watts, temp_c, throttle}`; None for a line that is not one (a field
    "[N/A]", a warning)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        return {
            "sm_mhz": float(fields[0]),
            "watts": float(fields[1]),
            "temp_c": float(fields[2]),
            "throttle": int(fields[3], 16),
        }
    except ValueError:
        return None


def summarise(samples: list[tuple[float, dict]], start: float, end: float) -> dict:
    """Mean clock, power and temperature of the samples taken in `(start + SETTLE_S,
    end)`, and the throttle reasons seen with the share of samples showing each."""
    window = [s for t, s in samples if start + SETTLE_S < t < end]
    if not window:
        return {"samples": 0}
    reasons: dict[str, int] = {}
    for s in window:
        for name in throttle_names(s["throttle"]):
            reasons[name] = reasons.get(name, 0) + 1
    return {
        "samples": len(window),
        "sm_mhz": statistics.mean(s["sm_mhz"] for s in window),
        "watts": statistics.mean(s["watts"] for s in window),
        "temp_c": statistics.mean(s["temp_c"] for s in window),
        "throttle": {k: round(v / len(window), 3) for k, v in sorted(reasons.items())},
    }


class Sampler:
    """`nvidia-smi -lms SAMPLE_MS` in a thread: `(perf_counter time, sample)` pairs."""

    def __init__(self, gpu: str):
        cmd = ["nvidia-smi", "-i", gpu, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        self.samples: list[tuple[float, dict]] = []
        self._proc = subprocess.Popen(
            [*cmd, "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.perf_counter(), sample))

    def close(self):
        self._proc.kill()
        self._proc.wait()


def reading(flops: float, ms: float, power: dict) -> dict:
    """A timed reading with its power summary and the derived per-cycle and per-joule
    rates."""
    row = {"ms": ms, "tflops": flops / ms / 1e9, **power}
    if power.get("samples"):
        row["joules_per_call"] = power["watts"] * ms / 1e3
        row["tflops_per_ghz"] = row["tflops"] / (power["sm_mhz"] / 1e3)
        row["tflops_per_kw"] = row["tflops"] / (power["watts"] / 1e3)
    return row


def median_rounds(rows: list[dict]) -> list[dict]:
    """Per (shape, impl, pass), in first-seen order, the round with the median time
    (the slower middle one of an even count)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["shape"], row["impl"], row["pass"]), []).append(row)
    return [sorted(g, key=lambda r: r["ms"])[len(g) // 2] for g in groups.values()]


def cases(args, shapes):
    """`(label, (q, k, v, do), forward FLOPs, build)` per shape, then the packed row
    with `--documents`; `build(impl)` is `attn(q, k, v)` or raises PeerUnavailable."""
    from benchmarks import kernel

    for mask, seq, hd in shapes:
        batch = args.tokens // seq
        causal = mask == "causal"
        inputs = kernel.draw_inputs(batch, seq, args.heads, args.kv_heads, hd)
        flops = kernel.attention_flops(batch, args.heads, seq, hd, causal=causal)

        def build(impl, causal=causal, hd=hd):
            return kernel.attention_fn(impl, causal=causal, head_dim=hd)

        yield f"{mask} S={seq} D={hd} B={batch}", inputs, flops, build
    if args.documents:
        lengths = kernel.document_lengths(args.tokens)
        inputs = kernel.draw_inputs(1, args.tokens, args.heads, args.kv_heads, 128)

        def build(impl):
            return kernel.document_attention_fn(impl, lengths)

        label = f"documents S={args.tokens} ({len(lengths)} documents) D=128 B=1"
        yield label, inputs, kernel.document_flops(lengths, args.heads, 128), build


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default="causal:4096:128,causal:16384:128,causal:65536:128")
    p.add_argument("--impls", default="jflash_mosaic,fa3", help="kernel.py's names")
    p.add_argument("--passes", default="fwdbwd", help="fwd, fwdbwd or both (comma list)")
    p.add_argument("--tokens", type=int, default=65536, help="per call; batch = tokens // S")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument(
        "--documents", action="store_true", help="add kernel.py's packed row (FA3: varlen)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--heat", type=float, default=HEAT_S, help="seconds of load before rounds")
    p.add_argument("--seconds", type=float, default=2.0, help="least time per reading")
    p.add_argument("--out", default=None, help="JSON path (default results/power-<gpu>.json)")
    args = p.parse_args(argv)
    if args.out:
        check_out(p, "--out", args.out)
    try:
        shapes = parse_specs(args.shapes, "--shapes", "mask", ("causal", "full"))
    except ValueError as e:
        p.error(str(e))
    if not shapes and not args.documents:
        p.error("nothing to time: --shapes is empty and --documents is not given")
    passes = [x for x in args.passes.split(",") if x]
    if not passes or any(x not in ("fwd", "fwdbwd") for x in passes):
        p.error(f"--passes {args.passes!r}: a comma list of fwd and fwdbwd")
    if args.rounds < 1 or args.seconds <= 0:
        p.error(f"--rounds {args.rounds} and --seconds {args.seconds} must be positive")
    for seq in (s for _, s, _ in shapes):
        if seq > args.tokens or args.tokens % seq:
            p.error(f"--shapes: S={seq} must divide --tokens {args.tokens}")
    if shutil.which("nvidia-smi") is None:
        sys.exit("power.py: nvidia-smi is not on PATH (an NVIDIA GPU machine is needed)")

    import jax

    from benchmarks.kernel import PeerUnavailable

    if jax.devices()[0].platform != "gpu":
        sys.exit(f"power.py: the first device is {jax.devices()[0].device_kind}, not a GPU")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    sampler = Sampler(visible)
    rows, notes = [], []
    try:
        for label, args_, flops, build in cases(args, shapes):
            fns = {}
            for impl in args.impls.split(","):
                try:
                    fns[impl] = jit_passes(build(impl))
                except PeerUnavailable as e:
                    notes.append(f"{label}: {impl}: {e}")
                    continue
                for pas in passes:  # compile and warm
                    fn, n = fns[impl][pas]
                    jax.block_until_ready(fn(*args_[:n]))
            calls = [
                functools.partial(f, *args_[:n]) for fs in fns.values() for f, n in fs.values()
            ]
            heat(calls, args.heat)
            for r in range(args.rounds):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                for pas in passes:
                    for impl in order:
                        fn, n = fns[impl][pas]
                        t0 = time.perf_counter()
                        ms = 1e3 * time_fn(fn, *args_[:n], iters=10, min_time=args.seconds)
                        power = summarise(sampler.samples, t0, time.perf_counter())
                        scale = 1.0 if pas == "fwd" else 3.5
                        row = {
                            "shape": label,
                            "impl": impl,
                            "pass": pas,
                            "round": r,
                            **reading(scale * flops, ms, power),
                        }
                        rows.append(row)
                        print(
                            f"{row['shape']} {impl} {pas} round {r}: {ms:.2f} ms,"
                            f" {row.get('sm_mhz', 0):.0f} MHz, {row.get('watts', 0):.0f} W",
                            flush=True,
                        )
    finally:
        sampler.close()
    shown = []
    for row in median_rounds(rows):
        row = dict(row)
        row["throttle"] = ", ".join(f"{k} {v:.0%}" for k, v in row.get("throttle", {}).items())
        shown.append(row)
    cols = ["shape", "impl", "pass", "ms", "tflops", "sm_mhz", "watts", "temp_c"]
    cols += ["joules_per_call", "tflops_per_ghz", "tflops_per_kw", "throttle"]
    print(table(shown, cols))
    for note in notes:
        print(f"- {note}")
    out = args.out or os.path.join(RESULTS, f"power-{device_name()}.json")
    write_json(out, {"command": sys.argv, "rows": rows, "notes": notes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
