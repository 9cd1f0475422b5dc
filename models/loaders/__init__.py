"""Reading weights into the canonical layout of `models.weights`: GGUF files, Hugging Face safetensors folders, Orbax
checkpoints. No pickle anywhere."""
