"""The host-side engine: requests become sequences, the scheduler picks each step's work under a token and page
budget, the engine runs it through the runtime and turns sampled tokens into outputs (stops, metrics). Data
parallelism runs several engines behind the same interface."""
