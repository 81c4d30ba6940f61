"""The Python examples of README.md and docs/*.md run as written.

A document's ```python blocks run in order in one namespace (a later block uses what
an earlier one defined). That namespace starts with only the inputs the text
describes and leaves to the reader: `q [B, T, N, H]`, `k`, `v [B, T, K, H]`,
`doc_ids [B, T]`, `seq_len` and `input_ids`, at tiny sizes on the simulated CPU
devices; every import and other name must come from the blocks themselves. The
models example's HF directories are a tiny random model written here and a
temporary output directory.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import TOLERANCE

import jflash

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _examples(document: str) -> list[str]:
    return _BLOCK.findall((ROOT / document).read_text())


WITH_EXAMPLES = [d for d in DOCUMENTS if _examples(d)]


def test_the_library_documents_have_examples():
    """The pages that show the library keep showing it (a renamed fence is not lost)."""
    assert {"README.md", "docs/library.md"} <= set(WITH_EXAMPLES)


def _inputs(batch=2, seq_len=64, q_heads=4, kv_heads=2, head_dim=32):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return dict(
        q=jax.random.normal(kq, (batch, seq_len, q_heads, head_dim), jnp.float32),
        k=jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim), jnp.float32),
        v=jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim), jnp.float32),
        doc_ids=jnp.repeat(jnp.array([[0, 0, 1, 2]] * batch, jnp.int32), seq_len // 4, axis=1),
        seq_len=seq_len,
        input_ids=jnp.arange(batch * 16, dtype=jnp.int32).reshape(batch, 16) % 97,
    )


def _hf_paths(code: str, tmp_path: pathlib.Path) -> str:
    """The models example's directories, pointed at a tiny random HF model."""
    if "/path/to/" not in code:
        return code
    from models.convert import init_hf

    model = tmp_path / "tiny-hf"
    init_hf("tiny", model)
    code = re.sub(r'"/path/to/[^"]*"', repr(str(model)), code)
    return code.replace('"/out/hf"', repr(str(tmp_path / "out-hf")))


@pytest.mark.multi_device(4)
@pytest.mark.parametrize("document", WITH_EXAMPLES)
def test_examples_run_as_written(document, tmp_path, capsys):
    names = _inputs()
    given = dict(names)
    for i, code in enumerate(_examples(document)):
        code = _hf_paths(code, tmp_path)
        exec(compile(code, f"{document}, python block {i + 1}", "exec"), names)  # noqa: S102
    printed = capsys.readouterr().out
    if "jflash.describe()" in "".join(_examples(document)):
        assert "implementation=None ->" in printed
    if "ring_attention" in "".join(_examples(document)):
        # The sharded examples end on the zigzag-ordered output of the user's
        # shard_map: back in natural order it is one device's attention.
        q, k, v = given["q"], given["k"], given["v"]
        want, want_lse = jflash.attention_reference(q, k, v, causal=True)
        tol = TOLERANCE[jnp.float32]["out"]
        np.testing.assert_allclose(
            jflash.unzigzag(names["out"], 4), want, atol=tol, rtol=tol, err_msg=document
        )
        np.testing.assert_allclose(names["lse"], want_lse, atol=tol, rtol=tol)
        np.testing.assert_array_equal(
            names["pos"], jflash.zigzag(jnp.arange(given["seq_len"]), 4, axis=0)
        )
    if "models.logits" in "".join(_examples(document)):
        batch, length = given["input_ids"].shape
        assert names["logits"].shape == (batch, length, names["config"].vocab_size)
        assert names["logits"].dtype == jnp.float32
        assert (tmp_path / "out-hf" / "config.json").is_file()
