"""How often the Mosaic forward keeps a warp's row max: its key-norm bound on given inputs.

    python benchmarks/bound_share.py                                  # normal inputs
    python benchmarks/bound_share.py --shapes causal:4096:64 --q-scale 16
    python benchmarks/bound_share.py --checkpoint /ckpt/Llama-3.2-1B --text book.txt --seq 4096

The dense Mosaic forward skips an unmasked step's row max where a bound shows it cannot
matter (`BOUNDED_MAX` in `jflash/_mosaic_fwd.py`): a row's scaled scores are at most
|scale| x its query's norm x its KV head's largest key norm, and where that bound less a
slack (`BOUND_SLACK`) is at most the running max of each of a warp's 16 rows, the warp
keeps its max. Where it does not, the step takes the max as before, on a path with a few
percent more fixed stalls than the kernel had without the bound. Whether a model's
attention gains therefore depends on its activations: this script replays the kernel's
decision, step by step and warp by warp, on the host (numpy; no GPU needed, nothing is
timed), and reports the share of unmasked warp-steps that keep their max.

Its model of the kernel: 64-row warpgroups of four 16-row warps; steps of the kernel's
keys per step for the shape (`_mosaic_fwd`'s rules: 256 at D = 64, 128 on its three
warpgroups from 16k causal and 8k full queries, 128 at D = 128 causal, 160 full); a
warpgroup's steps in key order, those whose keys all its rows see unmasked except its
last step (peeled, with the mask); the running max in scaled base-2 units; every
unmasked step after the first decided by the bound (a warpgroup's first step, where the
running max is -inf, takes the max). Scores are f32 dots of the inputs' values (the
kernel's wgmma sums in another order: a decision at the margin may differ).

Inputs: `--shapes mask:S:D` draws `benchmarks/kernel.py`'s normal q and k (batch 1,
`--heads`/`--kv-heads`, bf16; `--q-scale` multiplies q as `ab.py --q-scale` does);
`--checkpoint DIR` (an HF Llama folder, `models.load_hf`) runs the model on the first
`--seq` tokens of `--text` (its `tokenizer.json`, the `tokenizers` package) with the
dense XLA attention, and takes every layer's q and k after RoPE. Packed documents
(segment ids) keep the exact max in the kernel and are not modelled. Columns: warp-steps
unmasked, the share that kept the max (`kept`), and that share leaving out each
warpgroup's first step (`kept_after_first`, which the bound cannot take), and the
share kept by all four warps of a warpgroup at once (`kept_whole_warpgroup`): a
warpgroup's wgmmas start once its four warps have issued them, so a step runs at the
pace of the path that takes the max unless every warp keeps it; `bounded` says whether
the kernel takes the bound at all for the dtype and head dim (fp16 at D = 128 keeps the
exact loop: the shares there are what the bound would keep). JSON:
`--out` (default `benchmarks/results/bound-share-<source>.json`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import check_out, parse_specs, table, write_json  # noqa: E402
from benchmarks.kernel import draw_inputs  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WG_ROWS = 64  # rows per compute warpgroup
WARP_ROWS = 16  # rows per warp (a wgmma's m64 tile: four warps of 16 rows)
WARPS = WG_ROWS // WARP_ROWS
# The kernel's choices this replays (`jflash/_mosaic_fwd.py`: BOUND_SLACK,
# BOUND_HEAD_DIMS, the three-warpgroup rule, FULL_BLOCK_KV; `mosaic_block_sizes`' keys
# per step), kept equal to them by tests/test_bound_share.py.
SLACK = {"bfloat16": 64.0, "float16": 14.0}
HEAD_DIMS = {"bfloat16": (64, 128), "float16": (64,)}  # that take the bound
THREE_WG_HEAD_DIMS = (64,)
THREE_WG_MIN_LEN = 16384  # causal
THREE_WG_MIN_LEN_FULL = 8192
FULL_BLOCK_KV = {128: 160}


def keys_per_step(head_dim: int, seq: int, causal: bool) -> int:
    """The dense forward's keys per step for this shape (`mosaic_fwd`'s choice)."""
    min_len = THREE_WG_MIN_LEN if causal else THREE_WG_MIN_LEN_FULL
    if head_dim in THREE_WG_HEAD_DIMS and seq >= min_len:
        return 128
    if not causal and head_dim in FULL_BLOCK_KV:
        return FULL_BLOCK_KV[head_dim]
    return 256 if head_dim <= 64 else 128


def head_share(q, k, *, causal: bool, block_kv: int, slack: float, chunk: int = 1024):
    """`(unmasked, kept, firsts, whole)` warp-steps for one head: `q [T, D]`, `k [S, D]`
    (f32 holding the input dtype's values; T a multiple of 64, causal: T == S); `whole`:
    the kept ones whose warpgroup's four warps all keep the max on that step."""
    t, d = q.shape
    s_len = k.shape[0]
    qk_scale = d**-0.5 * math.log2(math.e)
    k_norm = np.float32(np.sqrt((k * k).sum(axis=1).max()))
    n_steps = -(-s_len // block_kv)
    unmasked = kept = firsts = whole = 0
    for a in range(0, t, chunk):
        rows = np.arange(a, min(a + chunk, t))
        s = (q[rows] @ k.T) * np.float32(qk_scale)  # [rows, S], scaled base-2 units
        if causal:
            s = np.where(np.arange(s_len)[None, :] <= rows[:, None], s, -np.inf)
        s = np.pad(s, ((0, 0), (0, n_steps * block_kv - s_len)), constant_values=-np.inf)
        step_max = s.reshape(len(rows), n_steps, block_kv).max(axis=2)
        lim = np.sqrt((q[rows] * q[rows]).sum(axis=1)) * (k_norm * np.float32(abs(qk_scale)))
        lim = lim - np.float32(slack)
        wg0 = rows // WG_ROWS * WG_ROWS  # each row's warpgroup's first row
        if causal:
            hi = np.minimum(-(-(wg0 + WG_ROWS) // block_kv), n_steps)
            clear = np.minimum((wg0 + 1) // block_kv, hi - 1)
        else:
            hi = np.full(len(rows), n_steps)
            clear = hi - 1  # the last step is peeled, with the mask
        m = np.full(len(rows), -np.inf, np.float32)
        for j in range(n_steps):
            run = j < hi
            if not run.any():
                break
            clear_j = j < clear
            ok = (lim <= m).reshape(-1, WARP_ROWS).all(axis=1)  # NaN and -inf: not ok
            warp_clear = clear_j.reshape(-1, WARP_ROWS)[:, 0]
            warp_keep = ok & warp_clear
            keep = np.repeat(warp_keep, WARP_ROWS)
            unmasked += int(warp_clear.sum())
            kept += int(warp_keep.sum())
            whole += WARPS * int(warp_keep.reshape(-1, WARPS).all(axis=1).sum())
            firsts += int((warp_clear & (j == 0)).sum())
            m = np.where(run & ~keep, np.maximum(m, step_max[:, j]), m)
    return unmasked, kept, firsts, whole


def share_row(name, pairs, *, causal, head_dim, seq, dtype) -> dict:
    """One table row over `pairs` of `(q [T, D], k [S, D])`, each one head's."""
    block_kv = keys_per_step(head_dim, seq, causal)
    slack = SLACK[jnp.dtype(dtype).name]
    unmasked = kept = firsts = whole = 0
    for q, k in pairs:
        u, kp, f, w = head_share(q, k, causal=causal, block_kv=block_kv, slack=slack)
        unmasked, kept, firsts, whole = unmasked + u, kept + kp, firsts + f, whole + w
    after = unmasked - firsts
    return dict(
        source=name,
        mask="causal" if causal else "full",
        seq_len=seq,
        head_dim=head_dim,
        keys_per_step=block_kv,
        bounded=head_dim in HEAD_DIMS[jnp.dtype(dtype).name],
        heads=len(pairs),
        unmasked_warp_steps=unmasked,
        kept=kept / unmasked if unmasked else None,
        kept_after_first=kept / after if after else None,
        kept_whole_warpgroup=whole / unmasked if unmasked else None,
    )


def heads_of(q, k):
    """`(q [T, D], k [S, D])` per query head (batch row 0; GQA: the head's KV head),
    as f32 numpy arrays of the inputs' values."""
    q, k = np.asarray(q[0], np.float32), np.asarray(k[0], np.float32)
    group = q.shape[1] // k.shape[1]
    return [(q[:, h], k[:, h // group]) for h in range(q.shape[1])]


def normal_rows(args, shapes) -> list[dict]:
    rows = []
    for causal, seq, hd in shapes:
        dtype = jnp.dtype(args.dtype)
        q, k, _, _ = draw_inputs(1, seq, args.heads, args.kv_heads, hd, dtype, args.q_scale)
        name = "normal" + (f", q x {args.q_scale:g}" if args.q_scale != 1.0 else "")
        name += ", fp16" if dtype == jnp.float16 else ""
        rows.append(
            share_row(name, heads_of(q, k), causal=causal, head_dim=hd, seq=seq, dtype=q.dtype)
        )
        print(rows[-1], flush=True)
    return rows


def model_rows(args, parser) -> list[dict]:
    """Every layer's row on the checkpoint's q and k (after RoPE) over the text."""
    import models
    from models import llama

    try:
        from tokenizers import Tokenizer
    except ImportError:
        parser.error("--checkpoint needs the 'tokenizers' package: pip install 'jflash[text]'")
    tok_file = os.path.join(args.checkpoint, "tokenizer.json")
    if not os.path.isfile(tok_file):
        parser.error(f"--checkpoint {args.checkpoint}: no tokenizer.json there")
    with open(args.text, encoding="utf-8", errors="replace") as f:
        ids = Tokenizer.from_file(tok_file).encode(f.read()).ids
    if len(ids) < args.seq:
        parser.error(f"--text {args.text}: {len(ids):,} tokens, fewer than --seq {args.seq:,}")
    config, params = models.load_hf(args.checkpoint)
    config = config.replace(dtype=args.dtype)
    captured = []
    real_attend = llama.attend

    def attend(q, k, v, positions, attention, segment_ids=None):
        jax.debug.callback(lambda q_, k_: captured.append(heads_of(q_, k_)), q, k)
        return real_attend(q, k, v, positions, attention, segment_ids)

    llama.attend = attend
    try:
        ids_ = jnp.asarray(np.asarray(ids[: args.seq], np.int32)[None])
        jax.block_until_ready(models.hidden_states(config, params, ids_, attention="xla"))
        jax.effects_barrier()
    finally:
        llama.attend = real_attend
    name = os.path.basename(os.path.normpath(args.checkpoint))
    rows = []
    for layer, pairs in enumerate(captured):
        row = share_row(
            f"{name} layer {layer}",
            pairs,
            causal=True,
            head_dim=config.head_dim,
            seq=args.seq,
            dtype=args.dtype,
        )
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="causal:4096:64,causal:4096:128,full:4096:128")
    parser.add_argument("--heads", type=int, default=4, help="query heads drawn (normal inputs)")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--q-scale", type=float, default=1.0, help="multiply normal q by this")
    parser.add_argument("--checkpoint", default=None, help="an HF Llama folder (models.load_hf)")
    parser.add_argument("--text", default=None, help="a text file (with --checkpoint)")
    parser.add_argument(
        "--seq", type=int, default=4096, help="tokens of --text (with --checkpoint)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.q_scale) and args.q_scale > 0):
        parser.error(f"--q-scale {args.q_scale}: a positive finite number")
    for flag in ("heads", "kv_heads", "seq"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads}: a multiple of --kv-heads {args.kv_heads}")
    if (args.checkpoint is None) != (args.text is None):
        parser.error("--checkpoint and --text go together")
    if args.checkpoint is not None:
        if args.seq % WG_ROWS:
            parser.error(f"--seq {args.seq}: a multiple of {WG_ROWS}")
        if not os.path.isfile(args.text):
            parser.error(f"--text {args.text}: no such file")
        source = os.path.basename(os.path.normpath(args.checkpoint))
    else:
        try:
            specs = parse_specs(args.shapes, "--shapes", "mask", ("causal", "full"))
            shapes = [(mask == "causal", seq, hd) for mask, seq, hd in specs]
        except ValueError as e:
            parser.error(str(e))
        bad = [f"{'causal' if c else 'full'}:{s}:{d}" for c, s, d in shapes if s % WG_ROWS]
        if bad:
            parser.error(f"--shapes {','.join(bad)}: S a multiple of {WG_ROWS}")
        source = "normal" + (f"-q{args.q_scale:g}" if args.q_scale != 1.0 else "")
        source += "-fp16" if args.dtype == "float16" else ""
    out = args.out or os.path.join(RESULTS, f"bound-share-{source}.json")
    check_out(parser, "--out", out)
    rows = model_rows(args, parser) if args.checkpoint else normal_rows(args, shapes)
    columns = ["source", "mask", "seq_len", "head_dim", "keys_per_step", "bounded", "heads"]
    columns += ["unmasked_warp_steps", "kept", "kept_after_first", "kept_whole_warpgroup"]
    print(table(rows, columns))
    payload = {"q_scale": args.q_scale, "dtype": args.dtype, "rows": rows}
    if args.checkpoint:
        payload.update(checkpoint=args.checkpoint, text=args.text, seq=args.seq)
    write_json(out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
