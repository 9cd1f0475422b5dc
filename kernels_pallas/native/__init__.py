"""The C++ CPU kernels (`csrc/`): built on first use and registered as XLA FFI targets."""
