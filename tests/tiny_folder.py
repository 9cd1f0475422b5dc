"""A tiny model folder with a tokenizer, for tests that need text in and text out without the real SmolLM2.

The Mistral family fixture (sliding window 8, 4 query / 2 KV heads, vocab 256, random weights) plus a byte-level
tokenizer whose whole vocabulary is the 256 byte symbols (no merges), so any text encodes to ids the model accepts,
and a one-line chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "families" / "mistral"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def make_tiny_hf_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, folder / name)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": alphabet[2],
                                                              "chat_template": CHAT_TEMPLATE}))
    return folder
