"""Ragged paged attention: the pure-JAX reference (the contract), the C++ CPU kernel, the Pallas TPU and GPU kernels
and the dispatcher that picks one per backend."""
