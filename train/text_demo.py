"""`make demo-text`: a small Llama trained on real English text, offline, on a CPU.

1. gathers the English text that the installed packages ship: every ``*.md``, ``*.rst``,
   ``LICENSE*`` / ``COPYING*`` file and ``*.dist-info/METADATA`` description under
   site-packages, in sorted path order, each once (whitespace-normalised duplicates
   dropped); every 10th document is held out for evaluation;
2. trains a byte-level BPE on the training documents (``python -m train.data tokenizer``);
3. writes the ``tiny`` preset, randomly initialised, with that tokenizer as an HF
   directory (``python -m models.convert --init``);
4. tokenizes both splits into token caches (``python -m train.data cache``);
5. trains with ``configs/text_demo.yaml`` on the caches (``--eval_on_start``) and prints
   the validation loss before training and after.

Everything lands under ``runs/text_demo/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import signal
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from models import convert
from train import data as data_lib
from train import data_cache, outputs
from train.build import data_eos
from train.config import parse_args, shipped_config
from train.errors import Preempted, signal_status
from train.loop import TrainingError, run

RUN_DIR = Path("runs") / "text_demo"
CONFIG = shipped_config("text_demo.yaml")
VOCAB_SIZE = 2048
MAX_FILE_BYTES = 200_000  # leaves out the few huge changelogs
HELD_OUT_EVERY = 10


def text_files(root: Path) -> list[Path]:
    """The text files under ``root`` the demo reads, in sorted (deterministic) order."""
    patterns = ("*.md", "*.rst", "LICENSE*", "COPYING*", "METADATA")
    found = {p for pattern in patterns for p in root.rglob(pattern) if p.is_file()}
    keep = [
        p
        for p in found
        if (p.name != "METADATA" or p.parent.name.endswith(".dist-info"))
        and 0 < p.stat().st_size <= MAX_FILE_BYTES
    ]
    return sorted(keep, key=lambda p: p.relative_to(root).as_posix())


def read_text(path: Path) -> str | None:
    """The file's English text: a METADATA file's description (after its headers)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if path.name == "METADATA":
        text = text.partition("\n\n")[2]
    return text if len(text.strip()) >= 200 else None


def gather(root: Path) -> list[str]:
    """Each distinct text once, in path order."""
    seen, texts = set(), []
    for path in text_files(root):
        text = read_text(path)
        if text is None:
            continue
        key = hashlib.sha256(" ".join(text.split()).encode()).digest()
        if key not in seen:
            seen.add(key)
            texts.append(text)
    return texts


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def main() -> None:
    start = time.time()
    if (usage := outputs.demo_help(sys.argv[1:], __doc__, str(RUN_DIR))) is not None:
        print(usage)
        return
    refused = outputs.demo_flag_error(sys.argv[1:], str(RUN_DIR))
    if refused:
        sys.exit(refused)
    if importlib.util.find_spec("tokenizers") is None:  # before anything is written
        sys.exit(
            "error: the text demo trains a tokenizer, which needs the 'tokenizers' package: "
            "pip install 'jflash[text]'"
        )
    try:
        demo(start)
    except (TrainingError, ValueError) as e:
        sys.exit(f"error: {e}")


def demo(start: float) -> None:
    """Text, tokenizer, model, caches, then the run and its validation loss."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["purelib"])
    texts = gather(root)
    train_texts = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    val_texts = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    if len(val_texts) < 2:
        sys.exit(f"error: only {len(texts)} text files under {root}: too few for the demo")
    train_file, val_file = RUN_DIR / "train.jsonl", RUN_DIR / "val.jsonl"
    _write_jsonl(train_file, train_texts)
    _write_jsonl(val_file, val_texts)
    chars = sum(map(len, train_texts)), sum(map(len, val_texts))
    shown = root.relative_to(Path.cwd()) if root.is_relative_to(Path.cwd()) else root
    print(
        f"text: {len(texts)} documents from {shown} ({len(train_texts)} train, "
        f"{chars[0]:,} chars; {len(val_texts)} validation, {chars[1]:,} chars)"
    )

    tokenizer = RUN_DIR / "tokenizer"
    data_lib.train_tokenizer([train_file], tokenizer, vocab_size=VOCAB_SIZE)
    model = RUN_DIR / "model"
    config = convert.init_hf("tiny", model, tokenizer=tokenizer)
    print(f"tokenizer: byte-level BPE of {VOCAB_SIZE} tokens; model: tiny, {model}")
    caches = {}
    for name, source in (("train", train_file), ("val", val_file)):
        cache, _ = data_cache.ensure_cache(
            source, RUN_DIR / "cache" / name, tokenizer=tokenizer, eos_id=config.eos_token_id
        )
        caches[name] = cache.path
        print(f"cache {name}: {cache.num_tokens:,} tokens in {cache.path}")

    argv = ["--config", str(CONFIG), "--model_name_or_path", str(model)]
    argv += ["--data_path", str(caches["train"]), "--eval_data_path", str(caches["val"])]
    argv += ["--eval_steps", "100", "--eval_on_start", "true"]
    argv += ["--output_dir", str(RUN_DIR / "run")]
    if not outputs.demo_resumes(sys.argv[1:]):  # a new run replaces the last
        argv += ["--overwrite_output_dir", "true"]
    cfg = parse_args(argv + sys.argv[1:])
    assert data_eos(cfg, config) == config.eos_token_id
    try:
        summary = run(cfg)
    except Preempted as e:  # SIGTERM: the step reached is saved (--save_on_preemption)
        print(e.line("python -m train.text_demo --resume_from_checkpoint latest"), file=sys.stderr)
        sys.exit(signal_status(signal.SIGTERM))
    evals = summary["eval"]
    after = evals[-1]["eval_loss"]
    if evals[0]["step"] != 0:  # a resume: the loss before training is in its log
        print(f"val loss after {summary['total_steps']} steps: {after:.3f}")
        return
    before = evals[0]["eval_loss"]
    print(
        f"val loss before training: {before:.3f} (ln(vocab) = {np.log(VOCAB_SIZE):.3f}); "
        f"after {summary['total_steps']} steps: {after:.3f}; {time.time() - start:.0f} s in all"
    )
    if not after < before - 1.0:
        sys.exit("error: the validation loss did not fall by 1 nat")


if __name__ == "__main__":
    main()
