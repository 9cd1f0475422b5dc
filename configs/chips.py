"""Accelerator presets for the cost model: peak dense BF16 FLOP/s, HBM bandwidth and nominal HBM capacity.

These are vendor peak figures (dense, no sparsity), the numbers a roofline estimate divides; real kernels reach a
fraction of them. Capacities are the nominal sizes chips are sold with, in decimal bytes, and serve only as a
reference line ("does this batch fit?"), not as usable memory after runtime reservations.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One accelerator as the bandwidth/compute roofline sees it."""

    name: str
    flops_per_s: float
    bandwidth_bytes_per_s: float
    hbm_bytes: float | None = None

    def __post_init__(self) -> None:
        if not self.flops_per_s > 0:
            raise ValueError(f"chip {self.name!r}: flops_per_s must be positive, got {self.flops_per_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"chip {self.name!r}: bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s}")
        if self.hbm_bytes is not None and not self.hbm_bytes > 0:
            raise ValueError(f"chip {self.name!r}: hbm_bytes must be positive or None, got {self.hbm_bytes}")

    @property
    def crossover_intensity(self) -> float:
        """FLOPs per byte at which the roofline turns from memory-bound to compute-bound (peak / bandwidth)."""
        return self.flops_per_s / self.bandwidth_bytes_per_s


CHIP_PRESETS: dict[str, ChipSpec] = {
    # NVIDIA SXM parts; 989 TFLOP/s is dense BF16 (the lecture's H100 example: 989e12 / 3.35e12 ≈ 295 FLOP/byte).
    "h100": ChipSpec(name="h100", flops_per_s=989e12, bandwidth_bytes_per_s=3.35e12, hbm_bytes=80e9),
    "h200": ChipSpec(name="h200", flops_per_s=989e12, bandwidth_bytes_per_s=4.8e12, hbm_bytes=141e9),
    # Google TPUs, per chip.
    "v5e": ChipSpec(name="v5e", flops_per_s=197e12, bandwidth_bytes_per_s=819e9, hbm_bytes=16e9),
    "v6e": ChipSpec(name="v6e", flops_per_s=918e12, bandwidth_bytes_per_s=1.64e12, hbm_bytes=32e9),
}

_ALIASES: dict[str, str] = {"tpu-v5e": "v5e", "tpu_v5e": "v5e", "tpu-v6e": "v6e", "tpu_v6e": "v6e"}


def get_chip(name: str) -> ChipSpec:
    """Look up a chip preset by name (case-insensitive; `tpu-v5e` style aliases accepted)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    try:
        return CHIP_PRESETS[key]
    except KeyError:
        raise ValueError(
            f"unknown chip {name!r}; known chips: {', '.join(sorted(CHIP_PRESETS))}. "
            "Or pass explicit --flops and --bandwidth.") from None
