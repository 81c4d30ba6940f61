"""Unit tests of models/ that need no oracle: config, FLOPs, params, loss, conversion."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding, PartitionSpec

import jflash
import models
import models.files
from models.attention import attend
from models.convert import main as convert_main
from models.safetensors_io import SafetensorsFile, save_file

SMALL = models.TINY.replace(vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8)
SEQ = 32


@pytest.fixture(scope="module", autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def params():
    return jax.jit(models.init_params, static_argnums=0)(SMALL, jax.random.key(0))


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(1), (2, SEQ), 0, SMALL.vocab_size)


_logits = jax.jit(models.logits, static_argnums=0)


# --- config -----------------------------------------------------------------------

_HF = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
}
_LLAMA3 = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_config_reads_transformers4_and_5_rope_spellings():
    v4 = models.from_hf_config(
        _HF | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3"} | _LLAMA3}
    )
    v5 = models.from_hf_config(
        _HF | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5} | _LLAMA3}
    )
    assert v4 == v5
    assert v4.rope == models.RopeConfig(theta=5e5, type="llama3", **_LLAMA3)
    assert v4.head_dim == 16 and v4.num_kv_heads == 2 and not v4.tie_word_embeddings
    default = models.from_hf_config(_HF | {"rope_parameters": {"rope_type": "default"}})
    assert default.rope == models.RopeConfig(theta=10000.0)
    assert models.from_hf_config(_HF | {"head_dim": 40}).head_dim == 40


def test_config_reads_rope_as_transformers_5_does():
    """transformers 5 standardises a Llama's RoPE so: `rope_scaling` over
    `rope_parameters`, theta from the object, then the top level, then 10,000; llama3's
    original length from the top level, then the object, then max_position_embeddings.
    Two objects that disagree are refused (transformers silently reads `rope_scaling`
    alone, the theta of `rope_parameters` dropped), as are objects nested by layer type
    (transformers' Llama ignores them)."""
    linear = {"rope_type": "linear", "factor": 4.0}
    read = models.from_hf_config(_HF | {"rope_parameters": linear, "rope_scaling": linear})
    assert read.rope == models.RopeConfig(theta=10000.0, type="linear", factor=4.0)
    both = _HF | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    with pytest.raises(ValueError, match=r"give different RoPE .*reads rope_scaling alone"):
        models.from_hf_config(both | {"rope_scaling": linear})
    same_theta = both | {"rope_theta": 5e5, "rope_scaling": {"rope_type": "default"}}
    assert models.from_hf_config(same_theta).rope == models.RopeConfig(theta=5e5)
    with pytest.raises(ValueError, match=r"nested by layer type \(full_attention\)"):
        models.from_hf_config(_HF | {"rope_parameters": {"full_attention": linear}})
    llama3 = {"rope_type": "llama3"} | _LLAMA3
    top = models.from_hf_config(
        _HF | {"rope_scaling": llama3, "original_max_position_embeddings": 64}
    )
    assert top.rope.original_max_position_embeddings == 64
    unsaid = {k: v for k, v in llama3.items() if k != "original_max_position_embeddings"}
    default = models.from_hf_config(_HF | {"rope_scaling": unsaid, "max_position_embeddings": 512})
    assert default.rope.original_max_position_embeddings == 512


def test_pad_token_id_is_carried_through_conversion():
    config = models.from_hf_config(_HF | {"pad_token_id": 5})
    assert config.pad_token_id == 5
    assert models.to_hf_config(config)["pad_token_id"] == 5
    assert models.from_hf_config(_HF).pad_token_id is None


def test_config_hf_round_trip():
    for preset in models.PRESETS.values():
        back = models.from_hf_config(json.loads(json.dumps(models.to_hf_config(preset))))
        assert back == preset


# meta-llama/Llama-3.1-8B's config.json as published on the HF Hub.
_HF_LLAMA3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def test_llama3_1_8b_preset_is_the_published_config():
    preset = models.preset("Llama-3.1-8B")
    assert preset is models.LLAMA3_1_8B is models.preset("llama3.1-8b")
    assert models.from_hf_config(_HF_LLAMA3_1_8B) == preset
    written = models.to_hf_config(preset, torch_dtype="bfloat16")
    unwritten = {"pretraining_tp", "transformers_version"}  # HF bookkeeping only
    assert {k: written[k] for k in _HF_LLAMA3_1_8B.keys() - unwritten} == {
        k: v for k, v in _HF_LLAMA3_1_8B.items() if k not in unwritten
    }
    assert written["head_dim"] == 4096 // 32  # HF's default: hidden_size / heads
    assert round(models.param_count(preset) / 1e9, 2) == 8.03


def test_every_preset_has_one_spelling_for_command_lines():
    """`PRESET_NAMES`: one spelling per preset (the published name in lower case, as
    command lines and profile reports name it), which `preset` takes; `preset_name`
    gives it for any spelling `preset` takes."""
    assert list(models.PRESET_NAMES) == list(models.PRESETS)
    assert len(set(models.PRESET_NAMES.values())) == len(models.PRESETS)
    for key, name in models.PRESET_NAMES.items():
        assert models.preset(name) is models.PRESETS[key]
        assert models.preset_name(key) == models.preset_name(name.upper()) == name
    assert models.preset_name("Llama-3.2-1B") == models.preset_name("llama3_2_1b") == "llama3.2-1b"
    with pytest.raises(ValueError, match="unknown preset 'llama9'") as e:
        models.preset_name("llama9")
    # The error lists the spellings command lines use, not the table's keys.
    assert "llama3.2-1b, llama3.2-3b" in str(e.value) and "llama3_2_1b" not in str(e.value)


@pytest.mark.parametrize(
    ("hf", "error", "match"),
    [
        (_HF | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ValueError, "'yarn'"),
        (_HF | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError, "low_freq"),
        (_HF | {"rope_scaling": {"rope_type": "linear"}}, ValueError, "factor"),
        ({k: v for k, v in _HF.items() if k != "hidden_size"}, ValueError, "hidden_size"),
        (_HF | {"model_type": "mistral"}, ValueError, "mistral"),
        (_HF | {"attention_bias": True}, NotImplementedError, "attention_bias"),
        (_HF | {"hidden_act": "gelu"}, NotImplementedError, "gelu"),
        (_HF | {"num_key_value_heads": 3}, ValueError, "num_kv_heads=3"),
        (_HF | {"num_key_value_heads": 0}, ValueError, "num_kv_heads=0"),
        (_HF | {"hidden_size": None}, ValueError, "hidden_size"),
        (_HF | {"vocab_size": 128.5}, ValueError, "vocab_size=128.5 must be an integer"),
        (_HF | {"num_hidden_layers": "2"}, ValueError, "num_hidden_layers='2'"),
        (_HF | {"tie_word_embeddings": "false"}, ValueError, "tie_word_embeddings='false'"),
        (_HF | {"rms_norm_eps": "1e-5"}, ValueError, "rms_norm_eps='1e-5' must be a number"),
        (_HF | {"eos_token_id": "</s>"}, ValueError, "eos_token_id='</s>'"),
        (_HF | {"rope_scaling": {"factor": 4.0}}, ValueError, "names no 'rope_type'"),
        (_HF | {"hidden_size": 66}, ValueError, "hidden_size=66 is not a multiple of num_atte"),
        (_HF | {"rope_scaling": {"type": "linear", "factor": None}}, ValueError, "factor"),
        (_HF | {"rope_scaling": {"type": "llama3"} | _LLAMA3 | {"factor": "8"}}, ValueError, "'8'"),
        (
            {k: v for k, v in _HF.items() if k != "model_type"}
            | {"architectures": ["MistralForCausalLM"]},
            ValueError,
            "MistralForCausalLM",
        ),
    ],
)
def test_config_rejects_bad_input_naming_it(hf, error, match, tmp_path):
    with pytest.raises(error, match=match):
        models.from_hf_config(hf)
    path = tmp_path / "config.json"  # from a file: named once, at the start
    path.write_text(json.dumps(hf))
    with pytest.raises(error) as e:
        models.from_hf_config(tmp_path)
    assert str(e.value).startswith(str(path)) and str(e.value).count("config.json") == 1, e.value


def test_config_field_validation():
    with pytest.raises(ValueError, match="remat='some'"):
        SMALL.replace(remat="some")
    with pytest.raises(ValueError, match="dtype='int8'"):
        SMALL.replace(dtype="int8")
    with pytest.raises(ValueError, match="unknown preset"):
        models.preset("llama9")
    assert models.preset("Llama-3.2-1B") is models.LLAMA3_2_1B
    with pytest.raises(ValueError, match="needs a mesh"):
        models.AttentionConfig(kind="ring")
    with pytest.raises(ValueError, match="kind='flash'"):
        models.AttentionConfig(kind="flash")
    for field in ("mlp_tile", "num_layers"):  # a bool is no size, though Python's int
        with pytest.raises(ValueError, match=f"^{field}=True must be"):
            SMALL.replace(**{field: True})
    if jax.default_backend() != "gpu":  # cuDNN off a GPU: refused with the platform named
        x = jnp.zeros((1, 8, 2, 16), jnp.float32)
        with pytest.raises(ValueError, match="kind='cudnn' needs NVIDIA GPUs.*'cpu'"):
            attend(x, x, x, jnp.zeros((1, 8), jnp.int32), models.AttentionConfig(kind="cudnn"))


# --- FLOPs -------------------------------------------------------------------------


def test_param_counts_of_presets():
    assert round(models.param_count(models.LLAMA2_7B) / 1e9, 2) == 6.74
    assert round(models.param_count(models.LLAMA3_2_1B) / 1e9, 2) == 1.24
    assert round(models.param_count(models.LLAMA2_13B) / 1e9, 2) == 13.02
    assert round(models.param_count(models.LLAMA3_8B) / 1e9, 2) == 8.03
    assert round(models.param_count(models.LLAMA3_2_3B) / 1e9, 2) == 3.21
    assert round(models.param_count(models.LLAMA2_3B) / 1e9, 2) == 3.43  # OpenLLaMA-3B
    shapes = models.abstract_params(models.LLAMA3_2_1B)
    assert sum(x.size for x in jax.tree.leaves(shapes)) == models.param_count(models.LLAMA3_2_1B)


def test_training_flops_per_token():
    c = models.LLAMA2_7B
    n_matmul = (
        models.param_count(c)
        - c.vocab_size * c.hidden_size
        - (2 * c.num_layers + 1) * (c.hidden_size)
    )
    assert models.matmul_param_count(c) == n_matmul
    t = 4096
    attention = 12 * c.num_layers * c.num_heads * c.head_dim * t / 2
    assert models.training_flops_per_token(c, t) == 6 * n_matmul + attention
    full = models.flops_per_token(c, t, causal=False)
    assert full.attention == 2 * models.flops_per_token(c, t).attention
    # Tied head: still a matmul, so Llama-3.2-1B counts its embedding once as matmul.
    tied = models.LLAMA3_2_1B
    assert (
        models.matmul_param_count(tied)
        == models.param_count(tied) - (2 * tied.num_layers + 1) * tied.hidden_size
    )


# --- params and forward ------------------------------------------------------------


def test_init_params_layout(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    shapes = {"/".join(k.key for k in path): x.shape for path, x in leaves}
    c = SMALL
    assert shapes["layers/attn/q_proj/kernel"] == (2, 32, c.num_heads * c.head_dim)
    assert shapes["layers/attn/k_proj/kernel"] == (2, 32, c.num_kv_heads * c.head_dim)
    assert shapes["lm_head/kernel"] == (32, 96)
    assert all(x.dtype == jnp.float32 for _, x in leaves)
    q = params["layers"]["attn"]["q_proj"]["kernel"]
    assert not np.allclose(q[0], q[1]), "layers must be initialised independently"
    np.testing.assert_allclose(np.std(q), SMALL.initializer_range, rtol=0.1)
    tied = jax.eval_shape(
        partial(models.init_params, SMALL.replace(tie_word_embeddings=True)), jax.random.key(0)
    )
    assert "lm_head" not in tied


def test_bad_params_raise_listing_paths(params, ids):
    broken = jax.tree.map(lambda x: x, params)
    del broken["final_norm"]
    broken["extra"] = {"w": jnp.zeros(3)}
    broken["embed"]["embedding"] = jnp.zeros((5, 32))
    with pytest.raises(ValueError, match="final_norm/scale") as err:
        models.logits(SMALL, broken, ids)
    assert "extra/w" in str(err.value) and "embed/embedding" in str(err.value)


def test_token_rows_as_lists_run_and_other_ranks_are_refused(params, ids):
    """Ids, positions and segment ids as nested lists give the arrays' logits; ids of
    one row without its batch axis are refused naming their shape."""
    rows = np.asarray(ids[:1, :8]).tolist()
    as_lists = models.logits(SMALL, params, rows, [list(range(8))], segment_ids=[[1] * 8])
    np.testing.assert_array_equal(as_lists, models.logits(SMALL, params, ids[:1, :8]))
    with pytest.raises(ValueError, match=re.escape("input_ids.shape=(32,): expected [B, T]")):
        models.logits(SMALL, params, ids[0])


@pytest.mark.parametrize("bad", [SMALL.vocab_size, SMALL.vocab_size + 7, -1])
def test_eager_ids_outside_the_vocabulary_are_named(params, ids, bad):
    """An eager call names the first id outside [0, vocab_size); under jit the ids are
    not checked (the trainer checks its data when it loads it)."""
    wrong = np.asarray(ids).copy()
    wrong[1, 5] = bad
    message = f"input id {bad} (input_ids[1, 5]) is out of range for vocab_size=96"
    with pytest.raises(ValueError, match=re.escape(message)):
        models.logits(SMALL, params, wrong)
    with pytest.raises(ValueError, match=re.escape(message)):
        models.hidden_states(SMALL, params, jnp.asarray(wrong))
    assert _logits(SMALL, params, wrong).shape == (2, SEQ, SMALL.vocab_size)


@pytest.mark.slow
def test_scan_unscanned_and_remat_agree(params, ids, capsys):
    ref = _logits(SMALL, params, ids)
    labels = models.next_token_labels(ids)

    def loss(config, p):
        total, count = models.cross_entropy(models.logits(config, p, ids), labels)
        return total / count

    grad_ref = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(SMALL, params)
    changes = [{"scan_layers": False}] + [{"remat": r} for r in ("full", "save_attn", "save_dots")]
    for change in changes:
        config = SMALL.replace(**change)
        np.testing.assert_allclose(_logits(config, params, ids), ref, atol=1e-5, rtol=0)
        grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=0)(config, params)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grad, grad_ref
        )

    # What each policy recomputes: matmuls in the gradient's jaxpr (save_dots keeps the
    # projections' and MLP's outputs, so only the attention's own products run again).
    def dots(remat):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1), static_argnums=0)
        return str(jaxpr(SMALL.replace(remat=remat), params)).count("dot_general")

    counts = {r: dots(r) for r in ("none", "save_dots", "save_attn", "full")}
    assert counts["none"] <= counts["save_dots"] < counts["save_attn"] < counts["full"], counts

    # save_dots also keeps the MLP activation (`SAVE_DOTS_NAMES`), the down projection's
    # input, so the backward does not form it again; save_attn recomputes it. (Unrolled
    # layers: a scan's stacked residuals are not listed by name.)
    def saved(remat):
        config = SMALL.replace(remat=remat, scan_layers=False)
        print_saved_residuals(lambda p: loss(config, p), params)
        return capsys.readouterr().out

    assert "named 'mlp_activation'" in saved("save_dots")
    assert "named 'mlp_activation'" not in saved("save_attn")


def test_forward_is_deterministic(params, ids):
    np.testing.assert_array_equal(_logits(SMALL, params, ids), _logits(SMALL, params, ids))


def test_permuted_tokens_with_global_positions(params, ids):
    """Zigzag-ordered tokens that carry their true positions give permuted logits."""
    num_shards = 2
    chunks = np.arange(2 * num_shards)
    order = np.concatenate([chunks[[r, 2 * num_shards - 1 - r]] for r in range(num_shards)])
    perm = (order[:, None] * (SEQ // (2 * num_shards)) + np.arange(SEQ // 4)).reshape(-1)
    positions = jnp.broadcast_to(jnp.asarray(perm), ids.shape)
    out = _logits(SMALL, params, ids[:, perm], positions)
    np.testing.assert_allclose(out, _logits(SMALL, params, ids)[:, perm], atol=1e-5, rtol=0)


def test_bf16_compute_keeps_f32_params_and_logits(params, ids):
    config = SMALL.replace(dtype="bfloat16")
    out = _logits(config, params, ids)
    assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(out, _logits(SMALL, params, ids), atol=0.1, rtol=0)
    bf16_config = config.replace(param_dtype="bfloat16")
    bf16_params = jax.eval_shape(partial(models.init_params, bf16_config), jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))


def test_named_scopes_and_checkpoint_name(params, ids):
    jaxpr = str(jax.make_jaxpr(lambda p: models.logits(SMALL, p, ids))(params))
    assert "attention_out" in jaxpr
    hlo = (
        jax.jit(models.logits, static_argnums=0).lower(SMALL, params, ids).as_text(debug_info=True)
    )
    for scope in ("layer/attention", "rmsnorm", "mlp", "lm_head", "rope"):
        assert scope in hlo, scope
    unscanned = SMALL.replace(scan_layers=False)
    hlo = (
        jax.jit(models.logits, static_argnums=0)
        .lower(unscanned, params, ids)
        .as_text(debug_info=True)
    )
    assert "layer_1/attention" in hlo


def test_jflash_attention_backend_matches_xla(params, ids):
    attention = models.AttentionConfig(kind="jflash", implementation="xla")
    out = jax.jit(models.logits, static_argnums=0, static_argnames="attention")(
        SMALL, params, ids, attention=attention
    )
    np.testing.assert_allclose(out, _logits(SMALL, params, ids), atol=1e-5, rtol=0)


def test_ring_attention_backend_on_zigzag_tokens(params, ids):
    """Sequence-sharded zigzag tokens with their global positions give the same logits."""
    num_shards = min(4, len(jax.devices()))
    mesh = jax.make_mesh((num_shards,), ("seq",), devices=jax.devices()[:num_shards])
    attention = models.AttentionConfig(kind="ring", mesh=mesh, implementation="xla")
    zig_ids = jflash.zigzag(ids, num_shards, 1)
    positions = jnp.broadcast_to(jflash.positions(SEQ, num_shards, "zigzag"), ids.shape)
    seq_sharded = NamedSharding(mesh, PartitionSpec(None, "seq"))
    with jax.set_mesh(mesh):
        out = jax.jit(models.logits, static_argnums=0, static_argnames="attention")(
            SMALL,
            params,
            jax.device_put(zig_ids, seq_sharded),
            jax.device_put(positions, seq_sharded),
            attention=attention,
        )
    out = jflash.unzigzag(out, num_shards, 1)
    np.testing.assert_allclose(out, _logits(SMALL, params, ids), atol=1e-5, rtol=0)
    # Positions left out are the layout's (`attention.positions`), not arange(T).
    assert np.array_equal(attention.positions(SEQ), jflash.positions(SEQ, num_shards, "zigzag"))
    with jax.set_mesh(mesh):
        unsaid = models.logits(SMALL, params, jax.device_put(zig_ids, seq_sharded), None,
                               attention=attention)  # fmt: skip
    np.testing.assert_allclose(jflash.unzigzag(unsaid, num_shards, 1), out, atol=1e-5, rtol=0)


@pytest.mark.multi_device(4)
def test_what_the_model_does_not_run_split_on_explicit_axes_is_named(params, ids):
    """On Explicit mesh axes (`jax.make_mesh`'s default) sharded parameters, a sequence
    split outside the ring attention and a split LM head in the chunked loss each failed
    deep inside jax (a scan carry's type, an illegal dot sharding); they are named in one
    line, and a batch split with replicated parameters runs as on one device."""
    mesh = jax.make_mesh((2, 2), ("fsdp", "seq"), devices=jax.devices()[:4])
    expected = _logits(SMALL, params, ids)
    with jax.set_mesh(mesh):
        split = jax.tree.map(
            lambda x: jax.reshard(x, PartitionSpec(*([None] * (x.ndim - 1)), "fsdp")), params
        )
        with pytest.raises(
            ValueError, match=r"^parameter .* is split over the Explicit mesh axes \('fsdp',\)"
        ):
            models.logits(SMALL, split, ids)
        with pytest.raises(
            ValueError,
            match="input_ids are split along the sequence over .*'seq': attention kind 'xla'",
        ):
            models.hidden_states(SMALL, params, jax.reshard(ids, PartitionSpec(None, "seq")))
        batch = jax.reshard(ids, PartitionSpec("fsdp"))
        np.testing.assert_allclose(models.logits(SMALL, params, batch), expected, atol=1e-5, rtol=0)
        # The ring, given a whole sequence, changed the layer scan's carry type.
        ring = models.AttentionConfig(
            kind="ring", implementation="xla", mesh=mesh, layout="contiguous"
        )
        with pytest.raises(
            ValueError,
            match=r"^input_ids are whole along the sequence, where the 'ring' attention splits "
            r"it over the Explicit mesh axis 'seq': put them split so, jax.device_put\(",
        ):
            models.logits(SMALL, params, batch, attention=ring)
        hidden = models.hidden_states(SMALL, params, batch)
        head = jax.reshard(models.lm_head_weight(SMALL, params), PartitionSpec(None, "seq"))
        with pytest.raises(ValueError, match="^lm_head's vocabulary is split over Explicit"):
            models.chunked_cross_entropy(hidden, head, models.next_token_labels(batch))


@pytest.mark.multi_device(4)
def test_layout_shards_is_the_ring_axis_under_hybrid():
    """`to_layout`'s P: every sequence device for the ring, the ring axis alone under
    `hybrid` (its shards are split contiguously over the all-to-all axis), 1 for the
    kinds that take natural order."""
    mesh = jax.make_mesh((2, 2), ("seq", "a2a"), devices=jax.devices()[:4])
    ring = models.AttentionConfig(kind="ring", mesh=mesh, seq_axis="seq")
    hybrid = models.AttentionConfig(
        kind="ring", mesh=mesh, seq_axis=("seq", "a2a"), strategy="hybrid"
    )
    assert (ring.seq_shards, ring.layout_shards) == (2, 2)
    assert (hybrid.seq_shards, hybrid.layout_shards) == (4, 2)
    assert models.AttentionConfig(kind="jflash").layout_shards == 1
    np.testing.assert_array_equal(hybrid.positions(16), jflash.positions(16, 2, "zigzag"))
    np.testing.assert_array_equal(models.AttentionConfig().positions(16), np.arange(16))


def test_positions_that_repeat_in_one_document_are_refused_for_the_dense_mask(params, ids):
    """The `xla` attention masks causally by position: positions restarting at each
    packed document without segment ids (or with an id used by two documents) would let
    a token see later ones. Concrete positions are checked, naming the repeat; with one
    id per document it runs, as the kernels' attention does."""
    pos = np.tile(np.arange(SEQ // 4), 4)[None].repeat(ids.shape[0], 0)
    for segs, inside in (
        (None, "the row"),
        (np.repeat([[1, 2, 1, 3]], SEQ // 4, 1), "segment id 1"),
    ):
        segs = None if segs is None else segs.repeat(ids.shape[0], 0)
        with pytest.raises(ValueError, match=f"position 0 repeats inside {inside} "):
            models.logits(SMALL, params, ids, pos, segment_ids=segs)
    docs = np.repeat([[1, 2, 3, 4]], SEQ // 4, 1).repeat(ids.shape[0], 0)
    dense = models.logits(SMALL, params, ids, pos, segment_ids=docs)
    kernel = models.logits(SMALL, params, ids, pos, segment_ids=docs, attention="jflash")
    np.testing.assert_allclose(dense, kernel, atol=1e-5, rtol=0)


def test_tokens_out_of_order_are_refused_for_the_kernels_that_mask_by_order(params, ids):
    """The `jflash` kernels mask causally by token order while RoPE takes the positions:
    zigzag-ordered or reversed tokens (which `xla` masks right by position) are refused
    naming the first token out of order, inside its document; rising positions with
    gaps, or restarting at each document with one id per document, run."""
    b = ids.shape[0]
    perm = np.asarray(jflash.positions(SEQ, 2, "zigzag"))
    zigzag = np.tile(perm, (b, 1))
    dense = models.logits(SMALL, params, ids[:, perm], zigzag)
    np.testing.assert_allclose(dense, models.logits(SMALL, params, ids)[:, perm], atol=1e-5)
    with pytest.raises(ValueError) as e:
        models.logits(SMALL, params, ids[:, perm], zigzag, attention="jflash")
    first = int(np.flatnonzero(np.diff(perm) <= 0)[0])
    assert str(e.value).startswith(
        f"positions[0, {first + 1}]={perm[first + 1]} follows positions[0, {first}]="
        f"{perm[first]} inside the row: attention kind 'jflash' masks causally by token order"
    ), e.value
    halves = np.repeat([[1, 2]], SEQ // 2, 1).repeat(b, 0)  # two documents, each reversed
    backwards = np.tile(np.r_[np.arange(SEQ // 2)[::-1], np.arange(SEQ // 2)], (b, 1))
    with pytest.raises(ValueError, match="inside segment id 1: attention kind 'jflash'"):
        models.logits(SMALL, params, ids, backwards, segment_ids=halves, attention="jflash")
    gaps = np.tile(np.arange(SEQ) * 3, (b, 1))
    kernel = models.logits(SMALL, params, ids, gaps, attention="jflash")
    np.testing.assert_allclose(models.logits(SMALL, params, ids, gaps), kernel, atol=1e-5)


# --- loss --------------------------------------------------------------------------


def test_cross_entropy_ignores_minus_100():
    logits = jax.random.normal(jax.random.key(2), (2, 5, 7)) * 3
    labels = jnp.array([[1, 2, -100, 3, 0], [6, -100, -100, 5, 4]])
    mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    total, count = models.cross_entropy(logits, labels, mask)
    logp = jax.nn.log_softmax(logits, -1)
    want = [
        -logp[b, t, labels[b, t]]
        for b in range(2)
        for t in range(5)
        if mask[b, t] and labels[b, t] >= 0
    ]
    assert int(count) == len(want) == 6
    np.testing.assert_allclose(total, sum(want), rtol=1e-6)
    np.testing.assert_array_equal(models.next_token_labels(jnp.array([[5, 6, 7]])), [[6, 7, -100]])


@pytest.mark.slow
def test_a_sequence_shorter_than_the_default_chunk_is_one_chunk(params, ids):
    labels = models.next_token_labels(ids)
    hidden = models.hidden_states(SMALL, params, ids)
    assert ids.shape[1] < 1024
    loss, n = models.chunked_cross_entropy(hidden, models.lm_head_weight(SMALL, params), labels)
    full, count = models.cross_entropy(models.logits(SMALL, params, ids), labels)
    np.testing.assert_allclose(loss / n, full / count, rtol=1e-5)


def test_save_native_refuses_another_models_tree_keeping_the_checkpoint(tmp_path, params):
    models.save_native(jax.device_get(params), SMALL, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = SMALL.replace(num_layers=SMALL.num_layers + 1)
    with pytest.raises(ValueError):
        models.save_native(jax.device_get(params), other, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_native_directory_records_the_parameters_dtype(tmp_path, params):
    """bfloat16 parameters of a float32 config are saved as bfloat16 and say so; loaded
    as they were, or cast on request; parameters of two dtypes are refused before
    anything is written; a cast to float16 names a weight it would make inf."""
    half = jax.tree.map(lambda a: np.asarray(a).astype(jnp.bfloat16), jax.device_get(params))
    assert SMALL.param_dtype == "float32"
    models.save_native(half, SMALL, tmp_path / "bf16")
    saved = json.loads((tmp_path / "bf16" / "jflash_config.json").read_text())
    assert saved["param_dtype"] == "bfloat16"
    config, loaded = models.load_native(tmp_path / "bf16")
    assert config.param_dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(loaded)} == {np.dtype(jnp.bfloat16)}
    config, wide = models.load_native(tmp_path / "bf16", param_dtype="float32")
    assert config.param_dtype == "float32"
    jax.tree.map(lambda w, h: np.testing.assert_array_equal(w, h.astype(np.float32)), wide, half)

    mixed = dict(half, final_norm=jax.device_get(params)["final_norm"])
    with pytest.raises(ValueError, match=r"hold bfloat16 and float32; cast them to one"):
        models.save_native(mixed, SMALL, tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()

    big = jax.tree.map(lambda a: np.asarray(a) * 0 + 7e4, jax.device_get(params))
    models.save_native(big, SMALL, tmp_path / "big")
    with pytest.raises(ValueError, match=r"magnitude 70000.*param_dtype='float16' would"):
        models.load_native(tmp_path / "big", param_dtype="float16")


def test_chunked_cross_entropy_matches_full(params, ids):
    labels = models.next_token_labels(ids)
    head = models.lm_head_weight(SMALL, params)

    def full(p):
        return models.cross_entropy(models.logits(SMALL, p, ids), labels)[0]

    def chunked(p):
        hidden = models.hidden_states(SMALL, p, ids)
        return models.chunked_cross_entropy(
            hidden, models.lm_head_weight(SMALL, p), labels, chunk_size=8
        )[0]

    np.testing.assert_allclose(jax.jit(chunked)(params), jax.jit(full)(params), rtol=1e-6)
    g_full, g_chunked = jax.jit(jax.grad(full))(params), jax.jit(jax.grad(chunked))(params)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g_chunked, g_full
    )
    assert head.shape == (SMALL.hidden_size, SMALL.vocab_size)
    with pytest.raises(ValueError, match="chunk_size=5"):
        models.chunked_cross_entropy(
            models.hidden_states(SMALL, params, ids), head, labels, chunk_size=5
        )


def _ce_inputs(dtype, t=64, d=16, v=40):
    keys = jax.random.split(jax.random.key(3), 3)
    hidden = jax.random.normal(keys[0], (2, t, d), jnp.float32).astype(dtype)
    head = jax.random.normal(keys[1], (d, v), jnp.float32) * 0.3
    labels = jax.random.randint(keys[2], (2, t), 0, v).at[:, ::7].set(models.IGNORE_INDEX)
    return hidden, head, labels


def _ce_reference(hidden, head, labels):
    logits = jnp.einsum("btd,dv->btv", hidden.astype(jnp.float32), head)
    return models.cross_entropy(logits, labels)[0]


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_chunked_cross_entropy_gradients(shards):
    """The fused VJP (gradients formed in the forward scan) against autodiff of the
    full-logits loss: f32 tight; bf16 within bf16 rounding of the softmax gradient."""
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        hidden, head, labels = _ce_inputs(dtype)

        def chunked(h, w, labels=labels):
            return models.chunked_cross_entropy(h, w, labels, chunk_size=16, shards=shards)

        loss, count = jax.jit(chunked)(hidden, head)
        dh, dw = jax.jit(jax.grad(lambda h, w: chunked(h, w)[0], (0, 1)))(hidden, head)
        want = _ce_reference(hidden, head, labels)
        want_dh, want_dw = jax.grad(_ce_reference, (0, 1))(hidden.astype(jnp.float32), head, labels)
        assert int(count) == int(jnp.sum(labels != models.IGNORE_INDEX))
        np.testing.assert_allclose(loss, want, rtol=1e-5 if dtype == jnp.float32 else 1e-3)
        assert dh.dtype == dtype and dw.dtype == head.dtype
        scale = float(jnp.max(jnp.abs(want_dh)))
        np.testing.assert_allclose(np.asarray(dh, np.float32), want_dh, atol=tol * scale)
        scale = float(jnp.max(jnp.abs(want_dw)))
        np.testing.assert_allclose(dw, want_dw, atol=tol * scale)
        # The same head stored [V, D] (a tied embedding table): the gradient comes back
        # [V, D], with the same numbers.
        dh_t, dw_t = jax.jit(
            jax.grad(
                lambda h, w, labels=labels: models.chunked_cross_entropy(
                    h, w, labels, chunk_size=16, shards=shards, vocab_major=True
                )[0],
                (0, 1),
            )
        )(hidden, head.T)
        assert dw_t.shape == head.T.shape
        scale = float(jnp.max(jnp.abs(want_dh)))
        np.testing.assert_allclose(np.asarray(dh_t, np.float32), want_dh, atol=tol * scale)
        scale = float(jnp.max(jnp.abs(want_dw)))
        np.testing.assert_allclose(dw_t.T, want_dw, atol=tol * scale)
    with pytest.raises(ValueError, match="chunk_size=16 must be a positive multiple of shards=3"):
        models.chunked_cross_entropy(hidden, head, labels, chunk_size=16, shards=3)
    with pytest.raises(ValueError, match=r"lm_head.shape=\(\d+, \d+\) is not \[V, D\]"):
        models.chunked_cross_entropy(hidden, head, labels, chunk_size=16, vocab_major=True)


def _all_reduce_shapes(hlo: str, in_loops: bool) -> list[str]:
    """Dimensions of the array all-reduces in compiled HLO text, only those inside
    while-loop bodies when `in_loops`."""
    import re

    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    shapes, inside = [], False
    for line in hlo.splitlines():
        if line and not line.startswith(" "):  # a computation's header
            inside = line.split()[0].lstrip("%") in bodies
        if " all-reduce(" in line and (inside or not in_loops):
            shapes += re.findall(r"\w+\[([\d,]+)\]", line.split(" all-reduce(")[0])
    return shapes


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_chunked_cross_entropy_splits_over_seq():
    """With the sequence sharded over 2 devices and `shards=2`, each device computes the
    logits of its own tokens only (no all-gather of the hidden states, half-size dots),
    and the loss and gradients equal the unsharded ones."""
    import re

    hidden, head, labels = _ce_inputs(jnp.bfloat16, t=128, d=24, v=40)
    mesh = jax.make_mesh(
        (2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )  # the trainer's mesh axes are Auto (train.mesh)
    on_seq = NamedSharding(mesh, PartitionSpec(None, "seq"))
    h_s, lab_s = jax.device_put(hidden, on_seq), jax.device_put(labels, on_seq)

    def loss(h, w, lab, shards, replicated_head=False):
        return models.chunked_cross_entropy(
            h, w, lab, chunk_size=32, shards=shards, replicated_head=replicated_head
        )[0]

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=(3, 4))
    want, (want_dh, want_dw) = grad(hidden, head, labels, 1)
    for replicated_head in (False, True):
        text = grad.lower(h_s, head, lab_s, 2, replicated_head).compile().as_text()
        assert "all-gather(" not in text
        dots = set(re.findall(r"= \w+\[([\d,]+)\]\{[^}]*\} dot\(", text))
        # logits [B * chunk / 2, V] per device, not [B * chunk, V]
        assert "32,40" in dots and "64,40" not in dots, dots
        # The head's gradient [D, V] is reduced over the devices inside the chunk loop
        # unless each device keeps its own sum (replicated_head): then once, after it.
        in_loop = _all_reduce_shapes(text, in_loops=True)
        assert ("24,40" in in_loop) != replicated_head, in_loop
        got, (dh, dw) = grad(h_s, head, lab_s, 2, replicated_head)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(want_dh, np.float32))
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)

    # The same under an Explicit-axes mesh; there a `shards` that does not match the
    # token axis's sharding is refused by name (Auto meshes would gather instead).
    explicit = jax.make_mesh(
        (2,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2]
    )
    with jax.set_mesh(explicit):
        on_seq = NamedSharding(explicit, PartitionSpec(None, "seq"))
        h_e, lab_e = jax.device_put(hidden, on_seq), jax.device_put(labels, on_seq)
        grad_e = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=(3, 4))
        results = [grad_e(h_e, head, lab_e, 2, r) for r in (False, True)]
        with pytest.raises(ValueError, match=r"sharded 2 ways over \('seq',\).*shards=1"):
            loss(h_e, head, lab_e, 1)
        head_on_seq = jax.device_put(head, NamedSharding(explicit, PartitionSpec(None, "seq")))
        with pytest.raises(ValueError, match=r"replicated_head=True, but lm_head is sharded"):
            loss(h_e, head_on_seq, lab_e, 2, True)
    for got, (dh, dw) in results:
        np.testing.assert_allclose(got, want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dh, np.float32), np.asarray(want_dh, np.float32))
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)


# --- conversion --------------------------------------------------------------------


def test_safetensors_bf16_round_trip(tmp_path):
    tensors = {
        "a": np.random.default_rng(0).standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "b": np.arange(6, dtype=np.int64).reshape(2, 3),
        "c": np.float32(1.5) * np.ones(5, np.float32),
    }
    save_file(tensors, tmp_path / "x.safetensors", {"format": "pt"})
    read = SafetensorsFile(tmp_path / "x.safetensors")
    assert read.metadata == {"format": "pt"} and set(read) == set(tensors)
    for name, array in tensors.items():
        assert read[name].dtype == array.dtype
        np.testing.assert_array_equal(read[name], array)


def test_export_load_round_trip_and_strictness(tmp_path, params):
    models.export_hf(params, SMALL, tmp_path / "hf")
    config, loaded = models.load_hf(tmp_path / "hf")
    assert config == SMALL
    jax.tree.map(np.testing.assert_array_equal, loaded, params)

    from models.safetensors_io import SafetensorsFile as Read

    state = dict(Read(tmp_path / "hf" / "model.safetensors"))
    state = {k: np.array(v) for k, v in state.items()}

    def load_with(tensors):
        save_file(tensors, tmp_path / "hf" / "model.safetensors", {"format": "pt"})
        return models.load_hf(tmp_path / "hf")

    bad = dict(state)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.0.self_attn.q_proj.bias"] = np.zeros(SMALL.num_heads * SMALL.head_dim)
    bad["model.norm.weight"] = np.ones(7, np.float32)
    with pytest.raises(ValueError) as err:
        load_with(bad)
    message = str(err.value)
    for key in (
        "model.layers.1.mlp.up_proj.weight",
        "q_proj.bias",
        "model.norm.weight: expected (32,), got (7,)",
    ):
        assert key in message, message

    tolerated = dict(state) | {
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)
    }
    load_with(tolerated)


def test_load_hf_into_bf16_params(tmp_path, params):
    models.export_hf(params, SMALL, tmp_path)
    config, loaded = models.load_hf(tmp_path, param_dtype="bfloat16")
    assert config == SMALL.replace(param_dtype="bfloat16")
    assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree.leaves(loaded))
    assert _logits(config, loaded, jnp.zeros((1, 8), jnp.int32)).dtype == jnp.float32


def test_load_hf_into_fp16_refuses_a_weight_beyond_its_range(tmp_path, params):
    """A weight past float16's 65504 would load as inf: refused, naming the tensor and
    its largest magnitude; float32 and bfloat16 load it."""
    host = jax.device_get(params)
    scale = np.array(host["final_norm"]["scale"])
    scale[3] = -7e4
    models.export_hf({**host, "final_norm": {"scale": scale}}, SMALL, tmp_path)
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight holds a weight of magnitude 70000, "
    ):
        models.load_hf(tmp_path, param_dtype="float16")
    for dtype in ("float32", "bfloat16"):
        _, loaded = models.load_hf(tmp_path, param_dtype=dtype)
        assert np.isfinite(np.asarray(loaded["final_norm"]["scale"], np.float32)).all()
    models.export_hf(host, SMALL, tmp_path / "fits")
    _, loaded = models.load_hf(tmp_path / "fits", param_dtype="float16")
    assert all(x.dtype == np.float16 for x in jax.tree.leaves(loaded))


def test_checkpoint_errors_name_their_file_and_tensor(tmp_path, params):
    """An int8 tensor (a quantized checkpoint), a native directory missing a tensor and
    a config.json missing a key are refused naming the file or directory and the
    tensor or key, not numpy's or the config's words alone."""
    host = jax.device_get(params)
    models.export_hf(host, SMALL, tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    state = {k: np.array(v) for k, v in SafetensorsFile(weights).items()}
    state["model.norm.weight"] = state["model.norm.weight"].astype(np.int8)
    save_file(state, weights, {"format": "pt"})
    with pytest.raises(ValueError) as refused:
        models.load_hf(tmp_path / "hf")
    assert str(refused.value).startswith(f"checkpoint {tmp_path / 'hf'}: model.norm.weight is ")
    assert "stored as int8, not floats (a quantized checkpoint?)" in str(refused.value)
    models.save_native(host, SMALL, tmp_path / "native")
    tensors = dict(SafetensorsFile(tmp_path / "native" / "params.safetensors").items())
    del tensors["final_norm/scale"]
    save_file(
        {k: np.array(v) for k, v in tensors.items()}, tmp_path / "native" / "params.safetensors"
    )
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'native'}: parameters do not match .*"):
        models.load_native(tmp_path / "native")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        models.from_hf_config(tmp_path / "hf")
    assert str(refused.value) == (
        f"{tmp_path / 'hf' / 'config.json'} is missing required keys ['hidden_size']"
    )


def test_export_to_fp16_refuses_a_weight_beyond_its_range_writing_nothing(tmp_path, params):
    """A weight past float16's 65504 would be written as inf: the export is refused,
    naming the tensor, before its directory is made; bfloat16 takes it."""
    host = jax.device_get(params)
    scale = np.array(host["final_norm"]["scale"])
    scale[3] = 1e5
    big = {**host, "final_norm": {"scale": scale}}
    with pytest.raises(ValueError, match=r"^model\.norm\.weight holds a weight of magnitude "):
        models.export_hf(big, SMALL, tmp_path / "fp16", dtype="float16")
    assert not (tmp_path / "fp16").exists()
    models.export_hf(big, SMALL, tmp_path / "bf16", dtype="bfloat16")
    _, loaded = models.load_hf(tmp_path / "bf16")
    assert np.isfinite(np.asarray(loaded["final_norm"]["scale"])).all()


def test_native_directory_read_as_hf_says_how_to_convert_it(tmp_path, params):
    models.save_native(jax.device_get(params), SMALL, tmp_path / "native")
    with pytest.raises(ValueError, match="is a native directory .* --to-hf "):
        models.load_hf(tmp_path / "native")


def test_tied_checkpoint_with_duplicate_head_loads(tmp_path):
    config = SMALL.replace(tie_word_embeddings=True)
    params = models.init_params(config, jax.random.key(3))
    models.export_hf(params, config, tmp_path)
    state = {k: np.array(v) for k, v in SafetensorsFile(tmp_path / "model.safetensors").items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    save_file(state, tmp_path / "model.safetensors", {"format": "pt"})
    _, loaded = models.load_hf(tmp_path)
    assert "lm_head" not in loaded
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_file(state, tmp_path / "model.safetensors", {"format": "pt"})
    # transformers loads such a head untied: refused, naming the flag to change.
    with pytest.raises(ValueError, match="lm_head.weight other than .*tie_word_embeddings: true"):
        models.load_hf(tmp_path)


def test_checkpoints_spelled_as_transformers_also_loads_them(tmp_path, params):
    """transformers loads into `LlamaForCausalLM` a tied model whose one matrix is
    stored as lm_head.weight only, and a `LlamaModel` checkpoint (no `model.` prefix;
    tied, so no head is missing): both load here as the same parameters. A checkpoint
    of another model's names is refused listing a few of them and the count."""
    tied = SMALL.replace(tie_word_embeddings=True)
    expected = jax.device_get(models.init_params(tied, jax.random.key(3)))
    models.export_hf(expected, tied, tmp_path / "tied")
    file = tmp_path / "tied" / "model.safetensors"
    state = {k: np.array(v) for k, v in SafetensorsFile(file).items()}
    for name, spelled in (
        ("head_only", {**state, "lm_head.weight": state["model.embed_tokens.weight"]}),
        ("base_model", {k.removeprefix("model."): v for k, v in state.items()}),
    ):
        if name == "head_only":
            del spelled["model.embed_tokens.weight"]
        shutil.copytree(tmp_path / "tied", tmp_path / name)
        save_file(spelled, tmp_path / name / "model.safetensors", {"format": "pt"})
        _, loaded = models.load_hf(tmp_path / name)
        jax.tree.map(np.testing.assert_array_equal, loaded, expected)
    other = {f"encoder.block.{i}.weight": np.zeros(2, np.float32) for i in range(20)}
    save_file(other, file, {"format": "pt"})
    with pytest.raises(
        ValueError, match=r"unexpected=\[.encoder.block.0.weight., .* and 14 more, misshaped=\[\]$"
    ):
        models.load_hf(tmp_path / "tied")


def test_malformed_checkpoints_raise_one_value_error_naming_the_fault(tmp_path, params):
    """An index that sends a tensor to a shard without it or lists no file names, and a
    file for a directory: each a ValueError naming the fault, not a KeyError or
    TypeError from inside the loader."""
    models.export_hf(params, SMALL, tmp_path / "tied")

    models.export_hf(params, SMALL, tmp_path / "sharded", max_shard_bytes=20_000)
    index_path = tmp_path / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    moved = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.norm.weight"] = next(s for s in shards if s != moved)
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists tensors that its shards do not hold.*norm"):
        models.load_hf(tmp_path / "sharded")
    index["weight_map"]["model.norm.weight"] = 1
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="not a valid safetensors index"):
        models.load_hf(tmp_path / "sharded")

    with pytest.raises(ValueError, match="config.json is a file"):
        models.load_hf(tmp_path / "tied" / "config.json")


def test_bf16_export_and_sharding(tmp_path, params):
    models.export_hf(params, SMALL, tmp_path, dtype="bfloat16", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, loaded = models.load_hf(tmp_path)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(
            a, np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32)
        ),
        loaded,
        params,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "dtype='int8' not in"),  # was written: every weight truncated to 0
        ({"dtype": "bf16"}, "dtype='bf16' not in"),
        ({"max_shard_bytes": 0}, "max_shard_bytes=0 must be at least 1"),
    ],
)
def test_export_refuses_bad_dtype_and_shard_size_writing_nothing(tmp_path, params, kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.export_hf(params, SMALL, tmp_path / "hf", **kwargs)
    assert not (tmp_path / "hf").exists()


def test_export_over_an_earlier_one_leaves_only_its_own_weights(tmp_path, params):
    """A sharded export over a single-file one, and the reverse: the earlier weight files
    go (once the new ones are written), so every loader reads the new weights; other
    files (a tokenizer) stay."""
    other = jax.tree.map(lambda a: a + 1.0, params)
    models.export_hf(other, SMALL, tmp_path, max_shard_bytes=20_000)
    (tmp_path / "tokenizer.json").write_text("{}")
    models.export_hf(params, SMALL, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path)[1], params)
    models.export_hf(other, SMALL, tmp_path, max_shard_bytes=20_000)
    assert not (tmp_path / "model.safetensors").exists()
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path)[1], other)


def test_an_export_removes_what_a_killed_export_left_staged(tmp_path, params):
    """A sharded export killed outright (SIGKILL) part way leaves its staged files: the
    next export into the directory removes the staged files of the names an export
    writes, also ones it does not write itself, and keeps every other file."""
    stale = [
        "model-00001-of-00003.safetensors.partial",
        "model-00002-of-00003.safetensors.partial.tmp",
        "model.safetensors.index.json.partial",
        "config.json.partial",
    ]
    kept = ["notes.partial", "tokenizer.json.partial", "model.safetensors.partial.bak"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"left behind")
    models.export_hf(params, SMALL, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["config.json", "model.safetensors", *kept]
    )
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path)[1], params)


def test_a_single_file_beside_an_index_is_the_checkpoint_as_for_transformers(tmp_path, params):
    """A directory with model.safetensors and also an index with its shards (not one
    export_hf writes): transformers' from_pretrained reads the single file, and so does
    load_hf, not the shards' other weights."""
    models.export_hf(
        jax.tree.map(lambda a: a + 1.0, params), SMALL, tmp_path, max_shard_bytes=20_000
    )
    save_file(models.convert.to_hf_state_dict(params, SMALL), tmp_path / "model.safetensors")
    assert (tmp_path / "model.safetensors.index.json").exists()
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path)[1], params)


def test_an_export_that_fails_part_way_leaves_the_earlier_checkpoint(tmp_path, params, monkeypatch):
    """The disk fills up as a sharded export over an earlier one starts its second
    shard: the earlier checkpoint loads as it was (its first shard not replaced, its
    second not truncated) and no partial file stays."""
    models.export_hf(params, SMALL, tmp_path, max_shard_bytes=20_000)
    before = sorted(p.name for p in tmp_path.iterdir())
    opened = []
    real_open = open

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            if len(opened) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

    def full_disk_open(name, mode="r", *args, **kwargs):
        file = real_open(name, mode, *args, **kwargs)
        if "w" not in mode:
            return file
        opened.append(name)
        return FullDisk(file)

    monkeypatch.setattr(models.files, "open", full_disk_open, raising=False)
    with pytest.raises(OSError, match="No space left"):
        models.export_hf(
            jax.tree.map(lambda a: a + 1.0, params), SMALL, tmp_path, max_shard_bytes=20_000
        )
    monkeypatch.undo()
    assert len(opened) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path)[1], params)


def test_cli_errors_are_one_line(tmp_path, capsys):
    """Bad inputs of `python -m models.convert`: one line naming the value, exit 2, no
    traceback; nothing is written."""
    (tmp_path / "afile").write_text("")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 299}}}))
    for name, tokenizer in [
        ("tok_no_id", {"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": "<s>"}]}),
        ("tok_str_id", {"model": {"vocab": {"a": "0", "b": 1}}}),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    small = dataclasses.asdict(SMALL)
    rope_5 = small | {"rope": 5}
    for name, native_config in [
        ("native", {"vocab_size": 8}),
        ("rope", rope_5),
        ("eps", small | {"rms_norm_eps": "1e-6"}),
        ("tie", small | {"tie_word_embeddings": "false"}),
        ("theta", small | {"rope": small["rope"] | {"theta": "10000"}}),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "jflash_config.json").write_text(json.dumps(native_config))
    o = str(tmp_path / "o")
    cases = [
        (["--to-hf", str(tmp_path / "hf"), "--out", o], "not a native directory.*--from-hf"),
        (["--to-hf", str(tmp_path / "native"), "--out", o], "'num_layers', .* are missing"),
        (["--to-hf", str(tmp_path / "rope"), "--out", o], "rope=5 must be an object"),
        (["--to-hf", str(tmp_path / "eps"), "--out", o], "rms_norm_eps='1e-6' must be a number"),
        (["--to-hf", str(tmp_path / "tie"), "--out", o], "word_embeddings='false' must be true or"),
        (["--to-hf", str(tmp_path / "theta"), "--out", o], "theta='10000' must be a number"),
        (["--init", "tiny", "--out", o, "--max-shard-gb", "1e300"], "--max-shard-gb=1e\\+300"),
        (
            ["--init", "tiny", "--out", o, "--seed", str(2**70)],
            r"--seed=\d+ must be in \[0, 2\*\*63\)",
        ),
        (["--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist"),
        (["--init", "tiny", "--out", str(tmp_path / "afile")], "is a file, not a directory"),
        (["--init", "tiny", "--out", str(tmp_path / "afile" / "o")], "afile is a file"),
        # tried before the conversion's work: root passes os.access on /proc
        (["--init", "tiny", "--out", "/proc/o"], "'/proc/o' cannot be created in /proc"),
        (["--to-hf", "x", "--out", o, "--max-shard-gb", "0"], "must be a finite number > 0"),
        (["--init", "tiny", "--out", o, "--max-shard-gb", "inf"], r"--max-shard-gb=inf must be"),
        (["--init", "tiny", "--out", o, "--max-shard-gb", "nan"], r"--max-shard-gb=nan must be"),
        (
            ["--init", "tiny", "--tokenizer", str(tok), "--vocab-size", "100", "--out", "o"],
            "--vocab-size=100 is smaller than .*300 ids",
        ),
        (
            ["--init", "tiny", "--tokenizer", str(tmp_path / "tok_no_id"), "--out", o],
            "not a tokenizer.json vocabulary: .*'<s>': None",
        ),
        (
            ["--init", "tiny", "--tokenizer", str(tmp_path / "tok_str_id"), "--out", o],
            "not a tokenizer.json vocabulary: .*'a': '0'",
        ),
        # flags the conversion does not read: refused, not dropped
        (["--to-hf", "x", "--seed", "1", "--out", "o"], "--seed applies to --init only"),
        (["--init", "tiny", "--vocab-size", "0", "--out", "o"], "--vocab-size=0 must be at least"),
    ]
    for argv, match in cases:
        with pytest.raises(SystemExit) as exit_info:
            convert_main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and "Traceback" not in err, err
        assert err.startswith("error: ") and err.count("\n") == 1, err  # not the usage
    assert not (tmp_path / "o").exists()


def test_cli_from_hf_keeps_a_bfloat16_checkpoint_bfloat16(tmp_path):
    """`--from-hf --dtype bfloat16`: a bfloat16 HF checkpoint converts to bfloat16
    native parameters (half the float32 default's file and memory), values exact,
    and back to the same HF tensors."""
    hf, native, back = tmp_path / "hf", tmp_path / "native", tmp_path / "back"
    convert_main(["--init", "tiny", "--dtype", "bfloat16", "--out", str(hf)])
    convert_main(["--from-hf", str(hf), "--dtype", "bfloat16", "--out", str(native)])
    held = SafetensorsFile(native / "params.safetensors")
    assert {np.dtype(held[k].dtype).name for k in held} == {"bfloat16"}
    convert_main(["--to-hf", str(native), "--dtype", "bfloat16", "--out", str(back)])
    original = SafetensorsFile(hf / "model.safetensors")
    again = SafetensorsFile(back / "model.safetensors")
    assert sorted(original) == sorted(again)
    for key in original:
        assert np.array_equal(original[key].view(np.uint16), again[key].view(np.uint16)), key


def test_cli_refuses_to_replace_what_out_holds(tmp_path, capsys):
    """`python -m models.convert` into a directory that holds a model (an HF one, a
    native one) or another directory's tokenizer files is refused in one line naming
    them, and nothing there changes; `--overwrite` replaces them. Other files (a
    README) and an empty directory are no obstacle."""
    hf, native, tok = tmp_path / "hf", tmp_path / "native", tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    convert_main(["--init", "tiny", "--out", str(hf)])
    convert_main(["--from-hf", str(hf), "--out", str(native)])
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        (["--init", "tiny", "--seed", "1", "--out", str(hf)], "config.json, model.safetensors"),
        (["--to-hf", str(native), "--out", str(hf)], "config.json, model.safetensors"),
        (["--from-hf", str(hf), "--out", str(native)], "jflash_config.json, params.safetensors"),
        (["--init", "tiny", "--tokenizer", str(tok), "--out", str(tok)], None),  # its own: fine
    ]
    for argv, held in cases[:3]:
        with pytest.raises(SystemExit) as exit_info:
            convert_main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # argparse's usage, then the one error line
        assert f"already holds {held}" in last and "--overwrite" in last, err
        assert "Traceback" not in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # Another directory's tokenizer over the one in --out.
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"x": 0, "y": 1}}}))
    (other / "README.md").write_text("notes")
    with pytest.raises(SystemExit):
        convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(other)])
    assert "already holds tokenizer.json" in capsys.readouterr().err
    assert json.loads((other / "tokenizer.json").read_text())["model"]["vocab"] == {"x": 0, "y": 1}
    # A named chat template (transformers' additional_chat_templates/) goes along, and
    # one there from another directory is replaced only with --overwrite.
    (tok / "additional_chat_templates").mkdir()
    (tok / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (other / "tokenizer.json").unlink()
    (other / "additional_chat_templates").mkdir()
    (other / "additional_chat_templates" / "tool_use.jinja").write_text("other's")
    with pytest.raises(SystemExit):
        convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(other)])
    assert "already holds additional_chat_templates/tool_use.jinja," in capsys.readouterr().err
    convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(tmp_path / "named")])
    assert (tmp_path / "named" / "additional_chat_templates" / "tool_use.jinja").read_text() == (
        "{{ tools }}"
    )
    # The tokenizer's own directory, a directory of other files, and --overwrite: written.
    convert_main(cases[3][0])
    (tmp_path / "empty").mkdir()
    convert_main(["--init", "tiny", "--out", str(tmp_path / "empty")])
    convert_main(["--init", "tiny", "--seed", "1", "--out", str(hf), "--overwrite"])
    assert (hf / "model.safetensors").read_bytes() != before[hf / "model.safetensors"]
    convert_main(["--from-hf", str(hf), "--out", str(native), "--overwrite"])
    assert (native / "params.safetensors").read_bytes() != before[native / "params.safetensors"]


def test_overwrite_leaves_no_other_models_tokenizer_files(tmp_path, capsys):
    """Over a directory holding another model's tokenizer with chat templates, a
    conversion refuses naming the templates too, and with `--overwrite` leaves the new
    tokenizer's files only: no template the new tokenizer lacks stays beside it."""
    old, new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    for folder, vocab in ((old, {"a": 0, "b": 1}), (new, {"x": 0, "y": 1, "z": 2})):
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    (old / "chat_template.jinja").write_text("{{ messages }}")
    (old / "additional_chat_templates").mkdir()
    (old / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    convert_main(["--init", "tiny", "--tokenizer", str(old), "--out", str(out)])
    assert (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    argv = ["--init", "tiny", "--tokenizer", str(new), "--out", str(out)]
    with pytest.raises(SystemExit):
        convert_main(argv)
    said = capsys.readouterr().err
    assert "already holds additional_chat_templates/tool_use.jinja, chat_template.jinja," in said
    convert_main([*argv, "--overwrite"])
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["config.json", "model.safetensors", "tokenizer.json"], left
    assert json.loads((out / "tokenizer.json").read_text())["model"]["vocab"] == {
        "x": 0,
        "y": 1,
        "z": 2,
    }
    # A model without a tokenizer over one with: the old tokenizer goes too (its ids
    # would not be this model's), from --init and from --from-hf alike.
    convert_main(["--init", "tiny", "--vocab-size", "300", "--out", str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    convert_main(["--init", "tiny", "--tokenizer", str(old), "--out", str(old / "m")])
    bare = tmp_path / "bare"
    convert_main(["--init", "tiny", "--out", str(bare)])
    convert_main(["--from-hf", str(old / "m"), "--out", str(tmp_path / "native")])
    assert (tmp_path / "native" / "chat_template.jinja").is_file()
    convert_main(["--from-hf", str(bare), "--out", str(tmp_path / "native"), "--overwrite"])
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [
        "jflash_config.json",
        "params.safetensors",
    ]


def test_init_takes_a_tokenizer_file_named_without_a_folder(tmp_path, monkeypatch):
    """`--tokenizer tokenizer.json` in the working directory (no folder in its name)
    gives the model its files, as `./tokenizer.json` does."""
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    monkeypatch.chdir(tmp_path)
    convert_main(["--init", "tiny", "--tokenizer", "tokenizer.json", "--out", "hf"])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 3


def test_swish_is_silu():
    """transformers' `swish` is its `silu`: the same SwiGLU model."""
    assert models.from_hf_config(_HF | {"hidden_act": "swish"}) == models.from_hf_config(_HF)


def test_init_takes_bos_and_eos_from_the_tokenizer_only(tmp_path, capsys):
    """A tokenizer that names an EOS and no BOS: the config has its EOS and no BOS, not
    the preset's id 1 (another token of this vocabulary)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(tmp_path / "hf")])
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["vocab_size"], hf["bos_token_id"], hf["eos_token_id"]) == (4, None, 0)
    assert "eos_token_id=0" in capsys.readouterr().out


def test_init_carries_the_tokenizers_padding_id(tmp_path):
    """The tokenizer's pad_token (here the EOS, a common choice) is the config's
    pad_token_id; a pad token the tokenizer.json lacks (HF adds it at load) is none."""
    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"}
    (tok / "tokenizer_config.json").write_text(json.dumps(special))
    convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(tmp_path / "hf")])
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (0, 1, 1)
    assert models.load_hf(tmp_path / "hf")[0].pad_token_id == 1
    (tok / "tokenizer_config.json").write_text(json.dumps({**special, "pad_token": "<pad>"}))
    convert_main(["--init", "tiny", "--tokenizer", str(tok), "--out", str(tmp_path / "hf2")])
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["pad_token_id"] is None


def test_cli_init_writes_the_dtype_and_shards_asked_for(tmp_path):
    out = tmp_path / "hf"
    convert_main(
        ["--init", "tiny", "--dtype", "bfloat16", "--max-shard-gb", "5e-4"] + ["--out", str(out)]
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2 and not (out / "model.safetensors").exists()
    assert {
        SafetensorsFile(out / shards[0])[k].dtype for k in SafetensorsFile(out / shards[0])
    } == {np.dtype(ml_dtypes.bfloat16)}
    config, _ = models.load_hf(out)
    assert config == models.TINY


def test_cli_round_trip(tmp_path, params, capsys):
    models.export_hf(params, SMALL, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    convert_main(["--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "native")])
    assert (tmp_path / "native" / "tokenizer.json").exists()
    config, native = models.load_native(tmp_path / "native")
    assert config == SMALL
    jax.tree.map(np.testing.assert_array_equal, native, params)
    convert_main(["--to-hf", str(tmp_path / "native"), "--out", str(tmp_path / "hf2")])
    a = SafetensorsFile(tmp_path / "hf" / "model.safetensors")
    b = SafetensorsFile(tmp_path / "hf2" / "model.safetensors")
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert "parameters" in capsys.readouterr().out
    # in place: the tokenizer is already there, which is no error
    convert_main(["--to-hf", str(tmp_path / "native"), "--out", str(tmp_path / "native")])
    jax.tree.map(np.testing.assert_array_equal, models.load_hf(tmp_path / "native")[1], params)


def test_save_native_cut_off_leaves_the_old_model_whole(tmp_path, params, monkeypatch):
    """`save_native` over another model writes the new parameters staged beside the old
    ones: a write cut off (Ctrl-C, a full disk) removes them and leaves the old model
    whole, never another model's config over half-written parameters."""
    import models.convert as convert

    models.save_native(params, SMALL, tmp_path / "native")

    def cut_off(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "save_file", cut_off)
    doubled = jax.tree.map(lambda a: a * 2, params)
    with pytest.raises(KeyboardInterrupt):
        models.save_native(doubled, SMALL, tmp_path / "native")
    assert sorted(os.listdir(tmp_path / "native")) == ["jflash_config.json", "params.safetensors"]
    config, native = models.load_native(tmp_path / "native")
    jax.tree.map(np.testing.assert_array_equal, native, params)
    monkeypatch.undo()
    models.save_native(params, SMALL, tmp_path / "native")
    config, native = models.load_native(tmp_path / "native")
    assert config == SMALL
    jax.tree.map(np.testing.assert_array_equal, native, params)


def test_load_hf_says_pickle_weights_are_not_read(tmp_path, params):
    """PyTorch pickle weights (`pytorch_model.bin`) are refused in one line saying what
    to do, not as a directory without weights."""
    models.export_hf(params, SMALL, tmp_path / "bin")
    (tmp_path / "bin" / "model.safetensors").rename(tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"PyTorch pickle weights \(pytorch_model.bin\)"):
        models.load_hf(tmp_path / "bin")


def test_with_rope_replaces_theta_or_scaling_as_hf_reads_them():
    """`with_rope` (the trainer's --rope_theta / --rope_scaling): theta alone keeps the
    scaling; a scaling object is read as a config.json's (llama3's pre-training context
    from max_position_embeddings where it names none, from the model's own where its
    RoPE is llama3 already); `default` removes it; errors do not speak of a config.json."""
    from models.config import RopeConfig, with_rope

    llama3 = models.preset("llama3.2-1b")
    assert with_rope(llama3, theta=1e6).rope == dataclasses.replace(llama3.rope, theta=1e6)
    assert with_rope(llama3, scaling={"rope_type": "default"}).rope == RopeConfig(
        theta=llama3.rope.theta
    )
    tiny = models.TINY
    scaled = with_rope(
        tiny, 2e5, {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}
    )
    assert scaled.rope == RopeConfig(
        theta=2e5, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=tiny.max_position_embeddings,
    )  # fmt: skip
    assert with_rope(tiny).rope == tiny.rope
    # A llama3 model (an export of the run above raises max_position_embeddings) keeps
    # its own pre-training context: the same flag again gives the same RoPE.
    exported = scaled.replace(max_position_embeddings=8 * tiny.max_position_embeddings)
    again = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}
    assert with_rope(exported, 2e5, again).rope == scaled.rope
    named = with_rope(exported, 2e5, {**again, "original_max_position_embeddings": 64})
    assert named.rope.original_max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"^rope type 'linear' needs 'factor'") as error:
        with_rope(tiny, scaling={"rope_type": "linear"})
    assert "config.json" not in str(error.value)
