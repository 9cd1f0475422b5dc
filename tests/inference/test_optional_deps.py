"""The engine runs with only the core stack: gguf, llguidance, grain and safetensors are imported where their feature
runs.

A bare accelerator image (jax, flax, numpy, tokenizers) must be able to `import inference`, build a model and
generate; a feature whose library is missing must say which package to install. The child process makes the four
libraries unimportable (`sys.modules[name] = None` makes `import name` raise ImportError) before importing anything of
pagejax, so nothing can have imported them earlier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONAL = ("gguf", "llguidance", "llguidance.numpy", "grain", "safetensors", "safetensors.numpy")
FAMILY = os.path.join(ROOT, "tests", "fixtures", "families", "qwen2")  # a Hugging Face folder: safetensors weights

CHILD = textwrap.dedent(f"""
    import json, sys
    sys.modules.update(dict.fromkeys({OPTIONAL!r}, None))
    from inference import LLM, SamplingParams
    from inference.structured.params import StructuredOutputsParams

    llm = LLM("tiny-llama", max_num_seqs=2, max_model_len=64)
    out = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]],
                       sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    errors = {{}}
    try:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    except ImportError as exc:
        errors["structured"] = str(exc)
    try:
        LLM("smollm2-135m")
    except ImportError as exc:
        errors["gguf"] = str(exc)
    try:
        from models.loaders.hf_checkpoint import load_hf_folder
        load_hf_folder({FAMILY!r})
    except ImportError as exc:
        errors["hf"] = str(exc)
    try:
        from models.quantization.awq import calibration_dataset
        calibration_dataset(list(range(64)), 8, 2)
    except ImportError as exc:
        errors["awq"] = str(exc)
    loaded = sorted(name for name in {OPTIONAL!r} if sys.modules.get(name) is not None)
    print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in out], "errors": errors, "loaded": loaded}}))
""")


def test_engine_runs_without_the_optional_libraries():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [len(t) for t in result["tokens"]] == [4, 4]
    assert result["loaded"] == []
    # Each feature that needs a missing library names the package and how to install it.
    for feature, package in (("structured", "llguidance"), ("gguf", "gguf"), ("awq", "grain"), ("hf", "safetensors")):
        message = result["errors"].get(feature, "")
        assert f"`{package}`" in message and f"pip install {package}" in message, (feature, message)
