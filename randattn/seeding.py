"""Seeds of the eviction draws: one well-mixed 63-bit seed per (seed, layer, round), so neighbours don't correlate;
with a row key, per (seed, row key, layer, round), so a row's draw does not depend on the batch it sits in."""

from __future__ import annotations

import numpy as np

__all__ = ["round_seed", "row_round_seed", "check_row_key", "batch_seed"]

import hashlib

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _check_seed(seed, name: str = "seed") -> int:
    """``seed`` as an int, refusing what would be truncated (``1.7``), a bool, or one outside the 64 bits that are
    mixed (``-1`` would draw exactly what ``2**64 - 1`` draws)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {seed!r} ({type(seed).__name__}); "
                         f"pass a whole number, e.g. {name}=0 (a float is not rounded or truncated)")
    if not 0 <= int(seed) <= _MASK64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {seed!r}: seeds are mixed as 64 bits, so it "
                         f"would draw what {int(seed) & _MASK64} draws; pass a seed in range")
    return int(seed)


def round_seed(seed: int, layer_idx: int, round_idx: int) -> int:
    """Seed of the generator for one (seed, layer, round): well mixed, so neighbours don't correlate.
    ``seed`` must be an integer in ``[0, 2**64)``, ``layer_idx`` and ``round_idx`` non-negative integers."""
    seed = _check_seed(seed)
    for name, val in (("layer_idx", layer_idx), ("round_idx", round_idx)):
        if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)) or not 0 <= val <= _MASK64:
            raise ValueError(f"round_seed: {name} must be a non-negative integer, got {val!r}")
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (layer_idx & _MASK64))
    x = _splitmix64(x ^ (round_idx & _MASK64))
    return x & ((1 << 63) - 1)


def check_row_key(key, name: str = "row key") -> int:
    """A row key as the 64-bit integer that is mixed: a non-negative int below ``2**64`` as it is, a string (a
    request id) by its BLAKE2b digest. Anything else is refused."""
    if isinstance(key, str):
        return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)) or not 0 <= int(key) <= _MASK64:
        raise ValueError(f"{name} must be a string (a request id) or an integer in [0, 2**64), got {key!r} "
                         f"({type(key).__name__})")
    return int(key)


def row_round_seed(seed: int, row_key: int, layer_idx: int, round_idx: int) -> int:
    """Seed of one row's draw at one (layer, round): a function of (seed, row key, layer, round) only, never of the
    row's place in a batch. A distinct stream from :func:`round_seed` (the row key is mixed in first)."""
    key = check_row_key(row_key)
    x = _splitmix64(_splitmix64(_check_seed(seed) ^ 0x5EED_0F_80E5) ^ key)
    return round_seed(x, layer_idx, round_idx)


#: The stride between the base seeds of consecutive batches (or items) of one run: a prime, so the per-(layer, round)
#: streams of neighbouring batches, mixed by :func:`round_seed`, never share a base.
BATCH_STRIDE = 1_000_003


def batch_seed(seed: int, index: int) -> int:
    """The base seed of a run's batch (or item) ``index`` under the run seed ``seed``: every probe derives its
    per-batch eviction and sampling seeds from it, so batch ``i`` draws the same wherever the run is resumed."""
    return int(seed) * BATCH_STRIDE + int(index)
