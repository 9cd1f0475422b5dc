"""Libraries that only some features need, imported when the feature runs.

The engine with a preset needs only jax, flax, numpy and tokenizers: a machine that has just the core stack (a bare
accelerator image) can run it. GGUF files need `gguf`, structured outputs `llguidance`, AWQ calibration `grain`, a
Hugging Face folder's weights `safetensors`; each stays a dependency of the package, and a feature whose library is missing says which
package to install instead of failing at `import inference`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str, package: str | None = None) -> ModuleType:
    """`import module`, or an ImportError that names the feature, the missing package and the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = package or module.split(".")[0]
        raise ImportError(f"{feature} needs the `{package}` package, which is not importable here ({exc}); "
                          f"install it with `pip install {package}` (it is a dependency of pagejax: "
                          "`pip install -e .` brings it)") from exc
