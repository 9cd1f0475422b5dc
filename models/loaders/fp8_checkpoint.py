"""FP8 Hugging Face checkpoints: the two layouts users download, read as `QuantizedWeight`s without a float copy.

    compressed-tensors  config.json `quantization_config: {quant_method: "compressed-tensors", format:
                        "float-quantized", config_groups: {...: {weights: {type: "float", num_bits: 8, strategy:
                        "channel" | "tensor"}}}, ignore: [...]}` (llm-compressor's FP8 / FP8_DYNAMIC): `X.weight`
                        float8_e4m3fn [out, in], `X.weight_scale` [out, 1] (channel) or [1] / [] (tensor), and for
                        static activation schemes `X.input_scale`.
    fp8 (block-wise)    `quantization_config: {quant_method: "fp8", weight_block_size: [128, 128]}` (DeepSeek-V3,
                        Qwen3-FP8): `X.weight` float8_e4m3fn [out, in], `X.weight_scale_inv` [ceil(out/128),
                        ceil(in/128)], w = q * weight_scale_inv per 128x128 block (the name says inverse; the
                        dequantization multiplies, as DeepSeek's `weight_dequant` does).

Each FP8 weight becomes `formats.fp8_weight(q.T, scale.T)` ([in, out], per-tensor / per-channel / block scales).
`input_scale` (a static per-tensor activation scale) is dropped: activations are quantized per token at run time
(models/quantization/formats.py), which needs no calibration and is at least as fine. A malformed checkpoint
(FP8 weight without its scale, a scale without an FP8 weight, a wrong shape or dtype) is a ValueError naming the
tensor. `fp8_hf_tensors` writes the compressed-tensors layout (scripts/convert.py --quantization=fp8).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from models.quantization.formats import FP8_BLOCK, QuantizedWeight, fp8_weight

FP8_LAYOUTS = ("compressed-tensors", "fp8")
_SCALE_SUFFIX = {"compressed-tensors": ".weight_scale", "fp8": ".weight_scale_inv"}


def fp8_layout(cfg: dict[str, Any], source: str = "config.json") -> str | None:
    """The FP8 layout config.json's `quantization_config` names ("compressed-tensors" or "fp8"), None without one;
    ValueError for a quantization this loader cannot read."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"{source}: quant_method 'fp8' with weight_block_size {block}; only "
                             f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks (or none: per-tensor scales) are supported")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{source}: FP8 format {qc.get('fmt')!r}; only e4m3 (float8_e4m3fn) is supported")
        return "fp8"
    if method == "compressed-tensors":
        groups = (qc.get("config_groups") or {}).values()
        formats = {g.get("format", qc.get("format")) for g in groups} or {qc.get("format")}
        weights = [g.get("weights") or {} for g in groups]
        if formats != {"float-quantized"} or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ValueError(f"{source}: compressed-tensors format {sorted(map(str, formats))} with weights "
                             f"{weights}; pagejax reads its 'float-quantized' FP8 (8-bit float) layout only")
        strategies = {w.get("strategy") for w in weights}
        if not strategies <= {"channel", "tensor", "block"}:
            raise ValueError(f"{source}: FP8 weight strategy {sorted(map(str, strategies))}; supported: channel, "
                             "tensor, block (128x128)")
        return "compressed-tensors"
    raise ValueError(f"{source}: quantization_config quant_method {method!r} is not a checkpoint layout pagejax "
                     f"reads (FP8: {', '.join(FP8_LAYOUTS)}); load a float checkpoint and pass quantization=")


def take_fp8_weights(tensors: dict[str, np.ndarray], layout: str | None, source: str) -> dict[str, Any]:
    """`tensors` (HF names) with each FP8 weight and its scale replaced by one [in, out] `QuantizedWeight` under the
    weight's name (activation scales dropped); float tensors pass through. `layout`: `fp8_layout`'s answer."""
    fp8_names = [n for n, t in tensors.items() if np.dtype(t.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)]
    if layout is None:
        if fp8_names:
            raise ValueError(f"{source}: tensor {fp8_names[0]!r} is float8_e4m3fn but config.json has no "
                             "quantization_config saying how it is scaled")
        return tensors
    suffix = _SCALE_SUFFIX[layout]
    out = {n: t for n, t in tensors.items() if not n.endswith((suffix, ".input_scale"))}
    for name in [n for n in tensors if n.endswith(suffix)]:
        weight = name[:-len(suffix)] + ".weight"
        if weight not in tensors:
            raise ValueError(f"{source}: scale {name!r} has no weight {weight!r} beside it")
        if weight not in fp8_names:
            raise ValueError(f"{source}: {weight!r} has dtype {tensors[weight].dtype}, but its scale {name!r} marks "
                             "it FP8; expected float8_e4m3fn")
    for weight in fp8_names:
        scale_name = weight[:-len(".weight")] + suffix if weight.endswith(".weight") else None
        if scale_name not in tensors:
            raise ValueError(f"{source}: FP8 tensor {weight!r} has no scale {scale_name!r}; the checkpoint is "
                             f"incomplete or not in the {layout!r} layout config.json names")
        q, scale = tensors[weight], np.asarray(tensors[scale_name])
        if q.ndim != 2:
            raise ValueError(f"{source}: FP8 tensor {weight!r} has shape {q.shape}; expected a 2-D [out, in] weight")
        scale = scale.reshape(-1) if scale.ndim == 2 and scale.shape[1] == 1 and q.shape[0] > 1 else scale
        out[weight] = fp8_weight(np.ascontiguousarray(q.T), scale.T if scale.ndim == 2 else scale, name=scale_name)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Writing (scripts/convert.py --quantization=fp8).

#: The quantization_config a written folder carries: llm-compressor's FP8_DYNAMIC scheme (per-channel e4m3 weights,
#: activations quantized per token at run time, the LM head left as it is).
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                              "symmetric": True, "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "symmetric": True, "dynamic": True}}},
    "ignore": ["lm_head"]}


def fp8_hf_tensors(weights: dict[str, Any], fp8_linears: set[str], linears: set[str], hf_name
                   ) -> dict[str, np.ndarray]:
    """Canonical weights -> the HF tensors of a compressed-tensors FP8 folder: each layer projection whose last name
    part is in `fp8_linears` as e4m3 codes [out, in] + `weight_scale` [out, 1] (float32), every other tensor under
    its HF name (`hf_name(canonical)`), those in `linears` transposed to [out, in]. FP8 weights keep their codes."""
    from models.quantization.formats import quantize_fp8

    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        hf = hf_name(name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in fp8_linears and leaf != "lm_head" and ".experts." not in name:
            qw = w if isinstance(w, QuantizedWeight) else quantize_fp8(np.asarray(w, np.float32))
            if qw.group_size != qw.shape[0] or not qw.is_fp8:
                raise ValueError(f"{name}: only per-channel FP8 weights are written (got group {qw.group_size})")
            out[hf] = np.ascontiguousarray(np.asarray(qw.q).T)
            out[hf[:-len(".weight")] + ".weight_scale"] = np.ascontiguousarray(np.asarray(qw.scale).T)
        elif isinstance(w, QuantizedWeight):
            raise ValueError(f"{name}: a quantized tensor the FP8 layout has no place for")
        else:
            out[hf] = np.ascontiguousarray(np.asarray(w).T if leaf in linears else np.asarray(w))
    return out
