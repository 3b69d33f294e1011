"""The forward-pass backends behind :meth:`model.engine.loaded_model.LoadedModel.forward_batch` (paper 3.1, 3.4).

Every forward pass of decoding, of the batch runner, of the width measurement and of the teacher's scoring goes
through one entry, ``forward_batch(list[PassInput]) -> list[logits]``; a single sequence is a batch of one. Three
backends implement it, chosen once per model (:meth:`LoadedModel.backend`):

=====================================================  ==========================================================
backend                                                where
=====================================================  ==========================================================
:class:`~model.engine.kernel_forward.KernelForward`    our CPU kernels (bf16 / float32): one pass over the weights
                                                       for every row of every sequence (``shares_passes``)
:class:`~model.engine.fast_forward.FastForward`        torch ops, prepacked oneDNN weights (CPU fallback, CUDA):
                                                       the sequences one after the other
:class:`LibraryForward`                                transformers + peft (any model, training mode, float16 ...)
=====================================================  ==========================================================

Each says which it is (``kind``: ``"kernels"``, ``"fast"``, ``"library"``). The first two pack from one reader of the model (:mod:`model.engine.model_reader`) and keep their KV cache in
:class:`~model.engine.kv_cache.KVCache` (whose ``engine`` names its backend); the library path keeps a transformers
``DynamicCache``. A :class:`PassInput` says what one sequence feeds: tokens, which trailing rows are mask tokens
(and so, for an activated adapter, which rows run the adapter), the logits to keep, and for a tree of mask blocks
the positions and the visibility mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class PassInput:
    """One sequence's rows of a forward pass.

    Attributes:
        tokens: ``[T]`` token ids (int64): pending real tokens, drafts, then ``num_masks`` mask tokens.
        cache: the sequence's KV cache (from :meth:`LoadedModel.new_cache`); the pass extends it by ``T`` entries,
            in input order whatever their positions.
        num_masks: trailing mask rows (paper 3.1).
        adapter_rows: trailing rows that run the MTP adapter (:meth:`LoadedModel.pass_input` sets it: the mask
            rows for aLoRA, every row for LoRA, none without an adapter or inside ``base_model()``).
        logits_to_keep: trailing rows to return logits for (0: all).
        positions: per token, its position offset after the cache (None: ``0 .. T-1``).
        visible: ``[T, T]`` bool, which fed tokens each token attends to besides the cache (None: causal).
    """

    tokens: torch.Tensor
    cache: Any
    num_masks: int = 0
    adapter_rows: int = 0
    logits_to_keep: int = 0
    positions: Sequence[int] | None = None
    visible: torch.Tensor | None = None

    def __post_init__(self) -> None:
        t = self.tokens
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(list(t), dtype=torch.long)
        self.tokens = t.reshape(-1)
        n = int(self.tokens.shape[0])
        if n == 0:
            raise ValueError("A pass must feed at least one token.")
        if not 0 <= self.num_masks <= n or not 0 <= self.adapter_rows <= n or self.logits_to_keep < 0:
            raise ValueError(f"Bad pass input: {n} tokens, {self.num_masks} masks, {self.adapter_rows} adapter rows, "
                             f"{self.logits_to_keep} logits to keep.")

    @property
    def logits_rows(self) -> int:
        """Rows whose logits the pass returns."""
        n = int(self.tokens.shape[0])
        return min(self.logits_to_keep, n) if self.logits_to_keep else n


def tree_inputs(t: int, cached: int, positions: Sequence[int] | None, visible: torch.Tensor | None,
                dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """transformers' inputs for a pass laid out as a tree: ``position_ids`` ``[1, T]`` and a float 4D
    ``attention_mask`` ``[1, 1, T, cached + T]`` (0 where attended, the dtype's minimum elsewhere; every
    input sees the whole cache)."""
    pos = torch.arange(t) if positions is None else torch.tensor(list(positions))
    see = torch.ones(t, t, dtype=torch.bool).tril_() if visible is None else visible.to(torch.bool).cpu()
    see = torch.cat([torch.ones(t, cached, dtype=torch.bool), see], dim=1)
    mask = torch.zeros(1, 1, t, cached + t, dtype=dtype)
    mask.masked_fill_(~see[None, None], torch.finfo(dtype).min)
    return {"position_ids": (pos + cached)[None].to(device), "attention_mask": mask.to(device)}


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel``."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


class LibraryForward:
    """The library path: transformers' own forward pass, with peft for the adapter; the sequences of a batch run
    one after the other. Autograd stays as the caller has it (training scores through here).

    Args:
        model: the transformers model or peft model.
        adapter: the adapter kind (``"alora"`` gets peft's ``alora_offsets`` = the mask rows).
        adapter_off: True inside :meth:`LoadedModel.base_model` (peft's adapter is already off).
        dtype, device: the model's compute dtype (of a tree's float mask) and device.
    """

    shares_passes = False
    kind = "library"

    def __init__(self, model: Any, adapter: str | None, adapter_off: bool, dtype: torch.dtype, device: torch.device):
        self.source, self.adapter, self.adapter_off = model, adapter, adapter_off
        self.dtype, self.device = dtype, device

    def new_cache(self) -> Any:
        """An empty transformers ``DynamicCache``."""
        from transformers import DynamicCache

        return DynamicCache(config=getattr(self.source, "config", None))

    def forward_batch(self, inputs: Sequence[PassInput]) -> list[torch.Tensor]:
        """Each input's pass (``[logits_rows_i, V]`` logits in the model's dtype), one after the other."""
        return [self._one(p) for p in inputs]

    def _one(self, p: PassInput) -> torch.Tensor:
        model = self.source
        ids = p.tokens.to(self.device)[None]
        kwargs: dict[str, Any] = {}
        if p.positions is not None or p.visible is not None:
            kwargs.update(tree_inputs(ids.shape[1], p.cache.get_seq_length(), p.positions, p.visible, self.dtype,
                                      self.device))
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if is_peft(model):
            if p.adapter_rows == 0:  # the base weights: peft's adapter off for this pass (unless base_model() did it)
                if not self.adapter_off:
                    ctx = model.disable_adapter()
            elif self.adapter == "alora":
                kwargs["alora_offsets"] = [p.num_masks]
        with ctx:
            out = model(input_ids=ids, past_key_values=p.cache, use_cache=True, logits_to_keep=p.logits_rows, **kwargs)
        return out.logits[0]
