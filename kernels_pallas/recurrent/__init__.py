"""Constant-state layers' ops over a ragged batch (Gated DeltaNet, Mamba2): the state cache's layout, the causal
conv1d and the recurrences, each pure JAX with the signature a Pallas kernel would have."""
