"""Turning a model name into weights, a config and a tokenizer: presets, GGUF files, Hugging Face folders and Orbax
checkpoints (through `models.loaders`), the tokenizer, and the texts shipped with the package."""
