"""Command-line programs, the top layer, imported by no package (only tests). The launchers users run sit here
(generate, serve, convert, grpo_example, and engine_flags, the engine flags they share); `bench/`, `fixtures/` and
`tools/` hold the benchmarks, the test-fixture writers and the developer tools."""
