"""Weight packing for the fast forward path: a transformers (+ peft) model -> :class:`PackedModel`.

Everything here runs once per model (at load, and again when the weights change); the per-pass
computation is :mod:`model.engine.fast_forward`. What packing does:

* **reads** the model through :func:`model.engine.model_reader.read_model` (the checks our kernels share: what
  it refuses raises :class:`~model.errors.Unsupported`);
* **projections**: on a CPU with oneDNN in bfloat16, q|k|v and gate|up are stacked into one matrix
  each and every projection and the output embedding are **prepacked** into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``): a pass reads each weight once, through the kernel
  ``F.linear`` runs (same bits). In float32 / float64 on a CPU they stay separate and unpacked (MKL
  rounds a stacked matrix differently); on CUDA they are stacked.
* **adapters**: LoRA / activated LoRA factors (peft's modules are the source) become, per projection
  group, one stacked ``A`` and one block-diagonal ``B^T`` with the scaling folded in (:class:`LoraDelta`:
  two matrix products and one add per group), float32 for a bf16 model as peft keeps them.
  :class:`ProjGroup` applies them to the trailing ``rows`` rows of a pass only; a pass with ``rows == 0``
  is a plain-base pass.
* peft's **trainable-token rows** (the mask token's embedding) are kept when they differ from the base.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import Unsupported
from .model_reader import LayerRead, ModelRead, Projection, read_model

# --------------------------------------------------------------------------------- matrices
#: Most rows a prepacked oneDNN bf16 product takes. Up to 32 rows it gives ``F.linear``'s bits on every CPU
#: measured; above, on CPUs with AMX, oneDNN switches kernels and the bits differ (measured: 33+ rows, one
#: and two threads). Wider products (a prefill) run ``F.linear`` on the library's own weights instead.
PACKED_MAX_ROWS = 32


class Linear:
    """``y = x W^T (+ b)`` for 2-D ``x`` (``[T, in] -> [T, out]``), W prepacked for oneDNN when ``pack``.

    Unpacked and without bias it calls ``torch.mm`` on a transposed view stored once: the kernel
    ``F.linear`` reaches (same bits), without the ``linear`` / ``t`` / ``matmul`` dispatches in between."""

    __slots__ = ("w", "wt", "b", "packed", "out_features", "plain")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        weight = weight.detach().contiguous()
        self.plain = weight  # the library's weight (a view of the model's, no copy): wide passes use it
        self.out_features = weight.shape[0]
        self.b = bias.detach().contiguous() if bias is not None else None
        self.packed = False
        self.w = weight
        if pack:
            try:
                self.w = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.packed = True
            except (RuntimeError, AttributeError):  # no oneDNN bf16 here (e.g. an AVX2-only CPU): plain weights
                self.w = weight
        self.wt = None if self.packed else self.w.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if x.shape[0] > PACKED_MAX_ROWS:
                return F.linear(x, self.plain, self.b)
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        if self.b is None:
            return torch.mm(x, self.wt)
        return F.linear(x, self.w, self.b)


class LoraDelta:
    """One projection group's adapter: ``delta = (x A^T) B^T``, added to the trailing ``rows`` rows.

    Two matrix products for the whole group, whatever its members: ``a`` stacks the members' ``A``
    (``[sum r, in]``: one product for q|k|v) and ``bt`` is the group's block-diagonal ``B^T`` with the
    scaling folded in (``[sum r, out]``); the delta lands in the group's output with one add. (The first
    layout here cut ``B`` into chunks for a ``bmm`` and ran ~25 small ops per group; at the row counts of
    MTP passes the zero blocks cost far less than the dispatch they replace: the adapter's share of an
    MTP pass on SmolLM2 dropped from ~19 to ~10 ms in float32.)

    Args:
        members: ``(A [r, in], B [out, r] * scaling, output offset)`` of the projections that have
            an adapter.
        sizes: the output width of every projection of the group.
        dtype: the factors' dtype (float32 for a bf16 / fp16 model, as peft keeps them).
    """

    __slots__ = ("a", "bt", "num_members")

    def __init__(self, members: Sequence[tuple[torch.Tensor, torch.Tensor, int]], sizes: Sequence[int],
                 dtype: torch.dtype):
        self.num_members = len(members)
        a = torch.cat([a for a, _, _ in members]).to(dtype).contiguous()
        self.a = a  # [sum r, in]: mm(x, a.t()) as F.linear computes x A^T
        bt = torch.zeros(a.shape[0], sum(sizes), dtype=dtype, device=a.device)
        r0 = 0
        for a_m, b_m, o0 in members:
            bt[r0 : r0 + a_m.shape[0], o0 : o0 + b_m.shape[0]] = b_m.to(dtype).t()
            r0 += a_m.shape[0]
        self.bt = bt  # [sum r, out]

    def add_to(self, outs: Sequence[torch.Tensor], x: torch.Tensor, rows: int) -> None:
        """Add the delta of ``x``'s last ``rows`` rows (``[T, in]``) to ``outs``: the group's stacked output
        alone (one tensor ``[T, out]``), or one tensor per member."""
        xr = x[-rows:] if rows < x.shape[0] else x
        d = torch.mm(torch.mm(xr.to(self.bt.dtype), self.a.t()), self.bt)  # [rows, out]
        if len(outs) == 1:
            outs[0][-rows:] += d
            return
        start = 0
        for out in outs:
            w = out.shape[1]
            out[-rows:] += d[:, start : start + w]
            start += w


class ProjGroup:
    """The projections of one input (q|k|v, o, gate|up or down) and their adapter.

    Calling it on ``x`` (``[T, in]``) returns ``(stacked, members)``: the stacked output ``[T, sum out]``
    (None when the members run as separate matmuls) and one ``[T, out]`` tensor per member (views of the
    stacked output when stacked), the adapter's delta added to the last ``rows`` rows.
    """

    __slots__ = ("parts", "sizes", "stacked", "lora", "members")

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], pack: bool,
                 stack: bool, lora: LoraDelta | None):
        self.sizes = [w.shape[0] for w in weights]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise Unsupported("biases on some stacked projections only")
        self.stacked = stack and len(weights) > 1
        if self.stacked:
            bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None  # type: ignore[union-attr]
            self.parts = [Linear(torch.cat([w.detach() for w in weights]), bias, pack)]
        else:
            self.parts = [Linear(w, b, pack) for w, b in zip(weights, biases)]
        # a stacked group's members as the library holds them (views, no copy): wide passes run them one by one
        self.members = [(w.detach(), None if b is None else b.detach()) for w, b in zip(weights, biases)]
        self.lora = lora

    def __call__(self, x: torch.Tensor, rows: int = 0) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        if not self.stacked:
            outs = [lin(x) for lin in self.parts]
            if rows and self.lora is not None:
                self.lora.add_to(outs, x, rows)
            return (outs[0] if len(outs) == 1 else None), outs
        if self.parts[0].packed and x.shape[0] > PACKED_MAX_ROWS:
            out = torch.cat([F.linear(x, w, b) for w, b in self.members], dim=-1)
        else:
            out = self.parts[0](x)
        if rows and self.lora is not None:
            self.lora.add_to((out,), x, rows)
        views, start = [], 0
        for n in self.sizes:
            views.append(out[:, start : start + n])
            start += n
        return out, views


@dataclass
class PackedLayer:
    """One decoder layer's weights: norms ``[H]``, projection groups, Qwen3's q/k norms ``[head_dim]``."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: ProjGroup
    o: ProjGroup
    gate_up: ProjGroup
    down: ProjGroup
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass
class PackedModel(ModelRead):
    """What the fast forward pass reads: the model as :func:`~model.engine.model_reader.read_model` read it
    (shapes, norms, embeddings, rotary module, adapter: the fields of
    :class:`~model.engine.model_reader.ModelRead`), with its layers packed (:class:`PackedLayer` in place of the
    read ones) and the output projection as a :class:`Linear`.

    Attributes:
        lm_head: ``head`` as the output projection.
        packed: the projections run on oneDNN's prepacked bf16 kernels.
    """

    layers: list[PackedLayer]  # type: ignore[assignment]  (the read layers, packed)
    lm_head: Linear
    packed: bool


# --------------------------------------------------------------------------------- packing
def _lora_delta(members: Sequence[Projection], dtype: torch.dtype) -> LoraDelta | None:
    """The :class:`LoraDelta` of a projection group; None when no member has the adapter."""
    parts, offset = [], 0
    for m in members:
        if m.lora is not None:
            parts.append((*m.lora, offset))
        offset += m.out_features
    if not parts:
        return None
    # peft keeps the adapter of a bf16/fp16 model in float32 (autocast_adapter_dtype) and so do we: closer to
    # peft's logits (143 of 144 mask-row argmaxes equal on SmolLM2 against 139 with bf16 factors) and no
    # slower (MKL's float32 kernels beat oneDNN's bf16 ones on matrices this small).
    return LoraDelta(parts, [m.out_features for m in members],
                     torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype)


def _pack_layer(layer: LayerRead, dtype: torch.dtype, pack: bool, stack: bool) -> PackedLayer:
    def group(name: str) -> ProjGroup:
        members = layer.groups[name]
        return ProjGroup([m.weight for m in members], [m.bias for m in members], pack, stack,
                         _lora_delta(members, dtype))

    return PackedLayer(ln1=layer.ln1, ln2=layer.ln2, qkv=group("qkv"), o=group("o"), gate_up=group("gate_up"),
                       down=group("down"), q_norm=layer.q_norm, k_norm=layer.k_norm)


@torch.no_grad()
def pack_model(model: Any) -> PackedModel:
    """Pack ``model`` (a transformers model, or a peft model wrapping one) for the fast forward pass, from what
    :func:`model.engine.model_reader.read_model` reads.

    Raises:
        Unsupported: the model is outside what the fast path computes exactly (:mod:`model.engine.model_reader`).
    """
    read = read_model(model)
    dtype, device = read.dtype, read.device
    pack = device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
    # Stacked q|k|v and gate|up give bit-identical results with oneDNN's prepacked bf16 kernels (tested);
    # MKL's float32 GEMV rounds a stacked matrix differently, so on the CPU in float32/float64 the
    # projections stay separate and the pass equals transformers' bit for bit.
    stack = pack or device.type == "cuda"
    lm_head = Linear(read.head, None, pack)
    read_fields = {f.name: getattr(read, f.name) for f in fields(ModelRead)}
    read_fields["layers"] = [_pack_layer(layer, dtype, pack, stack) for layer in read.layers]
    return PackedModel(**read_fields, lm_head=lm_head, packed=pack and lm_head.packed)
