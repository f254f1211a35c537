"""Seeds of the eviction draws: one well-mixed 63-bit seed per (seed, layer, round), so neighbours don't correlate."""

from __future__ import annotations

__all__ = ["round_seed"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def round_seed(seed: int, layer_idx: int, round_idx: int) -> int:
    """Seed of the generator for one (seed, layer, round): well mixed, so neighbours don't correlate."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (layer_idx & _MASK64))
    x = _splitmix64(x ^ (round_idx & _MASK64))
    return x & ((1 << 63) - 1)
