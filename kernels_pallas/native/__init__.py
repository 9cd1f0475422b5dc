"""The C++ CPU kernels (`csrc/`): built on first use and registered as XLA FFI targets (`build`), and the one switch
that says whether a call site takes one (`gate`: the target backend, PAGEJAX_CPU_KERNELS, a failed build)."""
