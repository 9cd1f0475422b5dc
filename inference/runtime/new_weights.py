"""Checks on the weights a trainer hands to `ModelRunner.update_weights`, each failing with the parameter and the fix
named: a tree other than the model's (a plain dict, a missing or an extra parameter), a leaf of another shape or dtype,
NaN or inf. A wrong tree or shape would not match the compiled steps; NaN weights would make the model sample token
0 and stop, silently."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_FIX = "pass `llm.get_params()`'s nnx.State with new arrays for its leaves"


def checked_leaves(params: Any, treedef: Any, avals: list[jax.ShapeDtypeStruct]) -> list:
    """The leaves of `params` in the model's order, once its tree, shapes and dtypes are the model's (`treedef`,
    `avals`); a ValueError naming the difference otherwise."""
    paths_leaves, got = jax.tree_util.tree_flatten_with_path(params)
    if got != treedef:
        raise ValueError(f"update_weights: {_structure_difference(params, paths_leaves, leaf_paths(treedef, avals))}")
    for (path, new), old in zip(paths_leaves, avals):
        shape, dtype = getattr(new, "shape", None), getattr(new, "dtype", None)
        if shape != old.shape or dtype != old.dtype:
            raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} must be {old.shape} {old.dtype}, got "
                             f"{shape} {dtype}; shapes and dtypes must match")
    return [leaf for _, leaf in paths_leaves]


def check_finite(leaves: list[jax.Array], treedef: Any, avals: list[jax.ShapeDtypeStruct]) -> None:
    """A ValueError naming the first of `leaves` (placed on the runner's devices, in the order of the model's tree)
    that holds NaN or inf. The paths are only worked out for that message: a weight sync that passes reads one
    bool per leaf."""
    finite = np.asarray(_all_finite(leaves).addressable_data(0))  # replicated: a local copy in every process
    if not finite.all():
        path = leaf_paths(treedef, avals)[int(np.flatnonzero(~finite)[0])]
        raise ValueError(f"update_weights: {path} holds NaN or inf; the weights were not swapped (check the trainer; "
                         "check_finite=False skips this check)")


def leaf_paths(treedef: Any, avals: list[jax.ShapeDtypeStruct]) -> list[str]:
    """Each leaf's path in the model's tree, as `jax.tree_util.keystr` writes it."""
    return [jax.tree_util.keystr(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, avals))[0]]


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    """bool[len(leaves)]: each leaf free of NaN and inf (integer leaves, e.g. quantized codes, always are)."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
                      for x in leaves])


def _structure_difference(params: Any, paths_leaves: list, want: list[str]) -> str:
    """What separates `params` from the model's tree: the parameters missing or not the model's (a few of each, by
    path), or else the same leaves in other containers (a plain dict, say)."""
    got = [jax.tree_util.keystr(path) for path, _ in paths_leaves]
    if got == [k.removesuffix(".value") for k in want]:
        return ("the new parameters are a plain dict of the model's arrays (nnx.State.to_pure_dict's form), not "
                "its nnx.State; fill one with `params = llm.get_params(); nnx.replace_by_pure_dict(params, "
                "new)` and pass that")
    got_set, want_set = set(got), set(want)
    missing, extra = [k for k in want if k not in got_set], [k for k in got if k not in want_set]
    if not missing and not extra:
        return (f"the new parameters hold the model's leaves in other containers (a {type(params).__name__}, not "
                f"the model's nnx.State); {_FIX}")

    def few(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")

    parts = ([f"{len(missing)} of the model's parameters are missing ({few(missing)})"] if missing else []) + \
        ([f"{len(extra)} are not the model's ({few(extra)})"] if extra else [])
    return f"the new parameters do not have the model's structure: {'; '.join(parts)}; {_FIX}"


__all__ = ["check_finite", "checked_leaves", "leaf_paths"]
