"""The hashed n-gram row ids of Qwen4-Exp's PLE layers (pure; ids depend on tokens only).

For each token and each order n = 2..ngram_size, the token and the n - 1 before it are mixed
into one integer (each position multiplied by the layer's own odd multiplier, XORed), and each
of the order's `ngram_heads_per_order` heads takes it modulo its own prime table size, offset
to the head's part of the layer's table. Every head of every PLE layer has a different prime:
the successive primes from `ngram_vocab_base`, layer by layer.

The shifts stop at end-of-sequence: a token's n-gram reaches back over earlier tokens only
within its own segment; positions before the segment start (an earlier EOS, or the start of the
sequence) read as the EOS token. The EOS token itself ends the segment it belongs to.

Because the ids are known as soon as a token is, the streaming runtime can compute them before
layer 0 and issue every PLE layer's row reads at once: `ngram_row_ids` (the ids) and
`ngram_context_after` (the state it needs for the next call: the last ngram_size - 1 tokens).
The constants and derivations are transformers' (models/qwen4_exp, `Qwen4ExpTextNGramEmbedding`);
a file that stores the constants (llama.cpp's GGUF) is hashed with them as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.model_config import ModelConfig
from strata.families.qwen4_exp import ngram_table_sizes, primes_from, stored_hash_constants  # noqa: F401

_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX_M1 = 0xBF58476D1CE4E5B9
_SPLITMIX_M2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007  # each PLE layer's multipliers are seeded seed + stride * its PLE index
_MAX_INT64 = (1 << 63) - 1


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _SPLITMIX_M1) & _MASK64
    value = ((value ^ (value >> 27)) * _SPLITMIX_M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> np.ndarray:
    """One odd multiplier per n-gram position, small enough that token * multiplier never
    overflows int64 (multiplier < 2^63 / vocab). -> int64 [ngram_size]"""
    half_bound = max(1, (_MAX_INT64 // max(vocab_size, 1)) // 2)
    base_seed = seed + _LAYER_SEED_STRIDE * ple_index
    values = [2 * (_splitmix64((base_seed + _SPLITMIX_GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
              for i in range(ngram_size)]
    return np.asarray(values, np.int64)


@dataclass(frozen=True)
class NgramHash:
    """One PLE layer's hash parameters: the constants the file stores (a llama.cpp GGUF's
    `ple.*` arrays: the config's ngram_multipliers, ...), else derived from the config and the
    layer's PLE index (transformers' derivation; the two agree where a file holds both).

    Shapes: multipliers [ngram_size], head_sizes / head_offsets [N] (N = (ngram_size - 1) * heads_per_order)"""

    ngram_size: int
    heads_per_order: int
    eos: int
    multipliers: np.ndarray
    head_sizes: np.ndarray
    head_offsets: np.ndarray
    table_rows: int  # the layer's table: every head's rows, padded to ngram_vocab_divisor

    @staticmethod
    def of(cfg: ModelConfig, ple_index: int) -> "NgramHash":
        sizes, offsets, rows = ngram_table_sizes(cfg, ple_index)
        stored = stored_hash_constants(cfg, ple_index)
        multipliers = stored.multipliers if stored else layer_multipliers(
            cfg.vocab_size, cfg.qwen4.ngram_size, ple_index, cfg.qwen4.ngram_seed)
        return NgramHash(cfg.qwen4.ngram_size, cfg.qwen4.ngram_heads_per_order, cfg.qwen4.ngram_eos_token,
                         multipliers, sizes, offsets, rows)

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1


def initial_ngram_context(h: NgramHash) -> np.ndarray:
    """The context before the first token: ngram_size - 1 EOS tokens. -> int64 [ngram_size - 1]"""
    return np.full(h.context_len, h.eos, np.int64)


def ngram_context_after(h: NgramHash, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The n-gram context after `tokens` (the last ngram_size - 1 tokens of context + tokens).

    Shapes: context [ngram_size - 1], tokens [T] -> int64 [ngram_size - 1]"""
    history = np.concatenate([np.asarray(context, np.int64), np.asarray(tokens, np.int64)])
    return history[len(history) - h.context_len:]


def shift_within_segment(history: np.ndarray, shift: int, eos: int) -> np.ndarray:
    """history shifted right by `shift`, EOS wherever the source lies before the position's
    segment (the segment starts after the last EOS strictly before the position). [L] -> [L]"""
    if shift == 0:
        return history
    positions = np.arange(len(history))
    eos_at = np.where(history == eos, positions, -1)
    last_eos = np.maximum.accumulate(eos_at) if len(history) else eos_at
    before = np.concatenate([[-1], last_eos[:-1]])  # the last EOS strictly before each position
    in_segment = positions - (before + 1)
    source = positions - shift
    valid = (in_segment >= shift) & (source >= 0)
    return np.where(valid, history[np.maximum(source, 0)], eos)


def ngram_row_ids(h: NgramHash, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Every head's row in the layer's table for each token, after `context`.

    Heads are ordered by n-gram order (2, 3, ...), `heads_per_order` each: the order the rows are
    concatenated in to form the token's PLE embedding.

    Shapes: context int [ngram_size - 1], tokens int [T] -> int64 [T, N]
    """
    tokens = np.asarray(tokens, np.int64)
    history = np.concatenate([np.asarray(context, np.int64), tokens])  # [n-1+T]
    shifted = [shift_within_segment(history, s, h.eos) for s in range(h.ngram_size)]
    blocks = []
    for order in range(2, h.ngram_size + 1):
        mixed = shifted[0] * h.multipliers[0]  # < 2^63: no wrap (layer_multipliers)
        for position in range(1, order):
            mixed = np.bitwise_xor(mixed, shifted[position] * h.multipliers[position])
        heads = slice((order - 2) * h.heads_per_order, (order - 1) * h.heads_per_order)
        blocks.append(mixed[:, None] % h.head_sizes[heads][None, :] + h.head_offsets[heads][None, :])
    return np.concatenate(blocks, axis=1)[len(history) - len(tokens):]
