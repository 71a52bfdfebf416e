"""Cache: the device K/V tensors of the paged cache.

Unquantized (kv_format None or the model's dtype): k, v [L, P, S, Hkv, D] in the model's dtype. Quantized
(folio.kv_formats: "fp8", "q8", "q4", "q4h"): k, v [L, P, S, Hkv, Dq] uint8 codes and k_scale, v_scale
[L, P, S, Hkv, D // G] float16 scales. Which page holds what is the page pool's business (folio.cache); this module
only owns the memory.

Under tensor parallelism each rank's Cache holds its kv heads of every page (Hkv is the rank's share: the model's
config is its shard's), and rank 0's cache has a `mirror` that tells the other ranks of everything written into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from folio import kv_formats

if TYPE_CHECKING:
    from folio.host_pages import HostPages
    from folio.model.batch import ForwardBatch
    from folio.model.model import Model

MIN_PAGE_SIZE = 16


class CacheMirror(Protocol):
    """The other ranks of a tensor-parallel replica, as rank 0's cache sees them (folio.tp_worker.Driver): told of
    each operation that writes the cache's tensors before rank 0 runs it, they run it on their shards, so that every
    rank holds the same pages under the same ids."""

    def forward(self, batch: ForwardBatch) -> None:
        """A forward over this cache (Model.forward: its K/V writes, and its collectives)."""

    def copy_page_slots(self, src_page: int, dst_page: int, num_slots: int) -> None:
        """Cache.copy_page_slots."""

    def build_host_pages(self, cache: Cache, host_cache_bytes: int | None) -> HostPages | None:
        """The host tier's buffers for this cache (folio.host_pages.build_host_pages), their copies mirrored."""


def page_bytes(model: Model, page_size: int, kv_format: str | None = None) -> int:
    """Bytes of one page of `model`'s cache in `kv_format`: K and V (codes and scales), every layer."""
    cfg = model.config
    fmt = kv_formats.resolve(kv_format, model.dtype, cfg.head_dim)
    per_head_token = kv_formats.bytes_per_head_token(fmt, cfg.head_dim, model.dtype)
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * per_head_token


class Cache:
    def __init__(
        self,
        model: Model,
        num_tokens: int | None = None,
        page_size: int = 256,
        max_memory_fraction: float | None = None,
        reserve_bytes: int = 0,
        kv_format: str | None = None,
    ) -> None:
        """Size the cache by num_tokens (a multiple of page_size), or on CUDA by max_memory_fraction of the
        currently free device memory (pages of page_bytes(model, page_size, kv_format) each).

        kv_format: None (the model's dtype), the model's dtype by name ("bf16", "fp16", "fp32"), or a quantized
        format of folio.kv_formats ("fp8", "q8", "q4", "q4h"); a format that does not fit the model (another
        dtype; head_dim not divisible by its group size) is a ValueError.

        reserve_bytes (CUDA only): memory the forward passes will need beside the cache, their activations (see
        folio.activation_reserve_bytes). With max_memory_fraction it is set aside before the fraction
        is taken; with num_tokens, a cache that leaves less than it free is refused here, with the numbers,
        instead of running out of memory at the first large step."""
        _check_page_size(page_size)
        cfg = model.config
        self.ops = model.ops  # the model's op set (backend, launch options): copy_page_slots runs through it
        self.mirror: CacheMirror | None = None  # tensor parallelism: rank 0's link to the other ranks' shards
        self.page_size = page_size
        # the quantized format's name, or None: K/V in the model's dtype
        self.kv_format = kv_formats.resolve(kv_format, model.dtype, cfg.head_dim)
        if self.kv_format == "q4h" and model.device.type == "cuda" and model.ops.backend != "reference":
            raise ValueError("kv_format='q4h' has no CUDA kernel (the reference ops run it: "
                             "EngineOptions(ops_backend='reference')); use 'q4'")
        self.page_shape = (page_size, cfg.num_kv_heads, cfg.head_dim)  # per layer, in K/V elements
        self.bytes_per_page = page_bytes(model, page_size, self.kv_format)
        self.num_pages = self._resolve_num_pages(model.device, num_tokens, max_memory_fraction, reserve_bytes)
        shape = (cfg.num_layers, self.num_pages, page_size, cfg.num_kv_heads)
        # zeros, not empty: deterministic contents for slots no sequence has written yet
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.kv_format is None:
            self.k = torch.zeros((*shape, cfg.head_dim), dtype=model.dtype, device=model.device)
            self.v = torch.zeros_like(self.k)
        else:
            code_dim = kv_formats.code_dim(self.kv_format, cfg.head_dim)
            scale_dim = kv_formats.scale_dim(self.kv_format, cfg.head_dim)
            self.k = torch.zeros((*shape, code_dim), dtype=kv_formats.CODE_DTYPE, device=model.device)
            self.v = torch.zeros_like(self.k)
            self.k_scale = torch.zeros((*shape, scale_dim), dtype=kv_formats.SCALE_DTYPE, device=model.device)
            self.v_scale = torch.zeros_like(self.k_scale)

    @property
    def kv_format_code(self) -> int:
        """The `*_quant` ops' kv_format argument (folio.kv_formats.KV_FORMAT_CODES); 0 for an unquantized cache."""
        return 0 if self.kv_format is None else kv_formats.KV_FORMAT_CODES[self.kv_format]

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds per-page data, each [L, P, ...]: k, v, and k_scale, v_scale when quantized.
        Copying page p of each copies the page."""
        tensors = [self.k, self.v]
        if self.k_scale is not None:
            tensors += [self.k_scale, self.v_scale]
        return tensors

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def copy_page_slots(self, src_page: int, dst_page: int, num_slots: int) -> None:
        """Copy slots [0, num_slots) of page src_page into dst_page, in every layer (partial-page reuse)."""
        for page in (src_page, dst_page):
            if not 0 <= page < self.num_pages:
                raise IndexError(f"page {page} outside [0, num_pages={self.num_pages})")
        if not 0 <= num_slots <= self.page_size:
            raise ValueError(f"num_slots={num_slots} outside [0, page_size={self.page_size}]")
        if self.mirror is not None:
            self.mirror.copy_page_slots(src_page, dst_page, num_slots)
        self.ops.copy_page_slots(self.k, self.v, src_page, dst_page, num_slots)
        if self.k_scale is not None:
            self.ops.copy_page_slots(self.k_scale, self.v_scale, src_page, dst_page, num_slots)

    def _resolve_num_pages(
        self, device: torch.device, num_tokens: int | None, max_memory_fraction: float | None, reserve_bytes: int
    ) -> int:
        if num_tokens is not None and max_memory_fraction is not None:
            raise ValueError("give either num_tokens or max_memory_fraction, not both")
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be an int >= 0, got {reserve_bytes!r}")
        if reserve_bytes and device.type != "cuda":
            raise ValueError(f"reserve_bytes needs a CUDA device (model is on {device}): it is checked against "
                             f"the device's free memory")
        if num_tokens is not None:
            if num_tokens <= 0 or num_tokens % self.page_size:
                raise ValueError(f"num_tokens={num_tokens} must be a positive multiple of page_size={self.page_size}")
            num_pages = num_tokens // self.page_size
            if reserve_bytes:
                free_bytes, _ = torch.cuda.mem_get_info(device)
                if num_pages * self.bytes_per_page + reserve_bytes > free_bytes:
                    raise ValueError(
                        f"a cache of {num_tokens} tokens ({num_pages * self.bytes_per_page / 2**30:.2f} GiB) and "
                        f"the {reserve_bytes / 2**30:.2f} GiB reserved for activations do not fit in the "
                        f"{free_bytes / 2**30:.2f} GiB free on {device}: give fewer tokens or a smaller chunk size"
                    )
            return num_pages
        if max_memory_fraction is None:
            raise ValueError("the cache size is unknown: give num_tokens (or max_memory_fraction on CUDA)")
        if device.type != "cuda":
            raise ValueError(f"max_memory_fraction needs a CUDA device (model is on {device}); give num_tokens")
        if not 0.0 < max_memory_fraction <= 1.0:
            raise ValueError(f"max_memory_fraction={max_memory_fraction} must be in (0, 1]")
        free_bytes, _ = torch.cuda.mem_get_info(device)
        num_pages = int(max(0, free_bytes - reserve_bytes) * max_memory_fraction) // self.bytes_per_page
        if num_pages < 1:
            raise ValueError(
                f"{max_memory_fraction} of the {free_bytes} free bytes on {device}, less {reserve_bytes} reserved "
                f"for activations, holds no page of {self.bytes_per_page} bytes"
            )
        return num_pages


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {page_size!r}")
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two >= {MIN_PAGE_SIZE}")
