"""The texts shipped with the package (`inference/data/`): the perplexity text and AWQ's calibration text, and the
calibration token ids that the loader hands to `quantize_decoder` for quantization="int4-awq".

They live with loading, not with the evaluation tool or the AWQ recipe, because the runtime (the LLM's load path)
needs the calibration ids and must not import the tools, and the recipe sits below the models and takes ids only."""

from __future__ import annotations

from importlib import resources

import numpy as np

#: The shipped evaluation text (self-written, ~3.2k SmolLM2 tokens) and the separate calibration text used by AWQ.
EVAL_TEXT = "eval_text.txt"
CALIBRATION_TEXT = "calibration_text.txt"


def shipped_text(name: str = EVAL_TEXT) -> str:
    """A text file shipped in `inference/data/` (packaged as package data)."""
    path = resources.files("inference").joinpath("data", name)
    if not path.is_file():
        raise ValueError(f"inference/data/{name} is missing; known texts: {EVAL_TEXT}, {CALIBRATION_TEXT}")
    return path.read_text(encoding="utf-8")


def calibration_token_ids(tokenizer, vocab_size: int, num_tokens: int, seed: int = 0) -> np.ndarray:
    """`num_tokens` ids of the shipped calibration text (inference/data/calibration_text.txt, a different text from
    the perplexity text), or seeded uniform random ids for a model without a tokenizer (random test models, whose
    activations have no text statistics to learn anyway)."""
    if tokenizer is None:
        return np.random.default_rng(seed).integers(0, vocab_size, num_tokens, dtype=np.int32)
    ids = np.asarray(tokenizer.encode(shipped_text(CALIBRATION_TEXT)), np.int32)
    if len(ids) < num_tokens:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than num_tokens={num_tokens}")
    return ids[:num_tokens]
