"""Counter-based uniform draws: the n-th draw of a job is a pure function of (seed, n).

So a job samples the same tokens whether it runs alone or batched, on the CPU or a GPU, and the draws for a whole
batch can be made on the device without a host round trip.

The generator hashes (seed, counter) with a 32-bit integer mixer (multiply / xor-shift, the "lowbias32" constants
found by Chris Wellons' hash prospector) chained over the four 32-bit halves of seed and counter, twice with
different starting constants, and takes 53 bits of the two results. The tensor version never lets an int64 overflow
(32-bit products are split into 16-bit halves), so it gives bit-identical values on every device; the scalar version
does the same arithmetic on Python ints.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
# Starting values of the two hash chains (arbitrary odd constants: fractional digits of sqrt(2) and sqrt(3)).
_CHAIN_HIGH = 0x6A09E667
_CHAIN_LOW = 0xBB67AE85
_INV_2_53 = 1.0 / (1 << 53)


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * _MUL_A) & _MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & _MASK32
    x ^= x >> 16
    return x


def _chain(start: int, words: tuple[int, int, int, int]) -> int:
    h = start
    for word in words:
        h = _mix32(h ^ word)
    return h


def uniform(seed: int, counter: int) -> float:
    """Draw number `counter` (>= 0) of the stream `seed` (any int; taken modulo 2**64), in [0, 1) with 53 bits."""
    if not isinstance(counter, int) or counter < 0 or counter >= 1 << 63:
        raise ValueError(f"uniform(): counter must be an int in [0, 2**63), got {counter!r}")
    seed &= _MASK64
    words = (seed & _MASK32, seed >> 32, counter & _MASK32, counter >> 32)
    high = _chain(_CHAIN_HIGH, words) >> 5  # 27 bits
    low = _chain(_CHAIN_LOW, words) >> 6  # 26 bits
    return ((high << 26) | low) * _INV_2_53


def _mul32_t(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for int64 tensors holding values < 2**32, without int64 overflow."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32_t(x, _MUL_A)
    x = x ^ (x >> 15)
    x = _mul32_t(x, _MUL_B)
    return x ^ (x >> 16)


def _chain_t(start: int, words: tuple[torch.Tensor, ...]) -> torch.Tensor:
    h = words[0] ^ start
    h = _mix32_t(h)
    for word in words[1:]:
        h = _mix32_t(h ^ word)
    return h


def uniform_tensor(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Vectorized `uniform`: int64 tensors (broadcast together; a seed is its 64-bit two's complement pattern, so
    int64 seeds match Python seeds modulo 2**64; counters must be >= 0). Returns float64, same device, no sync."""
    if seeds.dtype != torch.int64 or counters.dtype != torch.int64:
        raise TypeError(f"uniform_tensor(): seeds and counters must be int64, got {seeds.dtype} and {counters.dtype}")
    # & after >> undoes the sign extension of the arithmetic shift, giving the upper 32 bits as unsigned.
    words = (seeds & _MASK32, (seeds >> 32) & _MASK32, counters & _MASK32, (counters >> 32) & _MASK32)
    words = torch.broadcast_tensors(*words)
    high = _chain_t(_CHAIN_HIGH, words) >> 5
    low = _chain_t(_CHAIN_LOW, words) >> 6
    return ((high << 26) | low).to(torch.float64) * _INV_2_53


def _mix32_np(x):
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: list[int], counters: list[int]) -> list[float]:
    """`uniform` for many (seed, counter) pairs at once, bit-identical, on the host (numpy uint64: the 32-bit
    products fit, so the arithmetic is the scalar version's). About 20x faster than a loop at a batch of 256."""
    import numpy as np

    if any(not isinstance(c, int) or c < 0 or c >= 1 << 63 for c in counters):
        raise ValueError("uniforms(): counters must be ints in [0, 2**63)")
    seed = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    counter = np.array(counters, dtype=np.uint64)
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    # both chains at once, as the rows of one [2, B] array (half the numpy calls of one chain after the other)
    h = np.empty((2, seed.shape[0]), dtype=np.uint64)
    h[0], h[1] = _CHAIN_HIGH, _CHAIN_LOW
    for word in (seed & mask, seed >> shift, counter & mask, counter >> shift):
        h = _mix32_np(h ^ word)
    high, low = h[0] >> np.uint64(5), h[1] >> np.uint64(6)
    return (((high << np.uint64(26)) | low).astype(np.float64) * _INV_2_53).tolist()
