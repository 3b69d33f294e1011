"""The fast forward path's KV cache: preallocated keys and values, cropped by moving a length (paper 3.4).

A pass writes its entries in place; dropping the mask entries of a pass (or a rejected draft's) only
moves ``length`` back. transformers' ``DynamicCache`` concatenates, i.e. copies the whole cache in
every layer of every pass; this one grows by doubling and never copies otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

INITIAL_CAPACITY = 256  # cache positions allocated by a new KVCache; doubles when a pass needs more


class _LayerView:
    """``keys`` / ``values`` of one layer, ``[1, kv_heads, length, head_dim]`` views (as transformers'
    ``DynamicCache.layers[i]``)."""

    __slots__ = ("_cache", "_i")

    def __init__(self, cache: "KVCache", i: int):
        self._cache, self._i = cache, i

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.k[self._i][:, :, : self._cache.length]

    @property
    def values(self) -> torch.Tensor:
        return self._cache.v[self._i][:, :, : self._cache.length]


class KVCache:
    """Preallocated keys and values of every layer, ``[1, kv_heads, capacity, head_dim]`` each.

    The decoder's contract: ``get_seq_length()``, ``crop(n)`` (``n < 0`` drops the last ``-n``
    entries, ``n >= 0`` keeps the first ``n``) and ``layers[i].keys`` / ``.values`` (views of the
    cached entries, as in transformers' ``DynamicCache``).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = INITIAL_CAPACITY, max_capacity: int | None = None):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_capacity = max_capacity
        self.engine: Any = None  # the backend that made this cache (FastForward or KernelForward)
        self.kernel_pointers: Any = None  # our kernels' arrays of the K / V addresses (KernelForward._kv_pointers)
        self.length = 0
        cap = capacity if max_capacity is None else min(capacity, max_capacity)
        self.k = [self._empty(cap) for _ in range(num_layers)]
        self.v = [self._empty(cap) for _ in range(num_layers)]

    def _empty(self, cap: int) -> torch.Tensor:
        return torch.empty(1, self.kv_heads, cap, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        """Positions allocated per layer."""
        return self.k[0].shape[2] if self.k else 0

    def reserve(self, n: int) -> None:
        """Make room for ``n`` entries in all (grows by doubling, keeping the cached entries)."""
        cap = self.capacity
        if n <= cap:
            return
        new = max(n, 2 * cap)
        if self.max_capacity is not None:  # doubling stops at the model's positions (n itself always fits)
            new = max(n, min(new, self.max_capacity))
        for lst in (self.k, self.v):
            for i, old in enumerate(lst):
                t = self._empty(new)
                t[:, :, : self.length].copy_(old[:, :, : self.length])
                lst[i] = t

    def copy_prefix(self, n: int) -> "KVCache":
        """A new cache of the same model holding copies of the first ``n`` entries (this one is left as it is)."""
        n = min(n, self.length)
        new = KVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, max(n, 1),
                      self.max_capacity)
        new.engine = self.engine
        for dst, src in ((new.k, self.k), (new.v, self.v)):
            for d, s in zip(dst, src):
                d[:, :, :n].copy_(s[:, :, :n])
        new.length = n
        return new

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions."""
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` entries; a negative value drops that many from the end
        (``DynamicCache.crop`` semantics)."""
        if max_length < 0:
            max_length = self.length - abs(max_length)
        if self.length <= max_length:
            return
        self.length = max(0, max_length)

    @property
    def layers(self) -> list[_LayerView]:
        """Per-layer views with ``keys`` and ``values`` (``[1, kv_heads, length, head_dim]``)."""
        return [_LayerView(self, i) for i in range(self.num_layers)]

    def __len__(self) -> int:
        return self.num_layers
