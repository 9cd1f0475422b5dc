"""Tools around the runtime that the runtime never imports: the analytic cost model, perplexity evaluation and JSONL
batch I/O for the launcher."""
