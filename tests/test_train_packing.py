"""Packed documents: a row of several documents trains exactly like the documents run
one by one (attention masked per document, RoPE positions restarting, an EOS between
them, no label across a boundary), on every attention kind the trainer runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from train import data as data_lib
from train.build import build, end_of_text
from train.config import parse_args
from train.dataset import TokenDataset
from train.step import gradients

SEQ_LEN = 32
# 9 + 6 + 14 tokens and an EOS after each: exactly one row of 32.
DOC_LENGTHS = (9, 6, 14)


def _documents(vocab: int, eos: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    docs = []
    for n in DOC_LENGTHS:
        doc = rng.integers(3, vocab, size=n).astype(np.int32)
        docs.append(np.where(doc == eos, eos + 1, doc))
    return docs


def _trainer(tmp_path, devices: int, *flags: str):
    config = models.TINY
    docs = _documents(config.vocab_size, end_of_text(config.replace(dtype="float32")))
    path = tmp_path / "docs.pkl"
    data_lib.save_dataset(path, docs)
    argv = ["--model_name_or_path", "tiny", "--data_path", str(path), "--bf16", "false"]
    argv += ["--model_max_length", str(SEQ_LEN), "--output_dir", str(tmp_path / "out")]
    cfg = parse_args([*argv, *flags])
    return build(cfg, devices=jax.devices()[:devices]), docs


def _one_by_one(config, params, docs, eos: int):
    """`(grads, mean loss)` of the documents run separately, each followed by EOS,
    dense attention, positions from 0: the reference."""

    def total(params):
        loss, count = 0.0, 0
        for doc in docs:
            ids = jnp.asarray(np.append(doc, eos))[None]
            logits = models.logits(config, params, ids, attention="xla")[0, :-1]
            logp = jax.nn.log_softmax(logits, axis=-1)
            loss -= jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1).sum()
            count += len(doc)
        return loss / count

    loss, grads = jax.value_and_grad(total)(params)
    return grads, loss


def _packed(trainer):
    step = jax.jit(functools.partial(gradients, spec=trainer.spec))
    with jax.set_mesh(trainer.mesh):
        batch = trainer.batch(0)
        grads, (loss, count) = step(trainer.state["params"], batch)
    return jax.device_get(grads), float(loss), int(count), jax.device_get(batch)


@pytest.mark.parametrize(
    "devices, flags",
    [
        pytest.param(1, ["--attention", "xla", "--mesh", "data=1,fsdp=1,seq=1"], id="xla"),
        pytest.param(1, ["--attention", "jflash", "--mesh", "data=1,fsdp=1,seq=1"], id="jflash"),
        pytest.param(
            2,
            ["--attention", "ring", "--mesh", "data=1,fsdp=1,seq=2", "--ring_layout", "zigzag"],
            id="ring-zigzag",
            marks=pytest.mark.multi_device(2),
        ),
        pytest.param(
            2,
            ["--attention", "ring", "--mesh", "data=1,fsdp=1,seq=2", "--ring_layout", "striped"],
            id="ring-striped",
            marks=pytest.mark.multi_device(2),
        ),
        pytest.param(
            2,
            ["--attention", "ring", "--mesh", "data=1,fsdp=1,seq=2", "--ring_strategy", "ulysses"],
            id="ulysses",
            marks=pytest.mark.multi_device(2),
        ),
        pytest.param(
            4,
            [
                "--attention",
                "ring",
                "--mesh",
                "data=1,fsdp=1,seq=2,seq_a2a=2",
                "--ring_strategy",
                "hybrid",
            ],
            id="hybrid",
            marks=pytest.mark.multi_device(4),
        ),
    ],
)
@pytest.mark.slow
def test_packed_row_equals_documents_one_by_one(tmp_path, devices, flags):
    trainer, docs = _trainer(tmp_path, devices, *flags)
    eos = end_of_text(trainer.config)
    with jax.default_matmul_precision("highest"):  # f32 on GPUs too, not TF32
        grads, loss, count, batch = _packed(trainer)
    # The row holds the three documents, each followed by EOS; segment ids and
    # positions restart with each one; no label crosses a boundary.
    ids = batch["input_ids"][0, 0]
    assert ids.tolist() == np.concatenate([np.append(d, eos) for d in docs]).tolist()
    starts = np.cumsum([0, *[n + 1 for n in DOC_LENGTHS]])[:-1]
    assert batch["positions"][0, 0].tolist() == [
        t - starts[np.searchsorted(starts, t, side="right") - 1] for t in range(SEQ_LEN)
    ]
    assert batch["segment_ids"][0, 0].tolist() == sum(
        ([i] * (n + 1) for i, n in enumerate(DOC_LENGTHS)), []
    )
    assert count == sum(DOC_LENGTHS)

    params = jax.device_get(trainer.state["params"])
    with jax.default_matmul_precision("highest"):
        ref_grads, ref_loss = _one_by_one(trainer.config, params, docs, eos)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    ref_flat = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in flat:
        ref = np.asarray(ref_flat[path])
        err = np.linalg.norm(g - ref) / np.linalg.norm(ref)
        assert err < 1e-4, (jax.tree_util.keystr(path), err)


@pytest.mark.slow
def test_running_positions_and_unmasked_packing(tmp_path):
    """Running positions under the document mask train the same up to rounding (RoPE
    is relative: a document's positions shifted by a constant give the same scores);
    attention across documents trains on something else (so the test above can tell)."""
    mesh = ["--attention", "xla", "--mesh", "data=1,fsdp=1,seq=1"]
    base, docs = _trainer(tmp_path, 1, *mesh)
    _, packed_loss, _, _ = _packed(base)
    running, _ = _trainer(tmp_path, 1, *mesh, "--packing_positions", "running")
    _, loss, _, batch = _packed(running)
    assert batch["positions"][0, 0].tolist() == list(range(SEQ_LEN))
    assert loss == pytest.approx(packed_loss, rel=1e-5)
    crossing, _ = _trainer(
        tmp_path, 1, *mesh, "--packing_positions", "running", "--mask_documents", "false"
    )
    _, loss, _, _ = _packed(crossing)
    assert abs(loss - packed_loss) > 1e-3
    with pytest.raises(ValueError, match="per_document needs --mask_documents true"):
        parse_args(["--mask_documents", "false"])


def test_unpacked_data_passes_no_segment_ids(tmp_path):
    """Rows of one document each (a token stream cut into rows, or `sample` data) have
    nothing to mask: the step passes no segment ids (the faster kernels, the same mask);
    rows that hold several documents pass them, from memory and from a token cache."""
    stream = tmp_path / "stream.npy"
    data_lib.save_dataset(stream, np.arange(3 * SEQ_LEN + 5, dtype=np.int32) % 200 + 3)
    argv = ["--model_name_or_path", "tiny", "--model_max_length", str(SEQ_LEN)]
    argv += ["--attention", "jflash", "--mesh", "data=1,fsdp=1,seq=1"]
    for path, packed in [(stream, False), (tmp_path / "docs.pkl", True)]:
        if packed:
            data_lib.save_dataset(path, _documents(models.TINY.vocab_size, 2))
        for cache in ([], ["--data_cache_dir", str(tmp_path / "caches")]):
            out = ["--output_dir", str(tmp_path / f"out-{packed}-{bool(cache)}")]
            cfg = parse_args([*argv, "--data_path", str(path), *out, *cache])
            trainer = build(cfg, devices=jax.devices()[:1])
            assert trainer.rows.packed == packed
            assert trainer.spec.mask_documents == packed
    cfg = parse_args([*argv, "--data_path", "sample", "--output_dir", str(tmp_path / "s")])
    sample = build(cfg, devices=jax.devices()[:1])
    assert not sample.rows.packed and not sample.spec.mask_documents
    assert (sample.rows.labels[:, -1] == -100).all()  # the EOS ends each row's example


def test_document_positions():
    seg = np.array([[0, 0, 0, 1, 1, 2], [3, 3, 3, 3, 3, 3]])
    assert data_lib.document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], list(range(6))]


def test_eos_goes_between_documents_once():
    """An example that already ends with EOS gets no second one."""
    dataset = TokenDataset.from_examples("x", [np.array([5, 6]), np.array([7, 2])])
    rows = dataset.rows(5, eos_id=2)
    assert rows.input_ids.tolist() == [[5, 6, 2, 7, 2]]
    assert rows.labels.tolist() == [[6, 2, -100, 2, -100]]
    assert rows.segment_ids.tolist() == [[0, 0, 0, 1, 1]]
    assert end_of_text(models.TINY.replace(eos_token_id=(128001, 128009), vocab_size=128256)) == (
        128001
    )
    assert end_of_text(models.TINY.replace(eos_token_id=None)) is None


def test_eos_after_a_record_takes_its_last_tokens_labelling():
    """The EOS after a record whose last label is -100 (a prompt-only record) is not
    learned; after a record whose last token is labelled, or one without labels, it is."""
    ids = [np.array([5, 6]), np.array([7, 8]), np.array([9, 10]), np.array([11])]
    labels = [np.array([-100, -100]), np.array([-100, 8]), np.array([9, -100]), None]
    rows = TokenDataset.from_examples("x", ids, labels).rows(12, eos_id=2, pad_last=True)
    assert rows.input_ids.tolist() == [[5, 6, 2, 7, 8, 2, 9, 10, 2, 11, 2, 0]]
    # labels[t] is the target of input_ids[t]: the EOS's label sits on the token before it.
    assert rows.labels.tolist() == [[-100, -100, -100, 8, 2, -100, -100, -100, -100, 2, -100, -100]]


@pytest.mark.gpu
def test_cudnn_attention_keeps_to_documents():
    """cuDNN takes the documents as a dense mask: the same output as the dense
    reference with segment ids, in bf16."""
    from models.attention import AttentionConfig, attend, dense_causal_attention

    keys = jax.random.split(jax.random.key(0), 3)
    b, t, n, k, h = 2, 256, 4, 2, 64
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kv = [jax.random.normal(key, (b, t, k, h), jnp.bfloat16) for key in keys[1:]]
    seg = jnp.asarray(np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]]), t // 4, axis=1))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    got = attend(q, *kv, pos, AttentionConfig(kind="cudnn"), seg)
    f32 = [x.astype(jnp.float32) for x in (q, *kv)]
    want = dense_causal_attention(*f32, pos, pos, seg, seg)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)
    unmasked = attend(q, *kv, pos, AttentionConfig(kind="cudnn"))
    assert not np.allclose(np.asarray(unmasked, np.float32), np.asarray(want), atol=2e-2)


def test_accumulated_micro_batches_equal_one_batch(tmp_path):
    """`--gradient_accumulation_steps 2` of one row each (the scan over micro-batches)
    gives the gradients and loss of one batch of both rows (no scan): the step's rows,
    its token-normalised loss and its f32 gradients are the same."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, models.TINY.vocab_size, size=n).astype(np.int32) for n in (40, 50)]
    path = tmp_path / "docs.pkl"
    data_lib.save_dataset(path, docs)
    argv = ["--model_name_or_path", "tiny", "--data_path", str(path), "--bf16", "false"]
    argv += ["--model_max_length", str(SEQ_LEN), "--attention", "xla"]
    argv += ["--mesh", "data=1,fsdp=1,seq=1"]
    results = []
    for batch, accum in ((2, 1), (1, 2)):
        flags = ["--per_device_train_batch_size", str(batch)]
        flags += ["--gradient_accumulation_steps", str(accum)]
        flags += ["--output_dir", str(tmp_path / f"out{accum}")]
        trainer = build(parse_args([*argv, *flags]), devices=jax.devices()[:1])
        with jax.default_matmul_precision("highest"):
            grads, loss, count, rows = _packed(trainer)
        assert rows["input_ids"].shape == (accum, batch, SEQ_LEN)
        results.append((grads, loss, count, rows["input_ids"].reshape(-1, SEQ_LEN)))
    (g1, loss1, n1, rows1), (g2, loss2, n2, rows2) = results
    assert rows1.tolist() == rows2.tolist() and n1 == n2 > SEQ_LEN
    assert loss2 == pytest.approx(loss1, rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _whole_examples(rng, n: int, seq_len: int):
    """`n` prompt/completion-like examples of 1 to 2.5 rows' length (most shorter than a
    row), tokens >= 3 (EOS 2, padding 0); a third with a prompt labelled -100."""
    ids, labels = [], []
    for i in range(n):
        length = (
            int(rng.integers(1, seq_len + 1)) if i % 6 else int(rng.integers(1, 5 * seq_len // 2))
        )
        doc = rng.integers(3, 500, size=length).astype(np.int32)
        ids.append(doc)
        label = doc.copy()
        if i % 3 == 0:
            label[: length // 2] = -100
        labels.append(label if i % 3 == 0 else None)
    return ids, labels


@pytest.mark.parametrize("mask_boundaries", [True, False])
def test_whole_packing_never_cuts_an_example_that_fits_a_row(mask_boundaries):
    """`packing="whole"`: every example (with its EOS) of at most a row lies in one row;
    a longer one starts a row and runs on as in the stream; the rest of a row an example
    did not fit in is padding (token 0, never labelled, the segment before it); each
    example's labels are those it has on its own, and no token is dropped (`pad_last`)
    but the EOS of an example exactly a row long, which fills its row without it."""
    seq_len, eos = 16, 2
    ids, labels = _whole_examples(np.random.default_rng(1), 80, seq_len)
    dataset = TokenDataset.from_examples("x", ids, labels)
    rows = dataset.rows(
        seq_len, eos_id=eos, mask_boundaries=mask_boundaries, pad_last=True, packing="whole"
    )
    pieces = []  # (row, start in row, tokens, labels) of each segment's real tokens
    for r in range(rows.num_rows):
        real = rows.input_ids[r] != 0
        n = int(real.sum())
        assert real[:n].all(), "padding only ends a row"
        assert (rows.labels[r, n:] == -100).all(), "padding is never labelled"
        assert (rows.segment_ids[r, n:] == rows.segment_ids[r, n - 1]).all()
        seg = rows.segment_ids[r, :n]
        for s in np.unique(seg):
            at = np.flatnonzero(seg == s)
            pieces.append((r, int(at[0]), rows.input_ids[r, at], rows.labels[r, at]))
    eos_left_out = 0  # labelled EOS targets of examples a row long
    for i, doc in enumerate(ids):
        alone = TokenDataset.from_examples("x", [doc], [labels[i]]).rows(len(doc) + 1, eos_id=eos)
        want_ids, want_labels = alone.input_ids[0], alone.labels[0]
        if len(want_ids) == seq_len + 1:  # its row holds it without its EOS
            eos_left_out += int(want_labels[-2] != -100)
            want_ids, want_labels = want_ids[:-1], np.append(want_labels[:-2], -100)
        got_ids, got_labels = [], []
        first = pieces[0]
        while sum(map(len, got_ids)) < len(want_ids):
            row, start, piece_ids, piece_labels = pieces.pop(0)
            got_ids.append(piece_ids)
            got_labels.append(piece_labels)
        if len(want_ids) <= seq_len:
            assert len(got_ids) == 1, f"example {i} ({len(want_ids)} tokens) is cut"
        else:
            assert first[1] == 0, f"example {i}, longer than a row, starts inside one"
        np.testing.assert_array_equal(np.concatenate(got_ids), want_ids)
        # Unmasked, an example's last label is the next one's first token where that
        # follows it in the row (as in the stream).
        last = None if mask_boundaries else -1
        np.testing.assert_array_equal(np.concatenate(got_labels)[:last], want_labels[:last])
    assert not pieces
    stream = dataset.rows(seq_len, eos_id=eos, mask_boundaries=mask_boundaries, pad_last=True)
    assert rows.num_rows > stream.num_rows
    if mask_boundaries:  # every label of the stream, none lost to a cut
        assert (stream.labels != -100).sum() == (rows.labels != -100).sum() + eos_left_out


def test_whole_packing_pads_rows_and_splits_over_long_examples_from_a_row_start():
    """A row's rest that the next example does not fit is padding; an example longer
    than a row starts the next row and runs on across rows; training drops the tail that
    does not fill a row, evaluation (`pad_last`) pads it."""
    docs = [np.arange(1, 4), np.arange(10, 16), np.arange(20, 22), np.arange(30, 40)]
    labels = [None, np.array([-100, -100, -100, 13, 14, 15]), None, None]
    dataset = TokenDataset.from_examples("x", docs, labels)
    rows = dataset.rows(8, eos_id=0, pad_last=True, packing="whole")
    assert rows.input_ids.tolist() == [
        [1, 2, 3, 0, 0, 0, 0, 0],
        [10, 11, 12, 13, 14, 15, 0, 0],
        [20, 21, 0, 0, 0, 0, 0, 0],
        [30, 31, 32, 33, 34, 35, 36, 37],
        [38, 39, 0, 0, 0, 0, 0, 0],
    ]
    x = -100
    assert rows.labels.tolist() == [
        [2, 3, 0, x, x, x, x, x],
        [x, x, 13, 14, 15, 0, x, x],
        [21, 0, x, x, x, x, x, x],
        [31, 32, 33, 34, 35, 36, 37, 38],
        [39, 0, x, x, x, x, x, x],
    ]
    assert not rows.segment_ids.any() and not rows.packed
    assert dataset.rows(8, eos_id=0, packing="whole").num_rows == 4
    shared = TokenDataset.from_examples("x", [np.arange(1, 4), np.arange(5, 8), np.arange(9, 14)])
    rows = shared.rows(8, eos_id=0, pad_last=True, packing="whole")
    assert rows.input_ids.tolist() == [[1, 2, 3, 0, 5, 6, 7, 0], [9, 10, 11, 12, 13, 0, 0, 0]]
    assert rows.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [0] * 8]
    assert rows.packed
