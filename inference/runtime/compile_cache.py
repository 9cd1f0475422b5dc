"""JAX's persistent compilation cache, so a second run (or a second test process) skips XLA compiles.

On CPU a 30-layer step takes seconds to compile and a quarter of a second to load from the cache.

The cache is process-wide JAX configuration (`jax.config`), so the library only touches it as `LLM` documents:
`apply_cache_setting` is the one place that maps `LLM(compilation_cache_dir=...)` onto it.
"""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pagejax", "xla")

#: The jax.config options `enable_compilation_cache` sets (and so the ones a caller may want left alone).
CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes")


def enable_compilation_cache(path: str | None = None) -> str:
    """Point JAX's persistent cache at `path` (default: $PAGEJAX_CACHE_DIR or ~/.cache/pagejax/xla); cache every
    entry however small or quick to compile. Returns the directory used."""
    path = path or os.environ.get("PAGEJAX_CACHE_DIR") or DEFAULT_DIR
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def configured_cache_dir() -> str | None:
    """The persistent cache directory JAX uses now (set by the user, JAX_COMPILATION_CACHE_DIR or us), or None."""
    return jax.config.jax_compilation_cache_dir or None


def apply_cache_setting(setting: str | None) -> str | None:
    """What `LLM(compilation_cache_dir=setting)` does to JAX's cache; returns the directory in use (None: none).

    None: nothing (jax.config untouched). A path: the cache goes there (an explicit request, so it overrides an
    existing setting). "default": like vLLM's default on-disk compile cache, a warm second start, but only where
    nothing has configured a cache yet, so an application's (or a test suite's) own cache setting is never replaced.
    """
    if setting is None:
        return None
    if setting == "default":
        return configured_cache_dir() or enable_compilation_cache(None)
    return enable_compilation_cache(setting)
