"""Parameter counts and training FLOPs: the one formula MFU uses.

Model FLOPs (what MFU divides by) count each multiply-add as 2 FLOPs and a
training step as forward + backward = 3x forward (the backward does two matmuls
per forward matmul). Per token:

* dense matmuls: ``6 * N_matmul`` where ``N_matmul`` counts every projection
  weight, the LM head included (tied or not) and the embedding lookup excluded;
* attention (Q K^T and P V): ``2 * 2 * L * N * H * S_eff`` forward FLOPs with
  ``S_eff = T`` keys per query, halved for causal masks (the FlashAttention-2
  paper's convention: the diagonal's extra half-token is not counted); with packed
  documents whose attention stays inside each, ``S_eff`` is the mean over the tokens
  of half their document's length (:func:`document_keys`). Times 3 for training.
  Recomputation by remat or by the attention backward is *not* counted (it is hardware
  FLOPs, not model FLOPs).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import LlamaConfig


def param_count(config: LlamaConfig) -> int:
    """Total trainable parameters (a tied LM head counted once)."""
    d, v = config.hidden_size, config.vocab_size
    head = 0 if config.tie_word_embeddings else d * v
    return v * d + config.num_layers * _layer_params(config) + d + head


def _layer_params(config: LlamaConfig) -> int:
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d


def matmul_param_count(config: LlamaConfig) -> int:
    """Weights used in matmuls per token: all projections plus the LM head."""
    norms = 2 * config.hidden_size
    return config.num_layers * (_layer_params(config) - norms) + config.hidden_size * (
        config.vocab_size
    )


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Model FLOPs per token of one sequence of length ``seq_len``.

    Attributes:
        matmul: dense projections and LM head, forward only.
        attention: Q K^T and P V, forward only (causal: halved).
    """

    matmul: float
    attention: float

    @property
    def forward(self) -> float:
        return self.matmul + self.attention

    @property
    def training(self) -> float:
        """Forward + backward (3x forward)."""
        return 3.0 * self.forward


def document_keys(segment_ids) -> float:
    """Keys per query of causal attention that stays inside each document, in the FLOP
    count's convention: each token of a document of ``n`` tokens counts ``n / 2``.
    ``segment_ids``: int ``[rows, T]``, numbered from 0 in each row (``train.data``'s)."""
    seg = np.asarray(segment_ids, np.int64)
    rows, t = seg.shape
    counts = np.bincount((seg + np.arange(rows)[:, None] * t).ravel())
    return float((counts.astype(np.float64) ** 2).sum() / 2 / max(rows * t, 1))


def flops_per_token(
    config: LlamaConfig, seq_len: int, *, causal: bool = True, keys: float | None = None
) -> FlopsPerToken:
    """Model FLOPs per token for sequences of ``seq_len`` tokens.

    Args:
        config: the model.
        seq_len: tokens per sequence (the attention term grows with it).
        causal: halve the attention term for a causal mask.
        keys: keys per query in place of ``seq_len`` (halved if causal): packed
            documents' (:func:`document_keys`).
    """
    if seq_len <= 0:
        raise ValueError(f"{seq_len=} must be positive")
    if keys is None:
        keys = seq_len / 2 if causal else seq_len
    attention = 4.0 * config.num_layers * config.num_heads * config.head_dim * keys
    return FlopsPerToken(matmul=2.0 * matmul_param_count(config), attention=attention)


def training_flops_per_token(
    config: LlamaConfig, seq_len: int, *, causal: bool = True, keys: float | None = None
) -> float:
    """``6 * N_matmul + 12 * L * N * H * seq_len * (1/2 if causal)`` (``keys`` in place of
    ``seq_len * (1/2 if causal)`` where given)."""
    return flops_per_token(config, seq_len, causal=causal, keys=keys).training
