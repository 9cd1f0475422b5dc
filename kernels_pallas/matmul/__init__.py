"""Quantized matmuls as C++ CPU kernels: int8 weights x float activations, and grouped int4/int8 weights."""
