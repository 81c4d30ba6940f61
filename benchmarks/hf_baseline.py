"""The baseline a user would run instead: HF transformers + PyTorch training of a Llama.

    python benchmarks/hf_baseline.py --model llama3.2-1b --context 32768 --steps 6
    python benchmarks/hf_baseline.py --model llama3.2-1b --longest --context 16384

`--longest` searches the longest context one training step runs at (doubling from
`--context`, then `--refine` bisections; a probe is one real step, an out-of-memory
error means "does not fit"): the baseline of "longest context per GPU count", to set
beside `python -m train.tools.capacity` (which reads jflash's side from XLA's memory plan).

Random-init `LlamaForCausalLM` of a jflash preset's shape, bf16 autocast with f32 master
weights, SDPA attention, gradient checkpointing, fused AdamW, batch 1 (what a user would
run instead of the jflash trainer). Prints tokens/s, model TFLOP/s and MFU with the same
FLOP formula as the jflash trainer (`models.flops`), and writes JSON. Runs on the GPU
machine's python, where torch, transformers and jax share one interpreter; jax is only
used for the FLOP count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402
from models.config import to_hf_config  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--out", default="")
    parser.add_argument("--longest", action="store_true", help="search the longest context")
    parser.add_argument("--max", type=int, default=1 << 20, help="--longest: largest context")
    parser.add_argument("--refine", type=int, default=3, help="--longest: bisection steps")
    args = parser.parse_args(argv)

    config = models.preset(args.model)
    if args.layers:
        config = config.replace(num_layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = transformers.LlamaConfig(**to_hf_config(config))
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).to(device)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    if args.longest:
        return longest(model, opt, config, device, args)
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
    tokens_per_s = args.context / seconds
    flops = models.training_flops_per_token(config, args.context) * tokens_per_s
    row = {
        "impl": f"transformers {transformers.__version__} + torch {torch.__version__}",
        "model": args.model,
        "layers": config.num_layers,
        "context": args.context,
        "step_s": seconds,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu": flops / 989e12 if device == "cuda" else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "final_loss": float(loss),
    }
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


def longest(model, opt, config, device, args) -> int:
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
    row = {
        "impl": f"transformers {transformers.__version__} + torch {torch.__version__}",
        "model": args.model,
        "layers": config.num_layers,
        "method": "one real training step per probe; out of memory = does not fit",
        "longest": best,
        "probes": probes,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "probes"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
