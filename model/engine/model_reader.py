"""The one reader of a model for our forward passes: a transformers (+ peft) model -> :class:`ModelRead`.

Both backends that compute a pass themselves pack from what this module reads, so they accept the same models and
refuse the others with the same words: the torch fast path (:func:`model.engine.fast_weights.pack_model`) and our
CPU kernels (:class:`model.engine.kernel_forward.KernelForward`). What it checks (:func:`read_model`):
``LlamaForCausalLM``, ``MistralForCausalLM`` (no sliding window), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` —
SiLU MLP, RMSNorm, rotary embeddings, optional q/k/v biases, Qwen3's q/k norms — unquantised, on one device, with
at most one active LoRA adapter (plain or activated) without DoRA, LoRA bias or modules_to_save, not merged, every
LoRA module on an attention or MLP projection. Anything else raises :class:`~model.errors.Unsupported`.

What it reads, per layer: the norms, the seven projections as ``(weight [out, in], bias or None, LoRA factors or
None)`` in the groups a pass computes together (q|k|v, o, gate|up, down); and the embeddings with peft's
trainable-token rows (the mask token's row, paper 3.1) where they differ from the base. Nothing is copied: the
tensors are the model's own (detached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import Unsupported

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
#: The projection groups of a layer, in pass order, and their members' module names.
GROUPS = (("qkv", ("self_attn", ("q_proj", "k_proj", "v_proj"))), ("o", ("self_attn", ("o_proj",))),
          ("gate_up", ("mlp", ("gate_proj", "up_proj"))), ("down", ("mlp", ("down_proj",))))


@dataclass
class Projection:
    """One projection ``y = x W^T (+ b)`` and its adapter.

    Attributes:
        weight: ``[out, in]`` (the model's tensor, detached); ``bias``: ``[out]`` or None.
        lora: ``(A [r, in], B [out, r] * scaling)`` of the active adapter, or None.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


@dataclass
class LayerRead:
    """One decoder layer: RMSNorm weights ``[H]``, the projection groups, Qwen3's q/k norms ``[head_dim]``."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    groups: dict[str, list[Projection]]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass
class ModelRead:
    """Everything a backend packs a model from (:func:`read_model`).

    Attributes:
        source: the model object read (a transformers model or a peft model wrapping one).
        embed: ``[V, H]`` input embedding; ``adapter_embed``: the same with peft's trained rows, for adapter
            rows (None when they agree with the base).
        head: ``[V, H]`` output embedding; ``head_override``: ``(indices [n], rows [n, H])`` of peft's trained
            output rows (None when none differ).
        adapter_kind: ``None``, ``"lora"`` (every row) or ``"alora"`` (mask rows only).
        lora_members: projections that carry the adapter.
    """

    source: Any
    device: torch.device
    dtype: torch.dtype
    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scaling: float
    max_positions: int | None
    rotary: Any
    layers: list[LayerRead]
    norm: torch.Tensor
    embed: torch.Tensor
    adapter_embed: torch.Tensor | None
    head: torch.Tensor
    head_override: tuple[torch.Tensor, torch.Tensor] | None
    adapter_kind: str | None
    lora_members: int

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.kv_heads

    @property
    def has_adapter(self) -> bool:
        """Some projection or embedding row carries the adapter."""
        return bool(self.lora_members) or self.adapter_embed is not None or self.head_override is not None


def unwrap(model: Any) -> tuple[Any, Any | None]:
    """(the transformers model, the peft model or None)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.get_base_model(), model
    return model, None


def check_supported(hf: Any, peft_model: Any | None) -> str | None:
    """Check the architecture, the weights and the adapter (module docstring); returns the active adapter's name
    (None without one).

    Raises:
        Unsupported: outside what our passes compute; the message says what.
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


def base_linear(mod: Any) -> tuple[torch.nn.Linear, Any | None]:
    """(the plain nn.Linear, the peft LoRA layer or None) of a projection.

    Raises:
        Unsupported: a projection of another type, or LoRA over a quantized / custom layer.
    """
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


def token_override(module: Any, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
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


def plain_module(module: Any) -> Any:
    """The wrapped embedding / lm_head module under peft's trainable-token wrapper."""
    layer = getattr(module, "token_adapter", None)
    return layer.base_layer if layer is not None else module


def _read_layer(layer: Any, adapter: str | None) -> LayerRead:
    att, mlp = layer.self_attn, layer.mlp
    if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        raise Unsupported(f"MLP activation {type(getattr(mlp, 'act_fn', None)).__name__}")
    for name in ("input_layernorm", "post_attention_layernorm"):
        if not hasattr(getattr(layer, name), "variance_epsilon"):
            raise Unsupported(f"{name} is not an RMSNorm")
    groups: dict[str, list[Projection]] = {}
    for group, (parent, names) in GROUPS:
        members = []
        for n in names:
            lin, peft_layer = base_linear(getattr(getattr(layer, parent), n))
            bias = lin.bias.detach() if lin.bias is not None else None
            members.append(Projection(lin.weight.detach(), bias, lora_factors(peft_layer, adapter)))
        if any(m.bias is not None for m in members) and not all(m.bias is not None for m in members):
            raise Unsupported("biases on some stacked projections only")
        groups[group] = members
    qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
    return LayerRead(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), groups,
                     qn.weight.detach() if qn is not None else None, kn.weight.detach() if kn is not None else None)


@torch.no_grad()
def read_model(model: Any) -> ModelRead:
    """Read ``model`` (a transformers model, or a peft model wrapping one) for a backend to pack.

    Raises:
        Unsupported: the model is outside what our passes compute exactly (module docstring).
    """
    hf, peft_model = unwrap(model)
    adapter = check_supported(hf, peft_model)
    cfg, inner = hf.config, hf.model
    emb_mod, head_mod = hf.get_input_embeddings(), hf.get_output_embeddings()
    dtype = plain_module(emb_mod).weight.dtype
    if not dtype.is_floating_point:
        raise Unsupported(f"dtype {dtype}")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = [_read_layer(layer, adapter) for layer in inner.layers]
    used = sum(1 for layer in layers for g in layer.groups.values() for p in g if p.lora is not None)
    adapter_kind = None
    if peft_model is not None:  # every LoRA layer of the model must be one a pass applies
        lora_layers = sum(1 for m in peft_model.modules() if hasattr(m, "lora_A") and adapter in m.lora_A)
        if lora_layers != used:
            raise Unsupported(f"LoRA on {lora_layers - used} module(s) outside the attention and MLP projections")
        adapter_kind = "alora" if getattr(peft_model.peft_config[adapter], "alora_invocation_tokens", None) else "lora"
    head = plain_module(head_mod)
    if getattr(head, "bias", None) is not None:
        raise Unsupported("an output embedding with bias")
    embed = plain_module(emb_mod).weight.detach()
    override = token_override(emb_mod, adapter)
    return ModelRead(
        source=model, device=embed.device, dtype=dtype, hidden=cfg.hidden_size, num_heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads, head_dim=head_dim,
        intermediate=layers[0].groups["gate_up"][0].out_features if layers else 0, eps=float(cfg.rms_norm_eps),
        scaling=float(getattr(inner.layers[0].self_attn, "scaling", head_dim ** -0.5)) if layers else head_dim ** -0.5,
        max_positions=getattr(cfg, "max_position_embeddings", None), rotary=inner.rotary_emb, layers=layers,
        norm=inner.norm.weight.detach(), embed=embed,
        adapter_embed=embed.index_copy(0, *override) if override is not None else None,
        head=head.weight.detach(), head_override=token_override(head_mod, adapter), adapter_kind=adapter_kind,
        lora_members=used)
