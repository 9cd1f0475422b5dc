"""The device side of a step: the batch arrays a step reads, the jitted step functions (the model runner) and JAX's
persistent compilation cache. Knows nothing of requests or scheduling."""
