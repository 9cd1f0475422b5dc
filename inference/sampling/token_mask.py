"""The per-step token bitmask of structured outputs and `allowed_token_ids`, applied to the logits inside the
jitted sampler.

The host (inference/structured/manager.py) fills an int32 bitmask `[S, ceil(V / 32)]` per step: bit `t % 32` of
word `t // 32` of a row is 1 where token t is allowed (llguidance's layout, which its matchers write into directly).
Rows without a constraint, and padding rows, are all ones (-1). A bitmask rather than a boolean `[S, V]` array
because it is 32x smaller to move host -> device every step (6 KiB a row at V = 49152), and because it is what the
grammar engine produces, so no host-side conversion runs per step.

The mask is an input array, not part of the compiled program: one compiled variant serves every grammar and any mix
of constrained and free rows. Whether the step has a mask at all is a static fact (`SamplingTensors.token_mask` is
None or not), so batches without a constrained row run the sampler exactly as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: A bitmask word with every token allowed.
ALL_ALLOWED = -1


def mask_words(vocab_size: int) -> int:
    """Words of a bitmask row for `vocab_size` tokens: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def all_allowed(num_rows: int, vocab_size: int) -> np.ndarray:
    """An int32 bitmask `[num_rows, ceil(V / 32)]` that allows every token."""
    return np.full((num_rows, mask_words(vocab_size)), ALL_ALLOWED, np.int32)


def allowed_row(token_ids, vocab_size: int) -> np.ndarray:
    """One bitmask row [ceil(V / 32)] allowing exactly `token_ids` (vLLM's `allowed_token_ids`, which V1 applies as
    a dense mask too): built once per request, it rides the same mask input as a grammar's, so an allowed list
    compiles no step of its own."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.bool_)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)  # bit t % 32 of word t // 32


def restrict_rows(mask: np.ndarray | None, rows: list[tuple[int, np.ndarray, bool]], pad_to: int,
                  vocab_size: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(`mask` with each `rows` entry's `allowed_row` ANDed into its batch row, the rows whose raw logprobs see the
    mask) for `rows` of (batch row, allowed row, row has a grammar too). vLLM applies a grammar's bitmask before the
    sampler and an allowed list inside it, after the raw logprobs: so a row with only an allowed list samples under
    the mask and reports raw logprobs without it (a row with both reports them under both). `(mask, None)` when
    `rows` is empty: every masked row is a grammar row."""
    if not rows:
        return mask, None
    mask = all_allowed(pad_to, vocab_size) if mask is None else mask
    in_raw = np.ones(pad_to, np.bool_)
    for i, row, grammar in rows:
        mask[i] &= row
        in_raw[i] = grammar
    return mask, in_raw


def allowed_tokens(mask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V] from the int32 bitmask [S, W] (W * 32 >= V; bits past V are ignored)."""
    s, w = mask.shape
    if w * 32 < vocab_size:
        raise ValueError(f"a token bitmask of {w} words covers {w * 32} tokens, fewer than the vocabulary "
                         f"({vocab_size}); build it with mask_words(vocab_size) words")
    bits = jnp.arange(32, dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(jnp.asarray(mask, jnp.int32), jnp.uint32)
    allowed = ((words[:, :, None] >> bits) & 1).astype(jnp.bool_)  # [S, W, 32]: bit b of word w is token 32w + b
    return allowed.reshape(s, w * 32)[:, :vocab_size]


def apply_token_mask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """f32 logits [S, V] with disallowed tokens at -inf; unchanged (the same array) when `mask` is None.

    Allowed entries keep their exact value (a select, no arithmetic), so a row whose mask is all ones samples
    exactly as it would without a mask.
    """
    if mask is None:
        return logits
    logits = jnp.asarray(logits, jnp.float32)

    def masked(x):
        return jnp.where(allowed_tokens(mask, x.shape[-1]), x, jnp.float32(-jnp.inf))

    # A step with a mask but no constrained row (the extras variant, inference/runtime/step_variants.py) skips the
    # [S, V] unpack and select: reading the [S, V / 32] words is far cheaper.
    return jax.lax.cond(jnp.all(jnp.asarray(mask) == ALL_ALLOWED), lambda x: x, masked, logits)
