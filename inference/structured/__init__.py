"""Structured outputs: constrained decoding with a grammar engine (llguidance).

`params` holds `StructuredOutputsParams` (what a request asks for, validated at construction, importable without
a tokenizer); `tokenizer` bridges pagejax's tokenizer to llguidance's; `manager` keeps one matcher per sequence on
the host and fills the per-step token bitmask the jitted sampler applies (inference/sampling/token_mask.py).
This `__init__` imports nothing, so `inference.sampling.params` can import `params` from the bottom of the stack.
"""
