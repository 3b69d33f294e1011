"""A compact inference forward pass for Llama-family causal LMs, with MTP adapters applied per row.

:meth:`model.checkpoint.LoadedModel.forward` runs decoding passes through this module whenever it
supports the model (:func:`build_engine` says why not otherwise, and the library path — transformers,
with peft for adapters — runs instead). It computes what transformers computes, op for op and with
the same bits on the base weights (checked in bf16, float32 and float64), and differs in how:

* **weights**: on a CPU with oneDNN in bfloat16, q|k|v and gate|up are stacked into one matrix each
  and every projection and the output embedding are **prepacked** once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``). A plain ``F.linear`` in bfloat16 reorders the weight
  on every call; prepacked, a pass reads each weight once, through the same kernel (same bits). In
  float32 / float64 on a CPU the projections stay separate, unpacked (MKL rounds a stacked matrix
  differently, and packing gained nothing); on CUDA they are stacked (fewer kernel launches).
* **KV cache**: :class:`KVCache` preallocates each layer's keys and values and grows by doubling;
  a pass writes its entries in place and ``crop`` only moves the length back (transformers'
  ``DynamicCache`` concatenates, i.e. copies the whole cache, in every layer of every pass).
* **adapters**: LoRA / activated LoRA (peft's files and modules are the source) become, per layer and
  per stacked projection, one stacked ``A`` and a chunked or block-diagonal ``B`` (scaling folded in,
  float32 for a bf16 model as peft keeps them; :class:`_Lora`). A pass applies them only to the rows
  that need them: the trailing mask rows for aLoRA (``rows = num_masks``), every row for LoRA, none
  for a standard pass of an aLoRA model or with the adapter off. A pass without adapter rows costs
  exactly a plain-base pass: nothing is switched on or off per module. peft's trainable-token rows
  (the mask token's) are used in adapter passes when they differ from the base rows, as peft does.
* **attention**: ``torch.nn.functional.scaled_dot_product_attention`` with transformers' kernels and
  bits (``enable_gqa`` instead of repeated keys where that gives the same bits).

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window), ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` — SiLU MLP, RMSNorm, rotary embeddings, optional q/k/v biases, Qwen3's q/k
norms — unquantised, on one device, in eval mode, with at most one active LoRA adapter without
DoRA / LoRA bias and not merged. Anything else: :class:`Unsupported` with the reason. The pass
runs without autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
INITIAL_CAPACITY = 256  # cache positions allocated by a new KVCache; doubles when a pass needs more


class Unsupported(Exception):
    """The fast path cannot run this model; the message says why (the library path runs instead)."""


# --------------------------------------------------------------------------------- KV cache
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
        self.engine: Any = None  # the FastForward that made this cache
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


# --------------------------------------------------------------------------------- weights
class _Linear:
    """``y = x W^T (+ b)`` for 2-D ``x``, with W prepacked for oneDNN when ``packed``."""

    __slots__ = ("w", "b", "packed", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        weight = weight.detach().contiguous()
        self.out_features = weight.shape[0]
        self.b = bias.detach().contiguous() if bias is not None else None
        self.packed = False
        self.w = weight
        if pack:
            try:
                self.w = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
                self.packed = True
            except (RuntimeError, AttributeError):  # no oneDNN in this build: plain weights
                self.w = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.w, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)


class _Proj:
    """Projections of one input (q|k|v, gate|up, or a single one): one stacked matmul when ``stack``,
    else one matmul each. Returns one 2-D output per member (views of the stacked output)."""

    __slots__ = ("parts", "sizes", "stacked")

    def __init__(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], pack: bool, stack: bool):
        self.sizes = [w.shape[0] for w in weights]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise Unsupported("biases on some stacked projections only")
        self.stacked = stack and len(weights) > 1
        if self.stacked:
            bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None  # type: ignore[union-attr]
            self.parts = [_Linear(torch.cat([w.detach() for w in weights]), bias, pack)]
        else:
            self.parts = [_Linear(w, b, pack) for w, b in zip(weights, biases)]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not self.stacked:
            return [lin(x) for lin in self.parts]
        out = self.parts[0](x)
        if len(self.sizes) == 1:
            return [out]
        views, start = [out], 0
        for n in self.sizes:
            views.append(out[:, start : start + n])
            start += n
        return views  # [stacked output, member views...]


class _Lora:
    """One projection group's adapter: ``delta = (x A^T) B^T`` added to the last ``rows`` rows of the
    group's stacked output (or of each member's output when not stacked).

    Layout, chosen to read as few bytes and run as few kernels as possible (float32 for a bf16 model,
    as peft keeps them; else the model's dtype):

    * ``A``: the members' A stacked (one matmul for q|k|v), each member repeated once per output
      chunk (see B) — ``[chunks * r, in]``;
    * ``B``: each member's ``B * scaling`` cut into output chunks of one width ``c`` (the gcd of the
      members' widths: q|k|v of SmolLM2 = 3 + 1 + 1 chunks of 192), one ``bmm`` over the chunks
      — ``[chunks, r, c]``, no zero blocks. A group whose members have different ranks, or lack an
      adapter on some member, uses a block-diagonal ``B^T`` (``[sum r, out]``) instead.
    """

    __slots__ = ("a", "b", "chunks", "lin_a", "lin_b", "a_members")

    def __init__(self, members: Sequence[tuple[torch.Tensor, torch.Tensor, int]], sizes: Sequence[int],
                 dtype: torch.dtype, pack: bool = False):
        """``members``: ``(A [r, in], B [out, r] * scaling, output offset)`` of the projections that have
        an adapter; ``sizes``: the output width of every projection of the group."""
        self.a_members = len(members)
        ranks = {a.shape[0] for a, _, _ in members}
        width = math.gcd(*sizes)
        self.chunks = 0
        if len(members) == len(sizes) and len(ranks) == 1:
            r = next(iter(ranks))
            n_chunks = sum(sizes) // width
            dup_cost = (n_chunks - len(members)) * r * members[0][0].shape[1]
            zero_cost = len(members) * r * sum(sizes) - sum(r * n for n in sizes)
            if dup_cost <= zero_cost:
                self.chunks = n_chunks
        if self.chunks:
            a_rows, b_chunks = [], []
            for (a, b, _), n in zip(members, sizes):
                for j in range(n // width):
                    a_rows.append(a)
                    b_chunks.append(b[j * width : (j + 1) * width].t())
            self.a = torch.cat(a_rows).to(dtype).contiguous()
            self.b = torch.stack(b_chunks).to(dtype).contiguous()  # [chunks, r, c]
        else:
            self.a = torch.cat([a for a, _, _ in members]).to(dtype).contiguous()
            bt = torch.zeros(self.a.shape[0], sum(sizes), dtype=dtype, device=self.a.device)
            r0 = 0
            for a, b, o0 in members:
                bt[r0 : r0 + a.shape[0], o0 : o0 + b.shape[0]] = b.to(dtype).t()
                r0 += a.shape[0]
            self.b = bt  # [sum r, out]: B^T, block-diagonal
        self.lin_a = _Linear(self.a, None, pack)
        self.lin_b = _Linear(self.b[0].t() if self.chunks == 1 else self.b.t(), None, pack) \
            if self.chunks <= 1 else None

    def add_to(self, outs: Sequence[torch.Tensor], x: torch.Tensor, rows: int) -> None:
        """``outs``: the group's stacked output alone (one tensor), or one tensor per member."""
        xr = x[-rows:] if rows < x.shape[0] else x
        u = self.lin_a(xr.to(self.a.dtype))
        if self.chunks > 1:
            n, r, width = self.b.shape
            d = torch.bmm(u.view(rows, n, r).transpose(0, 1), self.b).transpose(0, 1)  # [rows, chunks, c]
            if len(outs) == 1:
                outs[0][-rows:].view(rows, n, width).add_(d)
                return
            d = d.reshape(rows, n * width)
        else:
            d = self.lin_b(u)
        if len(outs) == 1:
            outs[0][-rows:] += d
            return
        start = 0
        for out in outs:
            width = out.shape[1]
            out[-rows:] += d[:, start : start + width]
            start += width


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: _Proj
    o: _Proj
    gate_up: _Proj
    down: _Proj
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    lora: dict[str, _Lora]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, op for op (float32 statistics, then the weight in x's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --------------------------------------------------------------------------------- peft
def _unwrap(model: Any) -> tuple[Any, Any | None]:
    """(the transformers model, the peft model or None)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a requirement
        return model, None
    if isinstance(model, PeftModel):
        return model.get_base_model(), model
    return model, None


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


def _lora_group(members: Sequence[tuple[Any | None, int]], adapter: str | None, dtype: torch.dtype,
                pack: bool) -> _Lora | None:
    """The :class:`_Lora` of a projection group from its members' ``(peft LoRA layer or None,
    out_features)``; None when no member has the adapter."""
    if adapter is None:
        return None
    parts, offset = [], 0
    for layer, out_f in members:
        if layer is not None and adapter in layer.lora_A:
            if getattr(layer, "merged", False):
                raise Unsupported("the LoRA adapter is merged into the base weights")
            if layer.use_dora.get(adapter, False):
                raise Unsupported("DoRA adapters are not supported")
            if getattr(layer, "lora_bias", {}).get(adapter, False):
                raise Unsupported("LoRA biases are not supported")
            if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity) and layer.training:
                raise Unsupported("LoRA dropout in training mode")
            a = layer.lora_A[adapter].weight.detach()
            b = layer.lora_B[adapter].weight.detach() * layer.scaling[adapter]
            parts.append((a, b, offset))
        offset += out_f
    if not parts:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        # peft keeps the adapter of a bf16/fp16 model in float32 (autocast_adapter_dtype) and so do we:
        # closer to peft's logits (143 of 144 mask-row argmaxes equal on SmolLM2 against 139 with bf16
        # factors) and no slower (MKL's float32 kernels beat oneDNN's bf16 ones on matrices this small).
        return _Lora(parts, [n for _, n in members], torch.float32, False)
    return _Lora(parts, [n for _, n in members], dtype, pack)


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


# --------------------------------------------------------------------------------- engine
class FastForward:
    """The compact forward pass of one model (built by :func:`build_engine`)."""

    def __init__(self, model: Any):
        self.source = model  # the model object these structures were built from
        hf, peft_model = _unwrap(model)
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
        self.device = next(iter(devices))
        self.dtype = _plain(hf.get_input_embeddings()).weight.dtype
        if not self.dtype.is_floating_point:
            raise Unsupported(f"dtype {self.dtype}")

        adapter = None
        self.adapter_kind: str | None = None
        if peft_model is not None:
            active = list(getattr(peft_model, "active_adapters", []) or [])
            if len(active) != 1:
                raise Unsupported(f"{len(active)} active adapters (fast path: one)")
            adapter = active[0]
            pcfg = peft_model.peft_config[adapter]
            if getattr(pcfg, "peft_type", None) is None or str(pcfg.peft_type.value if hasattr(pcfg.peft_type, "value")
                                                                else pcfg.peft_type) != "LORA":
                raise Unsupported(f"peft type {pcfg.peft_type} (fast path: LoRA)")
            self.adapter_kind = "alora" if getattr(pcfg, "alora_invocation_tokens", None) else "lora"
            for name, mod in peft_model.named_modules():
                if type(mod).__name__ == "ModulesToSaveWrapper":
                    raise Unsupported(f"peft modules_to_save ({name})")

        pack = self.device.type == "cpu" and self.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
        # Stacked q|k|v and gate|up give bit-identical results with oneDNN's prepacked bf16 kernels (tested);
        # MKL's float32 GEMV rounds a stacked matrix differently, so on the CPU in float32/float64 the
        # projections stay separate and the pass equals transformers' bit for bit.
        stack = pack or self.device.type == "cuda"
        inner = hf.model
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.groups = self.num_heads // self.kv_heads
        self.eps = float(cfg.rms_norm_eps)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.rotary = inner.rotary_emb
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5)) if len(inner.layers) \
            else self.head_dim ** -0.5
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
                raise Unsupported(f"MLP activation {type(getattr(mlp, 'act_fn', None)).__name__}")
            for name in ("input_layernorm", "post_attention_layernorm"):
                if not hasattr(getattr(layer, name), "variance_epsilon"):
                    raise Unsupported(f"{name} is not an RMSNorm")
            (q, ql), (k, kl), (v, vl), (o, ol) = (_base_linear(getattr(att, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            (g, gl), (u, ul), (d, dl) = (_base_linear(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
            lora = {}
            for key, members in (("qkv", [(ql, q.out_features), (kl, k.out_features), (vl, v.out_features)]),
                                 ("o", [(ol, o.out_features)]), ("gate_up", [(gl, g.out_features), (ul, u.out_features)]),
                                 ("down", [(dl, d.out_features)])):
                grp = _lora_group(members, adapter, self.dtype, pack)
                if grp is not None:
                    lora[key] = grp
            qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                qkv=_Proj([q.weight, k.weight, v.weight], [q.bias, k.bias, v.bias], pack, stack),
                o=_Proj([o.weight], [o.bias], pack, stack),
                gate_up=_Proj([g.weight, u.weight], [g.bias, u.bias], pack, stack),
                down=_Proj([d.weight], [d.bias], pack, stack),
                q_norm=qn.weight.detach() if qn is not None else None,
                k_norm=kn.weight.detach() if kn is not None else None,
                lora=lora,
            ))
        self.norm = inner.norm.weight.detach()
        emb_mod, head_mod = hf.get_input_embeddings(), hf.get_output_embeddings()
        self.embed = _plain(emb_mod).weight.detach()
        head = _plain(head_mod)
        if getattr(head, "bias", None) is not None:
            raise Unsupported("an output embedding with bias")
        self.lm_head = _Linear(head.weight, None, pack)
        self.embed_override = _token_override(emb_mod, adapter)
        self.head_override = _token_override(head_mod, adapter)
        self.adapter_embed = None
        if self.embed_override is not None:
            idx, rows = self.embed_override
            self.adapter_embed = self.embed.index_copy(0, idx, rows)
        if peft_model is not None:  # every LoRA layer of the model must be one this pass applies
            lora_layers = sum(1 for m in peft_model.modules() if hasattr(m, "lora_A") and adapter in m.lora_A)
            used = sum(g.a_members for layer in self.layers for g in layer.lora.values())
            if lora_layers != used:
                raise Unsupported(f"LoRA on {lora_layers - used} module(s) outside the attention and MLP projections")
        self.packed = pack and self.lm_head.packed
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.has_adapter = any(layer.lora for layer in self.layers) or self.embed_override is not None \
            or self.head_override is not None

    # ------------------------------------------------------------------ cache
    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> KVCache:
        """An empty :class:`KVCache` for this model."""
        cache = KVCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity,
                        self.max_positions)
        cache.engine = self
        return cache

    def describe(self) -> str:
        """One line: what this path does (shown by the CLI, the benchmark and the app)."""
        parts = ["fast path", "prepacked oneDNN bf16" if self.packed else str(self.dtype).replace("torch.", "")]
        if self.adapter_kind:
            parts.append(f"{'aLoRA on mask rows' if self.adapter_kind == 'alora' else 'LoRA on all rows'}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, cache: KVCache, adapter_rows: int, logits_to_keep: int) -> torch.Tensor:
        """One pass over ``input_ids`` (``[1, T]``) appended to ``cache``.

        Args:
            input_ids: ``[1, T]`` token ids.
            cache: a :class:`KVCache` from :meth:`new_cache`; extended by ``T`` entries.
            adapter_rows: how many trailing rows get the LoRA delta (0: the base model).
            logits_to_keep: trailing positions to return logits for.

        Returns:
            ``[1, logits_to_keep, V]`` logits in the model's dtype.
        """
        ids = input_ids[0]
        t = ids.shape[0]
        pos = cache.length
        end = pos + t
        cache.reserve(end)
        rows = min(adapter_rows, t) if self.has_adapter else 0
        x = F.embedding(ids, self.adapter_embed if rows and self.adapter_embed is not None else self.embed)
        position_ids = torch.arange(pos, end, device=self.device)[None]
        cos, sin = self.rotary(x, position_ids)  # [1, T, hd] each, in x's dtype (transformers' own module)
        cos, sin = cos[0][:, None], sin[0][:, None]  # [T, 1, hd]: broadcast over heads
        nh, nkv, hd, g = self.num_heads, self.kv_heads, self.head_dim, self.groups
        qs = self.q_size
        # Attention as transformers computes it, through the fastest SDPA call that gives the same bits
        # (checked on this CPU for bf16 and float32): a first pass: is_causal; one query: enable_gqa;
        # several queries over a cache: a boolean causal mask with enable_gqa on the CPU (transformers
        # repeats the keys instead, the path CUDA keeps; same bits, 1.2-10x faster here). Not used:
        # one query with each KV head's g query heads as g rows is 3-7x faster on a bf16 CPU but
        # changes the bits for some cache lengths (standard decoding would leave HF generate's tokens).
        mask, causal = None, False
        repeat_kv = False
        if t > 1 and pos == 0:
            causal = True
        elif t > 1:
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device).tril_(pos)
            repeat_kv = g > 1 and self.device.type != "cpu"
        eps, scale = self.eps, self.scaling
        for i, layer in enumerate(self.layers):
            lora = layer.lora if rows else None
            h = _rms_norm(x, layer.ln1, eps)
            qkv = layer.qkv(h)
            if lora and "qkv" in lora:
                lora["qkv"].add_to(qkv[:1] if len(qkv) == 4 else qkv, h, rows)
            q, k, v = qkv[-3:]
            v = v.view(t, nkv, hd)
            if len(qkv) == 4 and layer.q_norm is None:  # q|k adjacent in one output: one rotation for both
                qk = qkv[0][:, : qs + nkv * hd].view(t, nh + nkv, hd)
                qk = qk * cos + _rotate_half(qk) * sin  # elementwise: the same bits as q and k apart
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                q, k = q.view(t, nh, hd), k.view(t, nkv, hd)
                if layer.q_norm is not None:
                    q = _rms_norm(q, layer.q_norm, eps)
                    k = _rms_norm(k, layer.k_norm, eps)
                q = q * cos + _rotate_half(q) * sin
                k = k * cos + _rotate_half(k) * sin
            kc, vc = cache.k[i], cache.v[i]
            kc[0, :, pos:end].copy_(k.transpose(0, 1))
            vc[0, :, pos:end].copy_(v.transpose(0, 1))
            keys, values = kc[:, :, :end], vc[:, :, :end]
            if repeat_kv:
                keys = keys[:, :, None].expand(1, nkv, g, end, hd).reshape(1, nh, end, hd)
                values = values[:, :, None].expand(1, nkv, g, end, hd).reshape(1, nh, end, hd)
                a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale)
            else:
                a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask,
                                                   is_causal=causal, scale=scale, enable_gqa=g > 1)
            a = a[0].transpose(0, 1).reshape(t, qs)
            (o,) = layer.o(a)
            if lora and "o" in lora:
                lora["o"].add_to((o,), a, rows)
            x = x + o
            h = _rms_norm(x, layer.ln2, eps)
            gu = layer.gate_up(h)
            if lora and "gate_up" in lora:
                lora["gate_up"].add_to(gu[:1] if len(gu) == 3 else gu, h, rows)
            gate, up = gu[-2:]
            act = F.silu(gate) * up
            (d,) = layer.down(act)
            if lora and "down" in lora:
                lora["down"].add_to((d,), act, rows)
            x = x + d
        cache.length = end
        keep = min(logits_to_keep, t) if logits_to_keep else t
        h = _rms_norm(x[-keep:], self.norm, eps)
        logits = self.lm_head(h)
        if rows and self.head_override is not None:
            idx, rows_w = self.head_override
            logits[:, idx] = F.linear(h, rows_w)
        return logits[None]


def build_engine(model: Any) -> FastForward:
    """The fast forward pass for ``model`` (a transformers model or a peft model wrapping one).

    Raises:
        Unsupported: the architecture, weights or adapter are outside the fast path (see the module
            docstring); the message says which.
    """
    with torch.no_grad():
        return FastForward(model)
