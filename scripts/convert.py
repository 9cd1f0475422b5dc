"""Convert a GGUF file or a Hugging Face folder (or a preset) into an orbax checkpoint folder `LLM` loads.

    python scripts/convert.py --model=smollm2-135m --output=/ckpt/smollm2          # the shipped GGUF
    python scripts/convert.py --model=path/to/hf_folder --output=/ckpt/model --dtype=bfloat16
    python -c "from inference import LLM; LLM('/ckpt/smollm2', tensor_parallel_size=4)"
    python scripts/convert.py --model=path/to/bf16_hf_folder --output=/ckpt/model-fp8 --quantization=fp8

The folder holds the canonical (unpadded) weights, the model config and the tokenizer
(models/loaders/orbax_checkpoint.py), so one conversion serves every tensor-parallel size, and a restore reads each
device's slice straight into place. GGUF quantized blocks are dequantized (the checkpoint holds plain float arrays).

`--quantization=fp8` writes a Hugging Face folder instead, in the compressed-tensors `float-quantized` layout
(per-channel float8_e4m3fn layer projections + `weight_scale`, config.json's quantization_config; what
llm-compressor's FP8_DYNAMIC writes and vLLM loads), from a Hugging Face folder (bf16 or float32): `LLM` loads it
without a float copy (models/loaders/fp8_checkpoint.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Preset name, .gguf file or Hugging Face model folder.")
_OUTPUT = flags.DEFINE_string("output", None, "New folder for the orbax checkpoint.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                           "Dtype the weights are stored in (the model computes in LLM(dtype=...)).")
_QUANT = flags.DEFINE_enum("quantization", None, ["fp8"], "Write an FP8 Hugging Face folder (see above).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights of presets that ship none.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    start = time.perf_counter()
    if _QUANT.value == "fp8":
        from models.loaders.hf_checkpoint import save_fp8_folder
        try:
            size = save_fp8_folder(_MODEL.value, _OUTPUT.value)
        except (ValueError, OSError) as e:
            sys.exit(f"error: {e} (--quantization=fp8 converts a Hugging Face folder)")
        print(f"wrote {_OUTPUT.value}: FP8 (compressed-tensors), {size / 2**20:.1f} MiB of tensors; "
              f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
        return
    import jax.numpy as jnp

    from inference.loading.model_loader import load_model
    from models.decoder import build_decoder
    from models.loaders.orbax_checkpoint import save_checkpoint
    from sharding.partition import export_weights

    try:
        loaded = load_model(_MODEL.value)
        if loaded.checkpoint is not None:
            raise ValueError(f"{_MODEL.value} is already an orbax checkpoint")
        weights = loaded.weights
        if weights is None:  # a preset without shipped weights: its random initialisation, as LLM builds it
            weights = export_weights(build_decoder(loaded.config, seed=_SEED.value))
        dtype = np.dtype(jnp.dtype(_DTYPE.value))
        weights = {name: np.asarray(w).astype(dtype) for name, w in weights.items()}
        save_checkpoint(_OUTPUT.value, loaded.config, weights, loaded.tokenizer)
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    size = sum(w.nbytes for w in weights.values())
    print(f"wrote {_OUTPUT.value}: {len(weights)} arrays, {size / 2**20:.1f} MiB ({_DTYPE.value}), tokenizer "
          f"{'yes' if loaded.tokenizer is not None else 'no'}; {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
