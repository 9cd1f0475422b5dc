"""GGUF Q8_0 / Q4_0 / Q4_1 tensors -> `models.quantization.formats.QuantizedWeight`, straight from the raw blocks.

No float round trip: the integer codes are copied (bytes re-arranged, never decoded to float) and the per-block f16
scales/mins are widened to float32 (exact). The result dequantizes bit-identically to `gguf.quants.dequantize`
(d * q, and d * q + m for Q4_1, are exact or singly-rounded in float32 either way).

Layout. GGUF stores a linear weight as numpy [out, in] (ggml's ne = [in, out]) with 32-element blocks along `in`;
the canonical layout (`models/weights.py`) is [in, out]. So the result is transposed, with groups of 32 running along
the input (contraction) dimension, one scale per (group, output column):

    Q8_0  (34-byte block: f16 d, 32 x int8 q)      x = d * q          -> bits=8, group 32, symmetric (no zero point)
    Q4_0  (18-byte block: f16 d, 16 bytes)         x = d * (q - 8)    -> bits=4, group 32, zero_point = 8
    Q4_1  (20-byte block: f16 d, f16 m, 16 bytes)  x = d * q + m      -> bits=4, group 32, offset = m (the "min" form;
                                                                        -m/d as a zero point would not be exact)

Q4 bytes hold element j in the low nibble and j + 16 in the high one, which is `QuantizedWeight`'s packing, so the
bytes are only transposed. A tensor used without transposition (the token embedding [vocab, hidden]) converts the
same way: its QuantizedWeight is [hidden, vocab], i.e. the tied LM head, and `take_columns` gives embedding rows.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from models.optional_deps import require
from models.quantization.formats import QuantizedWeight

Q = require("gguf", "Reading a GGUF file").GGMLQuantizationType

GGUF_BLOCK = 32
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}
SUPPORTED_QUANT_TYPES = tuple(q.name for q in _BLOCK_BYTES)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """[out, nb] float32 from the f16 at bytes start..start+2 of each block."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _to_canonical(per_row: np.ndarray) -> np.ndarray:
    """[out, nb, b] block-major data -> [nb * b, out] (input-major, groups along axis 0)."""
    out, nb, b = per_row.shape
    return np.ascontiguousarray(per_row.transpose(1, 2, 0)).reshape(nb * b, out)


def from_gguf_blocks(raw: np.ndarray, qtype: Q | int, shape: tuple[int, int], *,
                     row_transform: Callable[[np.ndarray], np.ndarray] | None = None) -> QuantizedWeight:
    """QuantizedWeight of the canonical [in, out] weight for a GGUF tensor of numpy `shape` [out, in].

    `raw` is the tensor's data (`ReaderTensor.data`, uint8 [out, in/32 * block_bytes] or flat). `row_transform`
    permutes the output rows of an [out, ...] array (e.g. `functools.partial(gguf_file.unpermute_qk, n_head=9)`);
    it is applied to the per-block arrays, which is the same as applying it to the float weight.
    """
    qtype = Q(qtype)
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {SUPPORTED_QUANT_TYPES} for native quantized loading, got "
                         f"{qtype.name}")
    if len(shape) != 2:
        raise ValueError(f"shape must be 2-D [out, in], got {tuple(shape)}")
    out, k = (int(d) for d in shape)
    if k % GGUF_BLOCK:
        raise ValueError(f"shape {tuple(shape)}: the input dimension {k} is not a multiple of the {GGUF_BLOCK}-element "
                         "GGUF block")
    nb, bb = k // GGUF_BLOCK, _BLOCK_BYTES[qtype]
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if raw.size != out * nb * bb:
        raise ValueError(f"raw has {raw.size} bytes, expected {out * nb * bb} for {qtype.name} of shape {tuple(shape)}")
    blocks = raw.reshape(out, nb, bb)
    if row_transform is not None:
        blocks = np.asarray(row_transform(blocks))
    scale = np.ascontiguousarray(_f16(blocks, 0).T)  # [nb, out]
    common = dict(scale=scale, group_size=GGUF_BLOCK, shape=(k, out))
    if qtype == Q.Q8_0:
        q = _to_canonical(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return QuantizedWeight(q=q, bits=8, **common).validate()
    if qtype == Q.Q4_0:
        q = _to_canonical(blocks[..., 2:])
        return QuantizedWeight(q=q, zero_point=np.full((nb, out), 8, np.int8), bits=4, **common).validate()
    q = _to_canonical(blocks[..., 4:])  # Q4_1
    return QuantizedWeight(q=q, offset=np.ascontiguousarray(_f16(blocks, 2).T), bits=4, **common).validate()


def from_reader_tensor(tensor, *, row_transform: Callable[[np.ndarray], np.ndarray] | None = None) -> QuantizedWeight:
    """Same, for a `gguf.GGUFReader` tensor (its `shape` lists dims fastest-first, so it is reversed here)."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return from_gguf_blocks(tensor.data, tensor.tensor_type, shape, row_transform=row_transform)
