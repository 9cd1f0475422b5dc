"""Sampling: the request parameters (vLLM's `SamplingParams`), the jitted sampler with its filters and logprobs, and
the rejection sampler that verifies speculative drafts."""
