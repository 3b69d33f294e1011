"""A compact inference forward pass for Llama-family causal LMs, with MTP adapters applied per row.

:meth:`model.engine.loaded_model.LoadedModel.forward` runs decoding passes through this module
whenever it supports the model (:func:`build_engine` says why not otherwise, and the library path —
transformers, with peft for adapters — runs instead). It computes what transformers computes, op for
op and with the same bits on the base weights (checked in bf16, float32 and float64). The weights are
packed once by :mod:`model.engine.fast_weights` (prepacked oneDNN bf16 matrices, stacked q|k|v and
gate|up, adapter factors); the KV cache is :class:`~model.engine.kv_cache.KVCache`. A pass applies
the adapter only to the rows that need it: the trailing mask rows for aLoRA (``adapter_rows =
num_masks``), every row for LoRA, none for a standard pass of an aLoRA model or with the adapter off,
so a pass without adapter rows costs exactly a plain-base pass. Attention is
``torch.nn.functional.scaled_dot_product_attention`` with transformers' kernels and bits. The pass
runs without autograd.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .backend import PassInput
from .fast_weights import PackedLayer, PackedModel, pack_model
from .kv_cache import INITIAL_CAPACITY, KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, op for op (float32 statistics, then the weight in x's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding ``x cos + rotate_half(x) sin`` as ``x cos + roll(x) sin'`` with the
    first half of ``sin'`` negated: the same products and sums, so the same bits, in fewer ops."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_folded


class RotaryTable:
    """The rotary embedding's ``cos`` and sign-folded ``sin`` by position, from a table that the model's own
    rotary module computes once for positions 0 .. n (grown by doubling, capped at the model's positions: the
    same bits as a call per pass). Shared by the torch fast path and our kernels' pass.

    Args:
        rotary: the model's rotary module (``model.model.rotary_emb``).
        head_dim, dtype, device: of the queries and keys.
        max_positions: the model's ``max_position_embeddings`` (None: no cap).
    """

    def __init__(self, rotary, head_dim: int, dtype: torch.dtype, device: torch.device, max_positions: int | None):
        self.rotary, self.head_dim, self.dtype, self.device = rotary, head_dim, dtype, device
        self.max_positions = max_positions
        self._cos = self._sin = None
        self._f32: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin')`` ``[T, head_dim]`` in the dtype for ``position_ids`` ``[T]``; ``sin'`` has its first half
        negated (:func:`rotate`)."""
        end = int(position_ids.max()) + 1
        if self._cos is None or end > self._cos.shape[0]:
            n = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            if self.max_positions:
                n = max(end, min(n, self.max_positions))
            probe = torch.empty(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, torch.arange(n, device=self.device)[None])
            half = self.head_dim // 2
            self._cos = cos[0].contiguous()
            self._sin = torch.cat((-sin[0][:, :half], sin[0][:, half:]), -1).contiguous()
        return self._cos[position_ids], self._sin[position_ids]

    def rows_float32(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin')`` of the consecutive positions ``start .. end - 1``, float32 ``[end - start, head_dim]``:
        views of one float32 copy of the table (made when the table grows), so a pass costs no copy. The values
        of ``self(torch.arange(start, end))`` widened to float32."""
        if self._cos is None or end > self._cos.shape[0]:
            self(torch.tensor([end - 1]))
        if self._f32 is None or self._f32[0].shape[0] != self._cos.shape[0]:
            self._f32 = (self._cos.float(), self._sin.float())
        return self._f32[0][start:end], self._f32[1][start:end]


class FastForward:
    """The compact forward pass of one packed model (built by :func:`build_engine`).

    Attributes:
        weights: the :class:`~model.engine.fast_weights.PackedModel`.
        source: the model object the weights were packed from.
    """

    #: The sequences of a batch run one after the other (each pass reads the weights).
    shares_passes = False
    kind = "fast"

    def __init__(self, weights: PackedModel):
        self.weights = weights
        self.source = weights.source
        self.device, self.dtype = weights.device, weights.dtype
        self.adapter_kind = weights.adapter_kind
        self.packed = weights.packed
        self.has_adapter = weights.has_adapter
        self._table: RotaryTable | None = None  # rotary table by position (see _rope)

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, head_dim]`` of the given positions (:class:`RotaryTable`), ``sin``
        sign-folded for :func:`rotate`."""
        if self._table is None:
            w = self.weights
            self._table = RotaryTable(w.rotary, w.head_dim, self.dtype, self.device, w.max_positions)
        cos, sin = self._table(position_ids)
        return cos[:, None], sin[:, None]

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> KVCache:
        """An empty :class:`~model.engine.kv_cache.KVCache` for this model."""
        w = self.weights
        cache = KVCache(len(w.layers), w.kv_heads, w.head_dim, w.dtype, w.device, capacity, w.max_positions)
        cache.engine = self
        return cache

    def describe(self) -> str:
        """One line: what this path does (shown by the CLI, the benchmark and the app)."""
        parts = ["fast path", "prepacked oneDNN bf16" if self.packed else str(self.dtype).replace("torch.", "")]
        if self.adapter_kind:
            parts.append("aLoRA on mask rows" if self.adapter_kind == "alora" else "LoRA on all rows")
        return ", ".join(parts)

    # ------------------------------------------------------------------ forward
    def forward_batch(self, inputs: Sequence[PassInput]) -> list[torch.Tensor]:
        """Each :class:`~model.engine.backend.PassInput`'s pass, one after the other: ``[logits_rows_i, V]`` logits in the
        model's dtype; each cache (a :class:`KVCache` of this engine) extended by its ``T_i`` entries.

        Raises:
            ValueError: a cache of another engine.
        """
        out = []
        for p in inputs:
            if not isinstance(p.cache, KVCache) or p.cache.engine is not self:
                raise ValueError("forward_batch: every cache must come from this engine's new_cache()")
            out.append(self._forward_one(p.tokens.to(self.device), p.cache, p.adapter_rows, p.logits_rows, p.positions,
                                         p.visible))
        return out

    def _forward_one(self, ids: torch.Tensor, cache: KVCache, adapter_rows: int, keep: int,
                     positions: Sequence[int] | None, visible: torch.Tensor | None) -> torch.Tensor:
        """One sequence's pass: ``ids`` ``[T]`` appended to ``cache``; ``adapter_rows`` trailing rows get the
        adapter's delta; returns the last ``keep`` rows' logits ``[keep, V]``."""
        w = self.weights
        t, pos = ids.shape[0], cache.length
        end = pos + t
        cache.reserve(end)
        rows = min(adapter_rows, t) if self.has_adapter else 0
        x = F.embedding(ids, w.adapter_embed if rows and w.adapter_embed is not None else w.embed)
        if positions is None:
            position_ids = torch.arange(pos, end, device=self.device)
        else:
            position_ids = (torch.tensor(list(positions)) + pos).to(self.device)
        rope = self._rope(position_ids)  # [T, 1, hd] each: broadcast over heads
        mask, causal, repeat_kv = self._attention_mask(t, pos, end)
        if visible is not None:  # a tree of mask blocks: each input sees the cache and what `visible` says
            mask = torch.cat([torch.ones(t, pos, dtype=torch.bool), visible.to(torch.bool).cpu()], 1).to(self.device)
            causal, repeat_kv = False, self.weights.groups > 1 and self.device.type != "cpu"
        for i, layer in enumerate(w.layers):
            h = rms_norm(x, layer.ln1, w.eps)
            q, k, v = self._qkv(layer, h, rows, rope)
            kc, vc = cache.k[i], cache.v[i]
            kc[0, :, pos:end].copy_(k.transpose(0, 1))
            vc[0, :, pos:end].copy_(v.transpose(0, 1))
            a = self._attend(q, kc[:, :, :end], vc[:, :, :end], mask, causal, repeat_kv)
            _, (o,) = layer.o(a, rows)
            x += o
            h = rms_norm(x, layer.ln2, w.eps)
            _, (gate, up) = layer.gate_up(h, rows)
            act = F.silu(gate).mul_(up)
            _, (d,) = layer.down(act, rows)
            x += d
        cache.length = end
        h = rms_norm(x[-keep:], w.norm, w.eps)
        logits = w.lm_head(h)
        if rows and w.head_override is not None:
            idx, head_rows = w.head_override
            logits[:, idx] = F.linear(h, head_rows)
        return logits

    def _qkv(self, layer: PackedLayer, h: torch.Tensor, rows: int, rope: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, heads, hd]``, keys and values ``[T, kv_heads, hd]``, rotary applied."""
        w = self.weights
        t, nh, nkv, hd = h.shape[0], w.num_heads, w.kv_heads, w.head_dim
        cos, sin = rope
        stacked, (q, k, v) = layer.qkv(h, rows)
        v = v.view(t, nkv, hd)
        if stacked is not None and layer.q_norm is None:  # q|k adjacent in one output: one rotation for both
            qk = rotate(stacked[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)  # elementwise: same bits
            return qk[:, :nh], qk[:, nh:], v
        q, k = q.view(t, nh, hd), k.view(t, nkv, hd)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, w.eps)
            k = rms_norm(k, layer.k_norm, w.eps)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _attention_mask(self, t: int, pos: int, end: int) -> tuple[torch.Tensor | None, bool, bool]:
        """``(mask, is_causal, repeat_kv)`` for a pass of ``t`` queries after ``pos`` cached entries.

        Attention as transformers computes it, through the fastest SDPA call that gives the same bits
        (checked on this CPU for bf16 and float32): a first pass: is_causal; one query: enable_gqa;
        several queries over a cache: a boolean causal mask with enable_gqa on the CPU (transformers
        repeats the keys instead, the path CUDA keeps; same bits, 1.2-10x faster here). Not used: one
        query with each KV head's query heads as rows is 3-7x faster on a bf16 CPU but changes the bits
        for some cache lengths (standard decoding would leave HF generate's tokens).
        """
        if t > 1 and pos == 0:
            return None, True, False
        if t > 1:
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device).tril_(pos)
            return mask, False, self.weights.groups > 1 and self.device.type != "cpu"
        return None, False, False

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, repeat_kv: bool) -> torch.Tensor:
        """Attention of ``q`` (``[T, heads, hd]``) over ``keys`` / ``values`` (``[1, kv_heads, L, hd]``);
        returns ``[T, heads * hd]``."""
        w = self.weights
        t, g = q.shape[0], w.groups
        if repeat_kv:
            n, length = keys.shape[1], keys.shape[2]
            keys = keys[:, :, None].expand(1, n, g, length, w.head_dim).reshape(1, n * g, length, w.head_dim)
            values = values[:, :, None].expand(1, n, g, length, w.head_dim).reshape(1, n * g, length, w.head_dim)
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=w.scaling)
        else:
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                               is_causal=causal, scale=w.scaling, enable_gqa=g > 1)
        return a[0].transpose(0, 1).reshape(t, w.num_heads * w.head_dim)


def build_engine(model: Any) -> FastForward:
    """The fast forward pass for ``model`` (a transformers model or a peft model wrapping one).

    Raises:
        Unsupported: the architecture, weights or adapter are outside the fast path (see
            :mod:`model.engine.fast_weights`); the message says which.
    """
    return FastForward(pack_model(model))
