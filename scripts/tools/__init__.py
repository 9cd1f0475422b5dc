"""Developer tools: deviceless compiles, the compile budget, step profiles, the cost model, draft distillation."""
