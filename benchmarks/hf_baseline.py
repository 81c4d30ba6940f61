"""The baselines a user would run instead: HF transformers + PyTorch training of a Llama,
plain or with liger-kernel's fused kernels.

    python benchmarks/hf_baseline.py --model llama3.2-1b --context 32768 --steps 6
    python benchmarks/hf_baseline.py --stack hf,liger --context 32768 --steps 3 --warmup 1
    python benchmarks/hf_baseline.py --model llama3.2-1b --longest --context 16384

`--stack` picks the baselines, run one after the other in one process (and one machine
session): `hf` is HF transformers as is; `liger` adds
`liger_kernel.transformers.apply_liger_kernel_to_llama()` (fused linear + cross-entropy,
so the logits are never materialized, and Triton RMSNorm, RoPE and SwiGLU). liger-kernel
is an optional import: where it is missing its row says so. `hf` always runs first, since
liger patches transformers' Llama module for the rest of the process.

`--remat` sets what the backward recomputes: `full` (the default, HF's
`gradient_checkpointing_enable()`: each decoder layer's forward again), `dots`
(selective checkpointing, as torchtitan's: each layer's matmul and attention outputs
saved, the rest recomputed; PyTorch's `create_selective_checkpoint_contexts`) or `none`
(everything saved: fastest where it fits). `--compile` compiles each decoder layer
(`torch.compile`, per block as torchtitan does; the first steps compile, so give
`--warmup` 2 or more). A stack that fails (out of memory, a compile error) gets a row
with its one-line error, and the next stack runs.

`--longest` searches the longest context one training step runs at (doubling from
`--context`, then `--refine` bisections; a probe is one real step, an out-of-memory
error means "does not fit"): the baseline of "longest context per GPU count", to set
beside `python -m train.tools.capacity` (which reads jflash's side from XLA's memory plan).

Random-init `LlamaForCausalLM` of a jflash preset's shape, bf16 autocast with f32 master
weights, SDPA attention, `--remat` checkpointing, fused AdamW, batch 1 (what a user would
run instead of the jflash trainer). Prints tokens/s, model TFLOP/s and MFU with the same
FLOP formula as the jflash trainer (`models.flops`), one JSON line per stack, and writes
JSON (`--out`: the row, or `{"rows": [...]}` for several stacks). Runs on the GPU
machine's python, where torch, transformers and jax share one interpreter; jax is only
used for the FLOP count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402
from benchmarks.common import check_out  # noqa: E402
from models.config import to_hf_config  # noqa: E402

STACKS = ("hf", "liger")  # in the order they run: liger patches transformers for good
REMATS = ("full", "dots", "none")
PEAK_TFLOPS = 989.0  # bf16 dense peak of an H100/H200, the trainer's MFU denominator


def parse_stacks(text: str) -> list[str]:
    """`--stack`'s comma list, in run order (`hf` before `liger`); ValueError naming an
    unknown or repeated name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STACKS]
    if unknown or not names:
        raise ValueError(f"--stack {text!r}: a comma list of {', '.join(STACKS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--stack {text!r} names a stack twice")
    return [s for s in STACKS if s in names]


def stack_version(stack: str) -> str:
    """The stack's package versions for the row's `impl`, or ImportError."""
    import torch
    import transformers

    base = f"transformers {transformers.__version__} + torch {torch.__version__}"
    if stack == "liger":
        from importlib.metadata import version

        import liger_kernel.transformers  # noqa: F401 - ImportError where not installed

        return f"liger-kernel {version('liger-kernel')} + {base}"
    return base


def stack_unavailable(stack: str) -> str | None:
    """Why `stack` cannot run here (a missing optional package), or None."""
    try:
        stack_version(stack)
    except ImportError as e:
        return f"not installed ({e})"
    return None


def selective_checkpointing():
    """`gradient_checkpointing_kwargs` for `--remat dots`: non-reentrant checkpoints whose
    policy saves matmul and attention outputs and recomputes the rest."""
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, policy),
    }


def build(stack: str, config, device: str, remat: str = "full", compile_blocks: bool = False):
    """The stack's random-init model (seed 0), checkpointed as `remat` says and with each
    decoder layer compiled where `compile_blocks`, and fused AdamW."""
    import torch
    import transformers

    if stack == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        # Class-level patches (RMSNorm, SwiGLU MLP, RoPE, the causal-LM forward with the
        # fused linear cross-entropy): the model built next uses them.
        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True
        )
    hf_config = transformers.LlamaConfig(**to_hf_config(config))
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).to(device)
    if remat == "full":
        model.gradient_checkpointing_enable()
    elif remat == "dots":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpointing())
    model.config.use_cache = False
    if compile_blocks:  # after the checkpointing, which each compiled layer then holds
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    return model, opt


def result_row(
    stack: str, impl: str, config, args, seconds: float, peak_gib, loss, on_gpu: bool
) -> dict:
    """One stack's row: tokens/s, model TFLOP/s and MFU (the trainer's FLOP formula)."""
    tokens_per_s = args.context / seconds
    flops = models.training_flops_per_token(config, args.context) * tokens_per_s
    return {
        "stack": stack,
        "impl": impl,
        "model": args.model,
        "layers": config.num_layers,
        "remat": args.remat,
        "compile": args.compile,
        "context": args.context,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu": flops / (PEAK_TFLOPS * 1e12) if on_gpu else None,
        "peak_memory_gib": peak_gib,
        "final_loss": loss,
    }


def time_stack(stack: str, config, device: str, args) -> dict:
    import torch

    model, opt = build(stack, config, device, args.remat, args.compile)
    ids = torch.randint(0, config.vocab_size, (1, args.context), device=device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return result_row(
        stack, stack_version(stack), config, args, seconds, peak, loss.item(), device == "cuda"
    )


def release(device: str) -> None:
    """Frees the last stack's model and optimizer before the next one is built."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument(
        "--stack", default="hf", help="comma list of baselines: hf, liger (run in that order)"
    )
    parser.add_argument(
        "--remat", default="full", choices=REMATS, help="what the backward recomputes"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each layer")
    parser.add_argument("--out", default="")
    parser.add_argument("--longest", action="store_true", help="search the longest context")
    parser.add_argument("--max", type=int, default=1 << 20, help="--longest: largest context")
    parser.add_argument("--refine", type=int, default=3, help="--longest: bisection steps")
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    try:
        stacks = parse_stacks(args.stack)
    except ValueError as e:
        parser.error(str(e))
    try:
        import torch
    except ImportError as e:  # the baselines' own stack, not a jflash dependency
        parser.error(f"the PyTorch baselines need torch and transformers installed ({e})")

    config = models.preset(args.model)
    if args.layers:
        config = config.replace(num_layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for stack in stacks:
        missing = stack_unavailable(stack)
        if missing is not None:
            print(f"note: --stack {stack} skipped: {missing}", flush=True)
            row = {"stack": stack, "model": args.model, "error": missing}
        elif args.longest:
            model, opt = build(stack, config, device, args.remat, args.compile)
            row = longest(stack, model, opt, config, device, args)
            del model, opt
        else:
            try:
                row = time_stack(stack, config, device, args)
            except Exception as e:  # noqa: BLE001 - the row says why; the next stack runs
                traceback.print_exc()
                first = (str(e).strip().splitlines() or [""])[0][:300]
                row = {
                    "stack": stack,
                    "model": args.model,
                    "remat": args.remat,
                    "compile": args.compile,
                    "context": args.context,
                    "error": f"{type(e).__name__}: {first}",
                }
        release(device)
        print(json.dumps({k: v for k, v in row.items() if k != "probes"}), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows[0] if len(rows) == 1 else {"rows": rows}, f, indent=1)
    return 0


def longest(stack, model, opt, config, device, args) -> dict:
    import torch

    from train.tools.capacity import search_longest

    def fits_at(context: int) -> dict:
        ids = torch.randint(0, config.vocab_size, (1, context), device=device)
        try:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
            result = {"fits": True, "gib": peak}
        except torch.OutOfMemoryError:
            result = {"fits": False, "gib": None, "error": "out of memory"}
        finally:
            loss = ids = None
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        print(
            f"  context {context:>9,}: {'fits' if result['fits'] else 'out of memory'}", flush=True
        )
        return result

    best, probes = search_longest(fits_at, args.context, args.max, args.refine, granule=1024)
    return {
        "stack": stack,
        "impl": stack_version(stack),
        "model": args.model,
        "layers": config.num_layers,
        "remat": args.remat,
        "compile": args.compile,
        "method": "one real training step per probe; out of memory = does not fit",
        "longest": best,
        "probes": probes,
    }


if __name__ == "__main__":
    sys.exit(main())
