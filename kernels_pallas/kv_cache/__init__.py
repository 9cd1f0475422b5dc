"""The paged KV cache's device layout (`layout`) and the writes into it (`writes`: K/V rows, MLA latent rows, page
copies, int8 quantize-on-write)."""
