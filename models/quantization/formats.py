"""Weight quantization: the affine quantizer, int4 packing, and a pytree container whose matmul skips float weights.

Affine quantizer (per element, `scale` and `zero_point` broadcast against `x`):

    z  = clip(round(x / s) + z0, zmin, zmax)        quantize(x, s, z0, bits)
    x̂  = s * (z - z0)                                dequantize(z, s, z0)

`bits=8` is signed (zmin, zmax = -128, 127; int8), `bits=4` unsigned (0, 15; uint8 holding one value per byte until
packed). `round` is round-half-to-even (numpy/XLA). Worked example: x=5.2342, s=0.1, z0=4 -> z=56, x̂=5.2.

A second, "min" form x̂ = s * z + offset is supported by `dequantize(z, s, offset=m)` and by `QuantizedWeight`: GGUF
Q4_1 stores x = d * q + m, and re-expressing m as an integer or float zero point (z0 = -m/d) is not exact in float32,
while s * z + m with the stored f16 d and m is bit-identical to llama.cpp/gguf's dequantization.

`QuantizedWeight` holds a linear weight W in the canonical `[in, out]` layout (`models/weights.py`), quantized in
groups of `group_size` consecutive *input* rows per output column (group_size == in is per-output-channel):

    q           bits=8: int8 [in, out]; bits=4: uint8 [in // 2, out], two values per byte. Within each group of g
                rows, byte j holds element j in its low nibble and element j + g/2 in its high nibble (ggml's Q4
                layout, so GGUF Q4 blocks need no re-shuffling).
    scale       float32 [in // group_size, out]
    zero_point  int8 [in // group_size, out] or None (None: symmetric, z0 = 0)       x̂ = scale * (z - zero_point)
    offset      float32 [in // group_size, out] or None (the min form; excludes zero_point)   x̂ = scale * z + offset

`matmul(x, qw, method=...)` computes x @ W:

    "dequant"  dequantize inside the jit, then one float dot. Exact (equals x @ qw.dequantize() to float rounding),
               but XLA:CPU materializes the full float32 weight before the dot (the dot is a library call, so the
               convert cannot fuse into it) and that convert is slow for large weights. So on CPU, up to 32
               rows (`grouped_cpu.KERNEL.rows`), the C++ kernel `kernels_pallas.matmul.grouped_cpu` computes the same
               product from the codes in place (group by group, float32 activations and accumulation).
    "int8"     dynamic per-token activation quantization (symmetric int8 per row and per weight group), then
               int8 x int8 -> int32 dots per group, integer zero-point correction, float scales, sum over groups.
               No float (or int32) copy of the weight exists (the int8 dot runs in XLA:CPU's YNNPACK fusion);
               4-bit weights are unpacked to two int8 nibble arrays (1 byte per weight) before the dots.
               Approximate: it equals x̃ @ qw.dequantize() where x̃ is the fake-quantized activation
               (relative error ~1e-2 of the output scale, see scripts/bench/quant_bench.py). At batch 1 the activation is
               padded to 2 rows, because XLA:CPU lowers a 1-row int8 dot by first converting the weight to int32.
               On CPU, per-channel int8 weights take the C++ kernel `kernels_pallas.matmul.int8_cpu` instead (AVX-512
               VNNI or AMX tiles where the CPU has them) at the rows `native.gate.MEASURED` has it faster at (every
               row count on AVX2, 1-8 on AVX-512 VNNI, 1-32 with AMX; XLA's int8 dot beyond): the same quantizing, exact
               int32 dot and rescaling in one call, so the same bits either way, and no XLA fusions around it.
    "grouped"  float per-group partial dots over [in/g, g, out] then scale and sum; exact to float rounding, but
               the unpacked weight is still converted to float32 in memory.

FP8 weights (`quantize_fp8`, `fp8_weight`): q is float8_e4m3fn [in, out] (bits=8, no zero point or offset), x̂ = scale
* q with float32 scales per output channel (group_size == in), per tensor (the same [1, out] row repeated) or per
128x128 block (a checkpoint's [in/128, out/128] block scales repeated over each block's 128 columns, so the layout
stays [in/g, out] with g=128: exact, at 4 bytes per 128 weights). Its methods:

    "fp8"      dynamic per-token activation quantization to e4m3 (scale amax/448 per row and weight group), then
               FP8 x FP8 dots with a float32 accumulator, the float scales after: the matmul Hopper's tensor cores
               run (`fp8_matmul_supported`). XLA:CPU and TPU v5e/v6e have no FP8 units.
    "dequant"  weight-only: the e4m3 codes converted to the activation's float type (bf16 or f32; e4m3 values are
               exact in both) inside the dot, the per-channel scale applied to the output columns (per group:
               partial dots scaled then summed). The path on chips without FP8.

Measured with scripts/bench/quant_bench.py on the contended 2-core CPU (time relative to the f32 matmul, 1x576x1536 /
32x576x1536 / 1x576x49152): per-channel int8 "int8" 0.9 / 0.7 / 1.1 (the only variant without a weight-sized
float, int32 or int8 temporary); grouped (g=32/64) "int8" 1.8-2.1 / 2.9-4.1 / 2.2-4.3; "dequant" 1.0-1.4 / 0.9-1.3 /
~8 (it writes a 108 MiB float32 LM head every call); "grouped" 1.1-2.7 / 3.2-3.8 / ~8. Per-group int8 dots are
short (g-deep) batched dots that YNNPACK runs poorly, and their [K/g, M, N] accumulator equals the float weight in
size once M >= g, so for grouped weights "dequant" wins at M=32 and "int8" at M=1.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kernels_pallas.backend import target_backend, target_device_kind
from kernels_pallas.matmul import grouped_cpu, int8_cpu
from kernels_pallas.native import gate

SUPPORTED_BITS = (4, 8)
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_BLOCK = 128  # the block of block-wise FP8 checkpoints (DeepSeek-V3, Qwen3-FP8): 128 x 128 weights per scale
#: Device kinds whose GPUs have FP8 tensor cores (Ada sm_89, Hopper sm_90, Blackwell).
FP8_GPU_KINDS = ("H100", "H200", "H800", "H20", "GH200", "L4", "L40", "B100", "B200", "GB200", "RTX 40", "RTX 50")
SUPPORTED_GROUP_SIZES = (32, 64, 128)
MATMUL_METHODS = ("dequant", "int8", "grouped", "fp8")


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def int_range(bits: int) -> tuple[int, int]:
    """(zmin, zmax): signed for 8 bits, unsigned for 4 bits."""
    _check_bits(bits)
    return (-128, 127) if bits == 8 else (0, 15)


def _int_dtype(bits: int):
    return jnp.int8 if bits == 8 else jnp.uint8


def quantize(x: Any, scale: Any, zero_point: Any = 0, bits: int = 8) -> jax.Array:
    """z = clip(round(x / scale) + zero_point, zmin, zmax) as int8 (bits=8) or uint8 values 0..15 (bits=4)."""
    zmin, zmax = int_range(bits)
    x = jnp.asarray(x, jnp.float32)
    z = jnp.round(x / jnp.asarray(scale, jnp.float32)) + jnp.asarray(zero_point, jnp.float32)
    return jnp.clip(z, zmin, zmax).astype(_int_dtype(bits))


def dequantize(z: Any, scale: Any, zero_point: Any = 0, *, offset: Any = None) -> jax.Array:
    """x̂ = scale * (z - zero_point), or with `offset` (the min form, zero_point must stay 0): scale * z + offset."""
    z = jnp.asarray(z)
    scale = jnp.asarray(scale, jnp.float32)
    if offset is not None:
        if not (isinstance(zero_point, (int, float)) and zero_point == 0):
            raise ValueError("zero_point and offset are two forms of the same term; pass only one of them")
        return scale * z.astype(jnp.float32) + jnp.asarray(offset, jnp.float32)
    diff = z.astype(jnp.int32) - jnp.asarray(zero_point).astype(jnp.int32) \
        if jnp.issubdtype(jnp.asarray(zero_point).dtype, jnp.integer) \
        else z.astype(jnp.float32) - jnp.asarray(zero_point, jnp.float32)
    return scale * diff.astype(jnp.float32)


# --------------------------------------------------------------------------------------------------------------------
# Packing two 4-bit values per byte along axis 0, group-wise (ggml layout).

def _check_group(rows: int, group_size: int, *, name: str = "group_size") -> None:
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0 or group_size % 2:
        raise ValueError(f"{name} must be a positive even integer, got {group_size!r}")
    if rows % group_size:
        raise ValueError(f"{name}={group_size} does not divide the input dimension {rows}")


def pack_int4(z: Any, group_size: int) -> jax.Array:
    """uint8 [K, ...] values 0..15 -> uint8 [K/2, ...]: in each group of `group_size` rows,
    byte j = z[j] | z[j+g/2] << 4."""
    z = jnp.asarray(z)
    _check_group(z.shape[0], group_size)
    g = z.reshape(z.shape[0] // group_size, 2, group_size // 2, *z.shape[1:]).astype(jnp.uint8)
    return (g[:, 0] | (g[:, 1] << 4)).reshape(z.shape[0] // 2, *z.shape[1:])


def unpack_int4(packed: Any, group_size: int) -> jax.Array:
    """Inverse of `pack_int4`: uint8 [K/2, ...] -> uint8 [K, ...] values 0..15."""
    p = jnp.asarray(packed)
    _check_group(p.shape[0] * 2, group_size)
    g = p.reshape(p.shape[0] * 2 // group_size, group_size // 2, *p.shape[1:])
    return jnp.concatenate([g & 0x0F, g >> 4], axis=1).reshape(p.shape[0] * 2, *p.shape[1:])


# --------------------------------------------------------------------------------------------------------------------
# The container.

@struct.dataclass
class QuantizedWeight:
    """A quantized [in, out] linear weight (see the module docstring for the layout); a pytree (arrays are leaves)."""

    q: Any
    scale: Any
    zero_point: Any = None
    offset: Any = None
    bits: int = struct.field(pytree_node=False, default=8)
    group_size: int = struct.field(pytree_node=False, default=0)
    shape: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))

    @property
    def num_groups(self) -> int:
        return self.shape[0] // self.group_size

    @property
    def is_fp8(self) -> bool:
        """float8_e4m3fn codes (x̂ = scale * q) rather than integer ones."""
        return np.dtype(self.q.dtype) == np.dtype(FP8_DTYPE)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in (self.q, self.scale, self.zero_point, self.offset) if a is not None)

    def validate(self) -> "QuantizedWeight":
        """Raise ValueError naming the first inconsistent field; returns self."""
        _check_bits(self.bits)
        k, n = self.shape
        _check_group(k, self.group_size)
        q_shape = (k, n) if self.bits == 8 else (k // 2, n)
        if tuple(self.q.shape) != q_shape:
            raise ValueError(f"q has shape {tuple(self.q.shape)}, expected {q_shape} for bits={self.bits}, "
                             f"shape={self.shape}")
        if self.is_fp8:
            if self.zero_point is not None or self.offset is not None:
                raise ValueError("an FP8 weight (float8_e4m3fn q) is symmetric: no zero_point or offset")
        elif np.dtype(self.q.dtype) != np.dtype(_int_dtype(self.bits)):
            raise ValueError(f"q has dtype {self.q.dtype}, expected {np.dtype(_int_dtype(self.bits))} "
                             f"(or float8_e4m3fn for an FP8 weight)")
        g_shape = (k // self.group_size, n)
        for name in ("scale", "zero_point", "offset"):
            a = getattr(self, name)
            if a is not None and tuple(a.shape) != g_shape:
                raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {g_shape}")
        if self.zero_point is not None and self.offset is not None:
            raise ValueError("zero_point and offset are exclusive (two forms of the same term)")
        return self

    def int_values(self) -> jax.Array:
        """Unpacked codes [in, out] (int8, uint8 0..15, or float8_e4m3fn)."""
        return jnp.asarray(self.q) if self.bits == 8 else unpack_int4(self.q, self.group_size)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """Float weight [in, out]."""
        k, n = self.shape
        z = self.int_values().reshape(self.num_groups, self.group_size, n)
        per_group = lambda a: None if a is None else jnp.asarray(a)[:, None, :]  # noqa: E731
        if self.is_fp8:
            w = z.astype(jnp.float32) * per_group(self.scale)
        elif self.offset is not None:
            w = dequantize(z, per_group(self.scale), offset=per_group(self.offset))
        else:
            w = dequantize(z, per_group(self.scale), 0 if self.zero_point is None else per_group(self.zero_point))
        return w.reshape(k, n).astype(dtype)

    def take_columns(self, idx: Any, dtype=jnp.float32) -> jax.Array:
        """Dequantized columns W[:, idx].T -> [len(idx), in]: an embedding lookup when W is a (tied) LM head."""
        idx = jnp.asarray(idx)
        cols = lambda a: None if a is None else jnp.take(jnp.asarray(a), idx, axis=1)  # noqa: E731
        sub = self.replace(q=cols(self.q), scale=cols(self.scale), zero_point=cols(self.zero_point),
                           offset=cols(self.offset), shape=(self.shape[0], int(idx.size)))
        return sub.dequantize(dtype).T


# --------------------------------------------------------------------------------------------------------------------
# Quantizing float weights.

def _check_group_size(group_size: int | None, k: int) -> int:
    if group_size is None:
        return k
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be None (per channel) or one of {SUPPORTED_GROUP_SIZES}, got "
                         f"{group_size!r}")
    _check_group(k, group_size)
    return group_size


def _symmetric(w: Any, group_size: int | None, qmax: float, codes) -> QuantizedWeight:
    """scale = max|w| / qmax per output channel (group_size=None) or per group of input rows; q = codes(w / scale)."""
    w = jnp.asarray(w, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [in, out] weight, got shape {w.shape}")
    k, n = w.shape
    g = _check_group_size(group_size, k)
    wg = w.reshape(k // g, g, n)
    amax = jnp.max(jnp.abs(wg), axis=1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    q = codes(wg / scale[:, None, :]).reshape(k, n)
    return QuantizedWeight(q=q, scale=scale, bits=8, group_size=g, shape=(k, n)).validate()


def quantize_int8(w: Any, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8, scale = max|w| / 127 per output channel (group_size=None) or per group of input rows."""
    return _symmetric(w, group_size, 127.0, lambda x: quantize(x, 1.0, 0, bits=8))


def quantize_int4(w: Any, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric 4-bit per group of `group_size` input rows: scale = (max - min) / 15, integer zero point in 0..15.

    The zero point is rounded to an integer, so x̂ = scale * (z - z0) stays in the pure affine form; the round-trip
    error is at most scale/2 per element (the range [min, max] is covered by z in [0, 15] up to half a step).
    """
    w = jnp.asarray(w, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [in, out] weight, got shape {w.shape}")
    if group_size is None:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES} for 4-bit weights, got None")
    k, n = w.shape
    g = _check_group_size(group_size, k)
    wg = w.reshape(k // g, g, n)
    lo = jnp.minimum(jnp.min(wg, axis=1), 0.0)  # include 0 so that 0 is (nearly) representable
    hi = jnp.maximum(jnp.max(wg, axis=1), 0.0)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(jnp.float32)
    zero_point = jnp.clip(jnp.round(-lo / scale), 0, 15)
    z = quantize(wg, scale[:, None, :], zero_point[:, None, :], bits=4).reshape(k, n)
    return QuantizedWeight(q=pack_int4(z, g), scale=scale, zero_point=zero_point.astype(jnp.int8), bits=4,
                           group_size=g, shape=(k, n)).validate()


def quantize_weight(w: Any, bits: int = 8, group_size: int | None = None) -> QuantizedWeight:
    """int8 symmetric (per channel when group_size is None) or int4 asymmetric grouped (group_size default 32)."""
    _check_bits(bits)
    return quantize_int8(w, group_size) if bits == 8 else quantize_int4(w, 32 if group_size is None else group_size)


def quantize_fp8(w: Any, group_size: int | None = None) -> QuantizedWeight:
    """float8_e4m3fn codes, scale = max|w| / 448 per output channel (group_size=None) or per group of input rows
    (round to nearest even, as a cast does; |w / scale| <= 448 by construction)."""
    return _symmetric(w, group_size, FP8_MAX, to_fp8)


def to_fp8(x: Any) -> jax.Array:
    """Saturating cast to float8_e4m3fn (a plain cast turns |x| > 448 into NaN: e4m3fn has no infinity)."""
    return jnp.clip(jnp.asarray(x, jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def fp8_weight(q: Any, scale: Any, *, name: str = "weight") -> QuantizedWeight:
    """An FP8 [in, out] weight from stored codes and scales, without a float copy: `scale` a scalar or [1] (per
    tensor), [out] or [1, out] (per output channel) or [ceil(in/128), ceil(out/128)] (128x128 blocks, the block-wise
    checkpoints' `weight_scale_inv`). Errors name `name` (the checkpoint tensor)."""
    q = jnp.asarray(q)
    if q.ndim != 2 or np.dtype(q.dtype) != np.dtype(FP8_DTYPE):
        raise ValueError(f"{name}: FP8 codes must be a 2-D float8_e4m3fn array, got {q.dtype} {tuple(q.shape)}")
    k, n = q.shape
    scale = jnp.asarray(scale)
    if not jnp.issubdtype(scale.dtype, jnp.floating) or np.dtype(scale.dtype) == np.dtype(FP8_DTYPE):
        raise ValueError(f"{name}: its scale must be float32/bfloat16/float16, got {scale.dtype}")
    scale = scale.astype(jnp.float32)
    blocks = (-(-k // FP8_BLOCK), -(-n // FP8_BLOCK))
    if scale.size == 1:
        return QuantizedWeight(q=q, scale=jnp.broadcast_to(scale.reshape(1, 1), (1, n)), bits=8, group_size=k,
                               shape=(k, n)).validate()
    if scale.shape in ((n,), (1, n)):
        return QuantizedWeight(q=q, scale=scale.reshape(1, n), bits=8, group_size=k, shape=(k, n)).validate()
    if scale.shape == blocks:
        if k % FP8_BLOCK and blocks[0] > 1:
            raise ValueError(f"{name}: 128x128 block scales need an input dimension divisible by 128 (or below "
                             f"it), got {k}")
        per_column = jnp.repeat(scale, FP8_BLOCK, axis=1)[:, :n]  # [in/128, out]: each block's scale per column
        return QuantizedWeight(q=q, scale=per_column, bits=8, group_size=min(k, FP8_BLOCK), shape=(k, n)).validate()
    raise ValueError(f"{name}: scale shape {tuple(scale.shape)} fits none of the FP8 layouts for a weight of "
                     f"[in, out] = {(k, n)}: per tensor (), per channel ({n},) or 128x128 blocks {blocks}")


def fp8_matmul_supported() -> bool:
    """Whether the chip the program is traced for has FP8 matmuls (a GPU of a kind in FP8_GPU_KINDS; an unknown
    GPU kind counts as one). XLA:CPU and TPU v5e/v6e have none: `pick_method` then dequantizes."""
    if target_backend() != "gpu":
        return False
    kind = target_device_kind("gpu")
    return kind is None or any(k in kind for k in FP8_GPU_KINDS)


# --------------------------------------------------------------------------------------------------------------------
# Matmul.

def _per_group(a: Any) -> jax.Array:
    return jnp.asarray(a)[:, None, :]  # [G, 1, N]


def grouped_kernel_runs(rows: int) -> bool:
    """Whether `matmul(method="dequant")` of `rows` rows runs `kernels_pallas.matmul.grouped_cpu` here (where
    `native.gate` lets it run at that many rows, `grouped_cpu.KERNEL.rows` at most): no float copy of the weight.
    `pick_method` asks it too, so the method it picks and the path `matmul` takes agree."""
    return gate.runs_here(grouped_cpu.KERNEL, rows=rows)


def _matmul_int8(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    m = x2.shape[0]
    k, n = qw.shape
    gsz, ng = qw.group_size, qw.num_groups
    # Per channel on CPU the C++ kernel does all of the below with the same bits in one call (where the gate lets
    # it run and its int32 sums stay exact); elsewhere XLA's dots run.
    if (qw.bits == 8 and ng == 1 and qw.zero_point is None and qw.offset is None and k <= int8_cpu.MAX_K
            and gate.runs_here(int8_cpu.KERNEL, rows=m)):
        return int8_cpu.int8_matmul_cpu(x2, jnp.asarray(qw.q), jnp.asarray(qw.scale).reshape(n))
    xg = x2.reshape(m, ng, gsz).transpose(1, 0, 2)  # [G, M, g]
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    sx = jnp.where(amax > 0, amax / 127.0, 1.0)  # [G, M, 1]
    xq = jnp.round(xg / sx).astype(jnp.int8)
    if m == 1:  # XLA:CPU's 1-row int8 dot converts the whole weight to int32 first; a 2-row one runs in YNNPACK
        xq = jnp.pad(xq, ((0, 0), (0, 1), (0, 0)))
    dn = (((2,), (1,)), ((0,), (0,)))
    if qw.bits == 8:
        acc = jax.lax.dot_general(xq, jnp.asarray(qw.q).reshape(ng, gsz, n), dn, preferred_element_type=jnp.int32)
    else:  # low nibbles are elements 0..g/2-1 of each group, high nibbles g/2..g-1: two dots, no unpacked copy
        p = jnp.asarray(qw.q).reshape(ng, gsz // 2, n)
        lo, hi = (p & 0x0F).astype(jnp.int8), (p >> 4).astype(jnp.int8)
        acc = (jax.lax.dot_general(xq[:, :, :gsz // 2], lo, dn, preferred_element_type=jnp.int32)
               + jax.lax.dot_general(xq[:, :, gsz // 2:], hi, dn, preferred_element_type=jnp.int32))
    acc = acc[:, :m]  # [G, M, N]
    xsum = jnp.sum(xq[:, :m].astype(jnp.int32), axis=-1, keepdims=True)  # [G, M, 1]
    if qw.zero_point is not None:
        acc = acc - _per_group(qw.zero_point).astype(jnp.int32) * xsum
    y = jnp.sum(acc.astype(jnp.float32) * sx * _per_group(qw.scale), axis=0)
    if qw.offset is not None:
        y = y + jnp.einsum("gm,gn->mn", (xsum.astype(jnp.float32) * sx)[..., 0], jnp.asarray(qw.offset))
    return y


def _matmul_grouped(x2: jax.Array, qw: QuantizedWeight) -> jax.Array:
    m = x2.shape[0]
    k, n = qw.shape
    gsz, ng = qw.group_size, qw.num_groups
    xg = x2.reshape(m, ng, gsz).transpose(1, 0, 2)  # [G, M, g]
    z = qw.int_values().reshape(ng, gsz, n).astype(jnp.float32)
    acc = jax.lax.dot_general(xg, z, (((2,), (1,)), ((0,), (0,))))
    xsum = jnp.sum(xg, axis=-1, keepdims=True)
    if qw.zero_point is not None:
        acc = acc - _per_group(qw.zero_point).astype(jnp.float32) * xsum
    y = acc * _per_group(qw.scale)
    if qw.offset is not None:
        y = y + xsum * _per_group(qw.offset)
    return jnp.sum(y, axis=0)


def _matmul_fp8(x2: jax.Array, qw: QuantizedWeight, compute_dtype) -> jax.Array:
    """FP8 weights: "fp8" (activations quantized per row and group, FP8 x FP8 -> f32) when compute_dtype is e4m3,
    else weight-only (codes cast to compute_dtype, exact). Per channel one 2-D dot, the scales on its output."""
    m = x2.shape[0]
    k, n = qw.shape
    gsz, ng = qw.group_size, qw.num_groups
    xg = x2.reshape(m, ng, gsz).transpose(1, 0, 2)  # [G, M, g]
    if compute_dtype == FP8_DTYPE:
        amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
        sx = jnp.where(amax > 0, amax / FP8_MAX, 1.0)  # [G, M, 1]
        xq = to_fp8(xg / sx)
    else:
        sx, xq = None, xg.astype(compute_dtype)
    w = jnp.asarray(qw.q).astype(compute_dtype)
    if ng == 1:
        acc = jax.lax.dot_general(xq[0], w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)[None]
    else:
        acc = jax.lax.dot_general(xq, w.reshape(ng, gsz, n), (((2,), (1,)), ((0,), (0,))),
                                  preferred_element_type=jnp.float32)  # [G, M, N]
    acc = acc * _per_group(qw.scale) if sx is None else acc * sx * _per_group(qw.scale)
    return acc[0] if ng == 1 else jnp.sum(acc, axis=0)


def matmul(x: Any, qw: QuantizedWeight, method: str = "dequant") -> jax.Array:
    """x[..., in] @ W -> [..., out] in x's dtype (float32 math). See the module docstring for the methods."""
    if method not in MATMUL_METHODS:
        raise ValueError(f"method must be one of {MATMUL_METHODS}, got {method!r}")
    x = jnp.asarray(x)
    k, n = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")
    if qw.is_fp8:
        if method not in ("fp8", "dequant"):
            raise ValueError(f"an FP8 weight runs method 'fp8' or 'dequant', not {method!r}")
        # bf16 activations stay bf16 for the weight-only dot (e4m3 codes are exact in bf16): TPU's MXU dtype.
        compute = FP8_DTYPE if method == "fp8" else (jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32)
        x2 = x.reshape(-1, k).astype(jnp.bfloat16 if compute == jnp.bfloat16 else jnp.float32)
        y = _matmul_fp8(x2, qw, compute)
        return y.reshape(*x.shape[:-1], n).astype(x.dtype)
    if method == "fp8":
        raise ValueError("method 'fp8' is for FP8 weights (float8_e4m3fn codes)")
    x2 = x.reshape(-1, k).astype(jnp.float32)
    if (method == "dequant" and grouped_kernel_runs(x2.shape[0])
            and (qw.zero_point is None or np.dtype(qw.zero_point.dtype) == np.int8)):  # what the kernel reads
        y = grouped_cpu.grouped_matmul_cpu(x2, jnp.asarray(qw.q), jnp.asarray(qw.scale), bits=qw.bits,
                                           group_size=int(qw.group_size),
                                           zero_point=None if qw.zero_point is None else jnp.asarray(qw.zero_point),
                                           offset=None if qw.offset is None else jnp.asarray(qw.offset))
    elif method == "dequant":
        y = jnp.dot(x2, qw.dequantize())
    elif method == "int8":
        y = _matmul_int8(x2, qw)
    else:
        y = _matmul_grouped(x2, qw)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)
