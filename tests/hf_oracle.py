"""HuggingFace PyTorch oracle for the model parity tests.

Runs under the oracle interpreter (``$JFLASH_ORACLE_PYTHON``, default
``.venv-oracle/bin/python``: Python with torch + transformers, and no jax), never
imported by the tests. Two modes::

    python tests/hf_oracle.py make SPECS.json OUT_DIR
        for every spec: build a random LlamaForCausalLM with transformers itself,
        save_pretrained it to OUT_DIR/<name>/hf (optionally sharded, optionally a
        bfloat16 copy in hf_bf16), and write float32 references as .npy:
        ids, logits, logits at offset positions, RoPE inv_freq/cos/sin, and per
        decoder layer its input, both norms' outputs, attention and MLP outputs.

    python tests/hf_oracle.py logits JOBS.json
        for every job {"model": DIR, "ids": NPY, "out": NPY}: load the directory
        with from_pretrained and write float32 logits.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _capture(model: LlamaForCausalLM, ids: torch.Tensor, out: str) -> None:
    """Runs a forward with hooks and writes every layer's intermediate tensors."""
    saved: dict[str, torch.Tensor] = {}
    hooks = []

    def keep(name, pick):
        def hook(module, args, kwargs, output):
            saved[name] = pick(args, kwargs, output)

        return hook

    def layer_input(args, kwargs, output):
        return args[0] if args else kwargs["hidden_states"]

    def first(args, kwargs, output):
        return output[0] if isinstance(output, tuple) else output

    rope = model.model.rotary_emb
    hooks.append(rope.register_forward_hook(keep("cos", lambda a, k, o: o[0]), with_kwargs=True))
    hooks.append(rope.register_forward_hook(keep("sin", lambda a, k, o: o[1]), with_kwargs=True))
    for i, layer in enumerate(model.model.layers):
        p = f"layer{i}_"
        hooks += [
            layer.register_forward_hook(keep(p + "in", layer_input), with_kwargs=True),
            layer.register_forward_hook(keep(p + "out", first), with_kwargs=True),
            layer.input_layernorm.register_forward_hook(
                keep(p + "input_norm", first), with_kwargs=True
            ),
            layer.self_attn.register_forward_hook(keep(p + "attn", first), with_kwargs=True),
            layer.post_attention_layernorm.register_forward_hook(
                keep(p + "post_norm_in", layer_input), with_kwargs=True
            ),
            layer.post_attention_layernorm.register_forward_hook(
                keep(p + "post_norm", first), with_kwargs=True
            ),
            layer.mlp.register_forward_hook(keep(p + "mlp", first), with_kwargs=True),
        ]
    with torch.no_grad():
        saved["logits"] = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    saved["inv_freq"] = rope.inv_freq
    for name, tensor in saved.items():
        np.save(os.path.join(out, f"{name}.npy"), _np(tensor))


def make(specs_path: str, out_root: str) -> None:
    with open(specs_path) as f:
        specs = json.load(f)
    for spec in specs:
        out = os.path.join(out_root, spec["name"])
        os.makedirs(out, exist_ok=True)
        torch.manual_seed(spec["seed"])
        config = LlamaConfig(**spec["config"])
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        with torch.no_grad():  # HF initialises norms to 1: randomise so scale bugs show
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
        shard = spec.get("max_shard_size")
        model.save_pretrained(
            os.path.join(out, "hf"), **({"max_shard_size": shard} if shard else {})
        )
        rng = np.random.default_rng(spec["seed"])
        ids = rng.integers(0, config.vocab_size, size=(spec["batch"], spec["seq_len"]))
        np.save(os.path.join(out, "ids.npy"), ids.astype(np.int32))
        ids_t = torch.from_numpy(ids)
        _capture(model, ids_t, out)
        positions = np.arange(spec["seq_len"])[None].repeat(spec["batch"], 0) + spec["offset"]
        np.save(os.path.join(out, "positions_offset.npy"), positions.astype(np.int32))
        with torch.no_grad():
            logits = model(input_ids=ids_t, position_ids=torch.from_numpy(positions)).logits
        np.save(os.path.join(out, "logits_offset.npy"), _np(logits))
        if spec.get("bf16_copy"):
            model.to(torch.bfloat16).save_pretrained(os.path.join(out, "hf_bf16"))


def logits(jobs_path: str) -> None:
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        model = LlamaForCausalLM.from_pretrained(
            job["model"], torch_dtype=torch.float32, attn_implementation="eager"
        ).eval()
        ids = torch.from_numpy(np.load(job["ids"]).astype(np.int64))
        with torch.no_grad():
            np.save(job["out"], _np(model(input_ids=ids).logits))


if __name__ == "__main__":
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    mode, *rest = sys.argv[1:]
    {"make": make, "logits": logits}[mode](*rest)
