"""Command-line launchers (absl flags) and fixture writers: the top layer, imported by no package (only tests)."""
