"""The paged KV cache's bookkeeping on the host: page allocation with prefix caching and copy-on-write (block
manager), and the per-sequence page tables of each cache group (KV cache manager)."""
