"""Weight packing for the fast forward path: a transformers (+ peft) model -> :class:`PackedModel`.

Everything here runs once per model (at load, and again when the weights change); the per-pass
computation is :mod:`model.engine.fast_forward`. What packing does:

* **checks** that the fast path computes what transformers computes for this model
  (:func:`check_supported`): ``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window),
  ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` — SiLU MLP, RMSNorm, rotary embeddings, optional q/k/v
  biases, Qwen3's q/k norms — unquantised, on one device, with at most one active LoRA adapter
  without DoRA / LoRA bias and not merged. Anything else raises :class:`~model.errors.Unsupported`.
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

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import Unsupported

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
class PackedModel:
    """What the fast forward pass reads: the layers, the embeddings, the rotary module and the shapes.

    Attributes:
        embed: ``[V, H]`` input embedding; ``adapter_embed``: the same with peft's trained mask row, used
            in adapter passes (None when the rows agree).
        lm_head: the output projection; ``head_override``: ``(indices, rows [n, H])`` of peft's trained
            output rows for adapter passes (None when none differ).
        has_adapter: some layer or embedding row carries the adapter.
    """

    source: Any
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    max_positions: int | None
    rotary: Any
    layers: list[PackedLayer]
    norm: torch.Tensor
    embed: torch.Tensor
    adapter_embed: torch.Tensor | None
    lm_head: Linear
    head_override: tuple[torch.Tensor, torch.Tensor] | None
    adapter_kind: str | None
    packed: bool

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.kv_heads

    @property
    def has_adapter(self) -> bool:
        return (any(layer.qkv.lora or layer.o.lora or layer.gate_up.lora or layer.down.lora for layer in self.layers)
                or self.adapter_embed is not None or self.head_override is not None)


# --------------------------------------------------------------------------------- reading the model
def unwrap(model: Any) -> tuple[Any, Any | None]:
    """(the transformers model, the peft model or None)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.get_base_model(), model
    return model, None


def check_supported(hf: Any, peft_model: Any | None) -> str | None:
    """Check that the fast path can run this model; returns the active adapter's name (None without).

    Raises:
        Unsupported: the architecture, weights or adapter are outside the fast path (module docstring).
    """
    cfg = hf.config
    arch = getattr(cfg, "model_type", None)
    if arch not in ARCHITECTURES:
        raise Unsupported(f"architecture {arch!r} (fast path: {', '.join(ARCHITECTURES)})")
    if getattr(hf, "is_quantized", False) or getattr(cfg, "quantization_config", None) is not None:
        raise Unsupported("quantized weights")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Unsupported(f"activation {cfg.hidden_act!r}")
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        raise Unsupported("pretraining_tp > 1")
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        raise Unsupported("sliding-window attention layers")
    if arch == "mistral" and getattr(cfg, "sliding_window", None):
        raise Unsupported("sliding-window attention")
    devices = {p.device for p in hf.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        raise Unsupported("weights spread over several devices or offloaded")
    if peft_model is None:
        return None
    active = list(getattr(peft_model, "active_adapters", []) or [])
    if len(active) != 1:
        raise Unsupported(f"{len(active)} active adapters (fast path: one)")
    pcfg = peft_model.peft_config[active[0]]
    ptype = getattr(pcfg, "peft_type", None)
    if ptype is None or str(getattr(ptype, "value", ptype)) != "LORA":
        raise Unsupported(f"peft type {ptype} (fast path: LoRA)")
    for name, mod in peft_model.named_modules():
        if type(mod).__name__ == "ModulesToSaveWrapper":
            raise Unsupported(f"peft modules_to_save ({name})")
    return active[0]


def _base_linear(mod: Any) -> tuple[torch.nn.Linear, Any | None]:
    """(the plain nn.Linear, the peft LoRA layer or None) of a projection."""
    if isinstance(mod, torch.nn.Linear) and type(mod) is torch.nn.Linear:
        return mod, None
    base = getattr(mod, "base_layer", None)
    if base is not None and hasattr(mod, "lora_A"):
        if type(base) is not torch.nn.Linear:
            raise Unsupported(f"a LoRA layer over {type(base).__name__} (quantized or custom) is not supported")
        return base, mod
    raise Unsupported(f"projection of type {type(mod).__name__} is not supported")


def lora_factors(layer: Any | None, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(A [r, in], B [out, r] * scaling)`` of peft LoRA layer ``layer`` for ``adapter`` (detached), or None
    when the projection has no such adapter.

    Raises:
        Unsupported: a merged adapter, DoRA, LoRA biases, or dropout in training mode.
    """
    if adapter is None or layer is None or adapter not in layer.lora_A:
        return None
    if getattr(layer, "merged", False):
        raise Unsupported("the LoRA adapter is merged into the base weights")
    if layer.use_dora.get(adapter, False):
        raise Unsupported("DoRA adapters are not supported")
    if getattr(layer, "lora_bias", {}).get(adapter, False):
        raise Unsupported("LoRA biases are not supported")
    if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity) and layer.training:
        raise Unsupported("LoRA dropout in training mode")
    return layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach() * layer.scaling[adapter]


def _lora_delta(members: Sequence[tuple[Any | None, int]], adapter: str | None, dtype: torch.dtype,
                pack: bool) -> LoraDelta | None:
    """The :class:`LoraDelta` of a projection group from its members' ``(peft LoRA layer or None,
    out_features)``; None when no member has the adapter."""
    if adapter is None:
        return None
    parts, offset = [], 0
    for layer, out_f in members:
        factors = lora_factors(layer, adapter)
        if factors is not None:
            parts.append((*factors, offset))
        offset += out_f
    if not parts:
        return None
    # peft keeps the adapter of a bf16/fp16 model in float32 (autocast_adapter_dtype) and so do we: closer to
    # peft's logits (143 of 144 mask-row argmaxes equal on SmolLM2 against 139 with bf16 factors) and no
    # slower (MKL's float32 kernels beat oneDNN's bf16 ones on matrices this small).
    return LoraDelta(parts, [n for _, n in members], torch.float32 if dtype in (torch.bfloat16, torch.float16)
                     else dtype)


def _token_override(module: Any, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """peft trainable-token rows (``(indices, rows)``) that differ from the base weight's rows, or None."""
    layer = getattr(module, "token_adapter", None)
    if layer is None or adapter is None or adapter not in getattr(layer, "trainable_tokens_delta", {}):
        return None
    idx = torch.tensor(layer.token_indices[adapter], dtype=torch.long, device=layer.base_layer.weight.device)
    w = layer.base_layer.weight
    rows = layer.trainable_tokens_delta[adapter].detach().to(w.dtype)
    if torch.equal(rows, w.detach()[idx]):
        return None
    return idx, rows


def _plain(module: Any) -> Any:
    """The wrapped embedding / lm_head module under peft's trainable-token wrapper."""
    layer = getattr(module, "token_adapter", None)
    return layer.base_layer if layer is not None else module


def _pack_layer(layer: Any, adapter: str | None, dtype: torch.dtype, pack: bool, stack: bool) -> PackedLayer:
    att, mlp = layer.self_attn, layer.mlp
    if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        raise Unsupported(f"MLP activation {type(getattr(mlp, 'act_fn', None)).__name__}")
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not hasattr(getattr(layer, name), "variance_epsilon"):
            raise Unsupported(f"{name} is not an RMSNorm")
    (q, ql), (k, kl), (v, vl), (o, ol) = (_base_linear(getattr(att, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    (g, gl), (u, ul), (d, dl) = (_base_linear(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))

    def group(mods: Sequence[tuple[torch.nn.Linear, Any | None]]) -> ProjGroup:
        lora = _lora_delta([(peft_layer, lin.out_features) for lin, peft_layer in mods], adapter, dtype, pack)
        return ProjGroup([lin.weight for lin, _ in mods], [lin.bias for lin, _ in mods], pack, stack, lora)

    qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
    return PackedLayer(
        ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
        qkv=group([(q, ql), (k, kl), (v, vl)]), o=group([(o, ol)]), gate_up=group([(g, gl), (u, ul)]),
        down=group([(d, dl)]),
        q_norm=qn.weight.detach() if qn is not None else None, k_norm=kn.weight.detach() if kn is not None else None,
    )


@torch.no_grad()
def pack_model(model: Any) -> PackedModel:
    """Pack ``model`` (a transformers model, or a peft model wrapping one) for the fast forward pass.

    Raises:
        Unsupported: the model is outside what the fast path computes exactly (module docstring).
    """
    hf, peft_model = unwrap(model)
    adapter = check_supported(hf, peft_model)
    cfg = hf.config
    device = next(hf.parameters()).device
    dtype = _plain(hf.get_input_embeddings()).weight.dtype
    if not dtype.is_floating_point:
        raise Unsupported(f"dtype {dtype}")
    pack = device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
    # Stacked q|k|v and gate|up give bit-identical results with oneDNN's prepacked bf16 kernels (tested);
    # MKL's float32 GEMV rounds a stacked matrix differently, so on the CPU in float32/float64 the
    # projections stay separate and the pass equals transformers' bit for bit.
    stack = pack or device.type == "cuda"
    inner = hf.model
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    layers = [_pack_layer(layer, adapter, dtype, pack, stack) for layer in inner.layers]
    emb_mod, head_mod = hf.get_input_embeddings(), hf.get_output_embeddings()
    head = _plain(head_mod)
    if getattr(head, "bias", None) is not None:
        raise Unsupported("an output embedding with bias")
    embed = _plain(emb_mod).weight.detach()
    embed_override = _token_override(emb_mod, adapter)
    adapter_embed = embed.index_copy(0, *embed_override) if embed_override is not None else None
    lm_head = Linear(head.weight, None, pack)
    if peft_model is not None:  # every LoRA layer of the model must be one this pass applies
        lora_layers = sum(1 for m in peft_model.modules() if hasattr(m, "lora_A") and adapter in m.lora_A)
        used = sum(g.lora.num_members for layer in layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   if g.lora is not None)
        if lora_layers != used:
            raise Unsupported(f"LoRA on {lora_layers - used} module(s) outside the attention and MLP projections")
    adapter_kind = None
    if peft_model is not None:
        adapter_kind = "alora" if getattr(peft_model.peft_config[adapter], "alora_invocation_tokens", None) else "lora"
    return PackedModel(
        source=model, device=device, dtype=dtype, num_heads=num_heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        eps=float(cfg.rms_norm_eps),
        scaling=float(getattr(inner.layers[0].self_attn, "scaling", head_dim ** -0.5)) if len(inner.layers)
        else head_dim ** -0.5,
        max_positions=getattr(cfg, "max_position_embeddings", None), rotary=inner.rotary_emb, layers=layers,
        norm=inner.norm.weight.detach(), embed=embed, adapter_embed=adapter_embed, lm_head=lm_head,
        head_override=_token_override(head_mod, adapter), adapter_kind=adapter_kind, packed=pack and lm_head.packed,
    )
