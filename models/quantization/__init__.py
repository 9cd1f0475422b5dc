"""Quantization, below the models: the quantized weight format and its matmuls (`formats`), GGUF's quantized blocks
(`gguf_blocks`), the quantization modes applied to a model's weights (`modes`) and the AWQ recipe (`awq`). Imports
no model code; the models import it."""
