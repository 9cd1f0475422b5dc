"""How users drive the engine: the `LLM` class (offline batch generation, vLLM-shaped) and streaming."""
