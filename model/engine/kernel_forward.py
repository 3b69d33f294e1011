"""The forward pass on our CPU kernels (:mod:`model.engine.kernels`): one C++ call per pass.

:meth:`model.engine.loaded_model.LoadedModel.forward` runs decoding passes here when the model is on the CPU in
bfloat16 or float32, the model reader accepts it (:func:`model.engine.model_reader.read_model`) and
``MTP_KERNELS`` is not ``off`` (:func:`model.engine.kernels.status`). What it guarantees, tested in
``tests/engine/test_kernels.py``:

* **row exactness**: each row of a T-token pass (any T, linear or tree layout, with or without the adapter on
  its mask rows) has the bits of a one-token pass of the same token after the same KV cache, so lossless
  verification gives standard decoding's tokens exactly, in bf16 as in float32;
* **determinism**: the same bits with 1 or 2 threads (threads split output columns, never a sum) and in every
  run;
* **close to transformers**: the same ops and roundings to the model's dtype as transformers' eager pass, with
  sums in our own order (docs/DESIGN.md gives the measured differences).

The weights are packed once (``bf16`` pairs for ``vdpbf16ps``, or 16-column panels widened to float32 in
registers on AVX2); the adapter's factors (bf16 for a bf16 model, float32 products; ``MTP_LORA_FACTORS``) reach
the mask rows inside the projection call, member by member (no block-diagonal zeros). The KV cache is the fast path's
:class:`~model.engine.kv_cache.KVCache`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import Unsupported
from . import kernels as K
from .fast_forward import RotaryTable
from .backend import PassInput
from .kv_cache import INITIAL_CAPACITY, KVCache
from .model_reader import LayerRead, ModelRead, Projection, read_model
from .threads import kernel_threads, serial_torch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}

#: Bytes of one slab of the packed weights smaller than a huge page (2 MB): ``mtp_alloc`` rounds every buffer up
#: to whole 2 MB huge pages, so a buffer of its own per 36 KB LoRA factor or 0.7 MB projection cost 1016 MB for
#: SmolLM2-135M's 275 MB of packed weights (420 of its 451 buffers are under 2 MB). Such buffers share slabs
#: instead (huge pages still, 64-byte aligned inside): the same model's arena is 304 MB. Lost: a slab's tail too
#: short for the next buffer (under 2 MB a slab) and the unused part of the last slab.
SLAB_BYTES = 16 << 20
#: Alignment of a buffer inside a slab (a cache line; the kernels use unaligned loads).
SLAB_ALIGN = 64
_HUGE = 2 << 20


class _Arena:
    """Packed weights owned by this engine (freed with it) and the tensors their structs point into.

    A buffer of at least 2 MB gets an ``mtp_alloc`` of its own; smaller ones are carved out of shared
    :data:`SLAB_BYTES` slabs (first fit), so the arena holds about the packed bytes rather than 2 MB per buffer."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.blocks, self.keep = lib, [], []
        self.slabs: list[list[int]] = []  # [address, bytes used] of each slab
        #: Bytes allocated for packed weights (slabs and own buffers; what the arena adds to the process).
        self.allocated = 0

    def _alloc(self, nbytes: int) -> int:
        """A zeroed buffer of ``nbytes`` (2 MB huge pages; small ones share a slab)."""
        if nbytes >= _HUGE:
            return self._new_block(nbytes)
        need = -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
        for slab in self.slabs:
            if slab[1] + need <= SLAB_BYTES:
                ptr = slab[0] + slab[1]
                slab[1] += need
                return ptr
        base = self._new_block(SLAB_BYTES)
        self.slabs.append([base, need])
        return base

    def _new_block(self, nbytes: int) -> int:
        ptr = self.lib.mtp_alloc(nbytes)
        if not ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes of packed weights")
        self.blocks.append(ptr)
        self.allocated += -(-nbytes // _HUGE) * _HUGE
        return ptr

    def pack(self, weight: torch.Tensor, layout: int) -> int:
        """Pack ``weight`` ``[n, k]`` (bf16 or float32) into ``layout``; returns the buffer's address."""
        w = weight.detach().contiguous()
        if w.dtype not in DTYPES:
            w = w.float()
        n, k = w.shape
        ptr = self._alloc(self.lib.mtp_packed_bytes(n, k, layout))
        self.lib.mtp_pack_weight(w.data_ptr(), DTYPES[w.dtype], n, k, layout, ptr)
        return ptr

    def f32(self, t: torch.Tensor | None) -> int | None:
        """A float32 contiguous copy of ``t`` kept alive here; its address (None for None)."""
        if t is None:
            return None
        c = t.detach().to(torch.float32).contiguous()
        self.keep.append(c)
        return c.data_ptr()

    def __del__(self) -> None:
        for p in self.blocks:
            self.lib.mtp_free(p)
        self.blocks = []


class KernelForward:
    """The forward pass of one model on our kernels (built by :func:`build_kernel_engine`).

    Attributes:
        source: the model object the weights were packed from.
        isa: the kernel path (``"amx"``, ``"avx512bf16"`` or ``"avx2"``).
        emulated: the AMX path runs in software emulation (``MTP_AMX_EMULATE``; a test, not a speed).
    """

    #: One pass over the weights for every row of every sequence of a batch.
    shares_passes = True
    kind = "kernels"

    def __init__(self, model: Any, isa: str, lib: ctypes.CDLL, emulated: bool = False):
        read = read_model(model)
        if read.device.type != "cpu":
            raise Unsupported(f"our kernels run on the CPU (model on {read.device.type})")
        if read.dtype not in DTYPES:
            raise Unsupported(f"our kernels compute bfloat16 or float32 (model in {read.dtype})")
        if read.head_dim > 512 or read.head_dim % 2:
            raise Unsupported(f"head_dim {read.head_dim}")
        self.source, self.isa, self.lib, self.emulated = model, isa, lib, emulated
        self.device, self.dtype, dtype = read.device, read.dtype, read.dtype
        self.logits_dtype = dtype  # the kernel stores a pass's logits in it (float32 is allowed for any model)
        self.kv_heads, self.head_dim, self.num_layers = read.kv_heads, read.head_dim, len(read.layers)
        self.max_positions = read.max_positions
        self.rotary_table = RotaryTable(read.rotary, read.head_dim, dtype, read.device, self.max_positions)
        # bf16 pairs: vdpbf16ps's operands (2, blocks two by two) and the AMX tiles' (3, each block in a row)
        self.layout = 0 if dtype == torch.float32 else {"avx512bf16": 2, "amx": 3}.get(isa, 1)
        # The adapter's factors of a bf16 model are stored in bf16 and multiplied in float32 (u = x A^T stays
        # float32): half the 39 MB a mask pass reads in float32 (SmolLM2, rank 32: 3.7 -> 2.5 ms for one mask
        # row); the mask rows' argmax equals peft's (float32 factors) on 60 of 60 rows, as with float32 factors.
        # MTP_LORA_FACTORS=float32 keeps them as peft does. A float32 model keeps float32 factors.
        want = os.environ.get("MTP_LORA_FACTORS", "bf16").strip().lower()
        if want not in ("bf16", "float32"):
            raise Unsupported(f"MTP_LORA_FACTORS={want!r} (bf16 or float32)")
        self.factor_layout = 1 if dtype == torch.bfloat16 and want == "bf16" else 0
        self.arena = _Arena(lib)
        self.adapter_kind, self.has_adapter = read.adapter_kind, read.has_adapter
        self.embed, self.adapter_embed, self.vocab = read.embed, read.adapter_embed, read.head.shape[0]
        self._layers = (K.Layer * max(1, self.num_layers))()
        for i, layer in enumerate(read.layers):
            self._pack_layer(self._layers[i], layer)
        self.m = self._model_struct(read)

    def _pack_layer(self, out: K.Layer, layer: LayerRead) -> None:
        """Fill one layer's struct: its four projection groups and its norms (float32 copies kept here)."""
        for name in ("qkv", "o", "gate_up", "down"):
            self._linear(getattr(out, name), layer.groups[name])
        f32 = self.arena.f32
        out.ln1, out.ln2, out.q_norm, out.k_norm = f32(layer.ln1), f32(layer.ln2), f32(layer.q_norm), f32(layer.k_norm)

    def _model_struct(self, read: ModelRead) -> K.Model:
        """The model's struct: shapes, the final norm, the output embedding and peft's trained output rows."""
        arena, layout = self.arena, self.layout
        m = K.Model()
        m.hidden, m.heads, m.kv_heads, m.head_dim = read.hidden, read.num_heads, read.kv_heads, read.head_dim
        m.inter, m.layers, m.dtype, m.isa = read.intermediate, self.num_layers, DTYPES[read.dtype], K.ISA_CODES[self.isa]
        m.eps, m.scaling = read.eps, read.scaling
        m.layer = ctypes.cast(self._layers, ctypes.POINTER(K.Layer))
        m.norm = arena.f32(read.norm)
        m.head.w, m.head.n, m.head.k, m.head.layout = (arena.pack(read.head, layout), self.vocab, read.head.shape[1],
                                                       layout)
        if read.head_override is not None:
            idx, rows = read.head_override
            m.head_override.w = arena.pack(rows.to(read.dtype), layout)
            m.head_override.n, m.head_override.k, m.head_override.layout = rows.shape[0], rows.shape[1], layout
            idx64 = idx.to(torch.int64).contiguous()
            arena.keep.append(idx64)
            m.override_idx = idx64.data_ptr()
        return m

    def _linear(self, out: K.Linear, members: Sequence[Projection]) -> None:
        """Fill ``out`` for one group of stacked projections and the adapter's members among them. The adapter's
        A (all members stacked) is packed after the weight's columns, in its layout, when its factors have the
        weight's dtype (``lora_a_in_w``: a pass sweeps them with the weight); B stays a product of its own."""
        arena = self.arena
        w = torch.cat([m.weight for m in members]) if len(members) > 1 else members[0].weight
        n, k = w.shape
        out.n, out.k, out.layout = n, k, self.layout
        out.bias = arena.f32(torch.cat([m.bias for m in members])) if members[0].bias is not None else None
        count, offset, r0, a_parts = 0, 0, 0, []
        for m in members:
            if m.lora is not None:
                a, b = m.lora[0].float(), m.lora[1].float()
                a_parts.append(a)
                out.m_out0[count], out.m_out1[count] = offset, offset + m.out_features
                out.m_r0[count], out.m_r1[count] = r0, r0 + a.shape[0]
                out.m_b[count] = arena.pack(b, self.factor_layout)
                r0 += a.shape[0]
                count += 1
            offset += m.out_features
        out.members, out.rank, out.lora_layout = count, r0, self.factor_layout
        a_in_w = count > 0 and (self.factor_layout == 0) == (self.layout == 0)  # bf16 A beside bf16 W, or f32/f32
        if a_in_w:
            pad = w.new_zeros((-n) % 16, k)  # A starts at a block of its own
            w = torch.cat([w.to(self.dtype), pad.to(self.dtype), torch.cat(a_parts).to(self.dtype)])
        elif count:
            out.lora_a = arena.pack(torch.cat(a_parts), self.factor_layout)
        out.w, out.lora_a_in_w = arena.pack(w.to(self.dtype), self.layout), int(a_in_w)

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin')`` float32 ``[T, head_dim]`` of the positions (:class:`~model.engine.fast_forward.RotaryTable`)."""
        cos, sin = self.rotary_table(position_ids)
        return cos.float(), sin.float()

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> KVCache:
        """An empty :class:`~model.engine.kv_cache.KVCache` for this model."""
        cache = KVCache(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, capacity,
                        self.max_positions)
        cache.engine = self
        return cache

    def describe(self) -> str:
        """One line: what this path does (the CLI, the benchmark and the app show it)."""
        parts = [f"our kernels ({self.isa})", str(self.dtype).replace("torch.", "")]
        if self.dtype == torch.bfloat16 and self.isa == "avx2":  # no bf16 instructions: widened, summed in float32
            parts[1] = "bfloat16 weights widened to float32 (AVX2 has no bf16 instructions)"
        if self.emulated:
            parts.append("AMX emulated in software")
        if self.adapter_kind:
            parts.append("aLoRA on mask rows" if self.adapter_kind == "alora" else "LoRA on all rows")
        return ", ".join(parts)

    def propose(self, logits: torch.Tensor, mask_token_id: int) -> tuple[list[int], list[float]]:
        """:func:`~model.engine.phases.propose` in our kernels (``mtp_propose``, a row per thread): the first index of
        each row's largest logit and its probability, ``1 / sum(exp(logit - max))`` over the vocabulary without the
        mask token. ~5x faster than torch's softmax and maximum; a confidence may differ from torch's in its last
        bits (another order of the sum), a token never (both take the first largest logit).

        Args:
            logits: ``[T, V]`` float32 or bfloat16 on the CPU.

        Returns:
            ``(tokens, confidences)``: ``T`` ids and ``T`` floats (NaN where a logit is NaN or +inf).
        """
        x = logits.contiguous()
        t, v = x.shape
        tokens, conf = torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.float32)
        rc = self.lib.mtp_propose(x.data_ptr(), DTYPES[x.dtype], t, v, v, mask_token_id, tokens.data_ptr(),
                                  conf.data_ptr(), kernel_threads())
        if rc != 0:
            raise RuntimeError(f"our kernels refused the proposals of logits {tuple(x.shape)} (code {rc})")
        return tokens.tolist(), conf.tolist()

    def forward_batch(self, inputs: Sequence[PassInput]) -> list[torch.Tensor]:
        """One pass over the rows of several sequences (:class:`~model.engine.backend.PassInput`): their rows
        concatenated, weights read once, each row attending to its own sequence's KV cache and its own pass's rows
        only. Every row computes what it would in a batch of one, bit for bit (the row exactness of our kernels),
        whatever the other sequences.

        Returns:
            One ``[logits_rows_i, V]`` logits tensor per input (in ``logits_dtype``, the model's dtype); each cache
            extended by ``T_i`` entries.

        Raises:
            ValueError: no inputs, or a cache of another engine; RuntimeError: the kernel refused the shapes.
        """
        if not inputs:
            raise ValueError("forward_batch needs at least one sequence")
        with serial_torch():  # torch's few ops here on this thread; our pool gets the threads (model.engine.threads)
            return self._forward_batch(inputs, kernel_threads())

    def _forward_batch(self, inputs: Sequence[PassInput], threads: int) -> list[torch.Tensor]:
        """:meth:`forward_batch` on ``threads`` threads of our pool."""
        xs, coss, sins, adapter, keep, kept, vis_bufs, caches = [], [], [], [], [], [], [], []
        row0, poss, caps = [0], [], []
        for p in inputs:
            cache = p.cache
            if not isinstance(cache, KVCache) or cache.engine is not self:
                raise ValueError("forward_batch: every cache must come from this engine's new_cache()")
            ids = p.tokens
            t, pos = int(ids.shape[0]), cache.length
            cache.reserve(pos + t)
            rows = min(p.adapter_rows, t) if self.has_adapter else 0
            table = self.adapter_embed if rows and self.adapter_embed is not None else self.embed
            xs.append(F.embedding(ids, table).float())
            if p.positions is None:  # consecutive positions: rows of the float32 table, no copy
                c, sn = self.rotary_table.rows_float32(pos, pos + t)
            else:
                c, sn = self._rope(torch.tensor(list(p.positions), dtype=torch.long) + pos)
            coss.append(c)
            sins.append(sn)
            adapter += [0] * (t - rows) + [1] * rows
            k = p.logits_rows
            kept.append(k)
            keep += range(row0[-1] + t - k, row0[-1] + t)
            vis = p.visible
            vis_bufs.append(None if vis is None else vis.to(torch.bool).cpu().to(torch.uint8).contiguous())
            row0.append(row0[-1] + t)
            poss.append(pos)
            caps.append(cache.capacity)
            caches.append(cache)
        n = len(inputs)
        # held by name until the call: the kernel reads (and writes x) at these addresses
        x = (xs[0] if n == 1 else torch.cat(xs)).contiguous()
        cos, sin = (coss[0], sins[0]) if n == 1 else (torch.cat(coss), torch.cat(sins))
        cos, sin = cos.contiguous(), sin.contiguous()
        kp, vp = self._kv_pointers(caches)
        row0_a = (ctypes.c_int32 * (n + 1))(*row0)
        pos_a, cap_a = (ctypes.c_int64 * n)(*poss), (ctypes.c_int64 * n)(*caps)
        vis_a = (ctypes.c_void_p * n)(*[None if v is None else v.data_ptr() for v in vis_bufs])
        ad_a = (ctypes.c_uint8 * len(adapter))(*adapter)
        keep_a = (ctypes.c_int32 * len(keep))(*keep)
        b = K.Batch(n, ctypes.addressof(row0_a), ctypes.addressof(kp), ctypes.addressof(vp), ctypes.addressof(cap_a),
                    ctypes.addressof(pos_a), ctypes.addressof(vis_a),
                    ctypes.addressof(ad_a) if any(adapter) else None, ctypes.addressof(keep_a), len(keep))
        logits = torch.empty(len(keep), self.vocab, dtype=self.logits_dtype)
        rc = self.lib.mtp_forward_batch(ctypes.byref(self.m), x.data_ptr(), row0[-1], ctypes.byref(b), cos.data_ptr(),
                                        sin.data_ptr(), logits.data_ptr(), DTYPES[self.logits_dtype], threads)
        if rc != 0:
            raise RuntimeError(f"our kernels refused this batched pass (code {rc})")
        out, start = [], 0
        for i, k in enumerate(kept):
            caches[i].length = poss[i] + row0[i + 1] - row0[i]
            out.append(logits[start:start + k])
            start += k
        return out

    def _kv_pointers(self, caches: Sequence[KVCache]) -> tuple[ctypes.Array, ctypes.Array]:
        """The K and V tensors' addresses of every layer of every cache, in order (``mtp_batch.kcache`` /
        ``vcache``). A cache keeps its own pair of arrays until :meth:`KVCache.reserve` moves its tensors."""
        arrays = []
        for c in caches:
            key = (c.capacity, c.k[0].data_ptr())
            held = getattr(c, "kernel_pointers", None)
            if held is None or held[0] != key:
                held = (key, (ctypes.c_void_p * self.num_layers)(*[k.data_ptr() for k in c.k]),
                        (ctypes.c_void_p * self.num_layers)(*[v.data_ptr() for v in c.v]))
                c.kernel_pointers = held
            arrays.append(held)
        if len(arrays) == 1:
            return arrays[0][1], arrays[0][2]
        n = len(arrays) * self.num_layers
        return ((ctypes.c_void_p * n)(*[p for a in arrays for p in a[1]]),
                (ctypes.c_void_p * n)(*[p for a in arrays for p in a[2]]))


def build_kernel_engine(model: Any) -> KernelForward | None:
    """The kernel forward pass for ``model``, or None when ``MTP_KERNELS`` or the machine leaves ours off
    (:func:`model.engine.kernels.status` says why).

    Raises:
        Unsupported: the model is outside what our kernels compute (the message says why).
        model.engine.kernels.KernelError: a forced ``MTP_KERNELS`` path that cannot run here.
    """
    st = K.status()
    if st.isa is None:
        return None
    return KernelForward(model, st.isa, st.library, emulated=st.emulated)
