"""The loaded-model handle every consumer uses: :class:`LoadedModel` (paper 3.1, 3.4).

It holds the model (a transformers model, or a peft model carrying an MTP adapter), its tokenizer,
the mask token, the stop tokens and the prompt format, and offers what decoding, training, the
evaluation and the app need of a model: prompt ids (untrusted text kept literal), one forward pass
over a KV cache on the fast path or the library path, and the base model with the adapter off (the
teacher). Loading a source into a handle is :mod:`model.engine.loading`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .backend import LibraryForward, PassInput
from .strategies import DEFAULT_K_MAX
from .threads import serial_torch
from .text import TokenBytes, chat_prompt_ids, encode_literal
from .weights_signature import WeightsSignature

log = logging.getLogger(__name__)

PROMPT_FORMATS = ("chat", "bos_newlines")


class _FastState:
    """The fast path's inference structures for one model object, shared by ``dataclasses.replace``
    copies of a :class:`LoadedModel`, and the adapter-off depth of :meth:`LoadedModel.base_model`."""

    def __init__(self, adapter_off: int = 0) -> None:
        self.engine: Any = None
        self.model: Any = None  # the model object that engine (or reason) belongs to
        self.signature: tuple[int, ...] | None = None
        self.weights = WeightsSignature()
        self.reason: str | None = "not built yet"
        self.kernel_note: str | None = None  # why our kernels do not run this model, when they do not
        self.adapter_off = adapter_off

    def engine_for(self, model: Any) -> Any:
        """The engine of ``model``; built again when the model object or its weights changed (an
        optimizer step bumps the tensors' versions; a swapped tensor changes its address; a replaced parameter or
        module changes its id: :class:`~model.engine.weights_signature.WeightsSignature`)."""
        sig = self.weights(model)
        if self.model is model and self.signature == sig:
            return self.engine
        from ..errors import Unsupported
        from .fast_forward import build_engine
        from .kernel_forward import build_kernel_engine

        self.engine, self.model, self.signature = None, model, sig
        self.kernel_note = None
        try:  # our kernels first (CPU, bf16 / float32), then the torch fast path
            self.engine = build_kernel_engine(model)
        except Unsupported as e:
            self.kernel_note = f"our kernels not used: {e}"
            log.info("Kernel path not used: %s", e)
        if self.engine is not None:
            self.reason = None
            return self.engine
        try:
            self.engine = build_engine(model)
            self.reason = None
        except Unsupported as e:
            self.reason = str(e)
            log.info("Fast forward path not used: %s", e)
        return self.engine


@dataclass
class LoadedModel:
    """A causal LM ready for MTP decoding or training.

    Attributes:
        model: the ``PreTrainedModel`` (or a peft ``PeftModel`` wrapping it), in eval mode.
        tokenizer: its tokenizer, with the mask token in the vocabulary.
        mask_token_id: id of the mask token (paper 3.1).
        stop_token_ids: every EOS id of the model (tokenizer and generation config).
        prompt_format: ``"chat"`` (the tokenizer's chat template) or ``"bos_newlines"``
            (``bos + question + "\\n\\n"``, as the authors' Qwen3 checkpoint was trained).
        source: the source string this was loaded from.
        mtp_trained: False when the mask token had to be added here (untrained proposals).
        adapter: ``None``, ``"lora"`` or ``"alora"`` — the kind of MTP adapter on top of the base.
        warnings: human-readable notes for the user (shown by the CLI and the app).
        device: where the weights live.
        trained_k_max: the largest block size the MTP adapter was trained with (from its
            metadata), a sensible default k_max for decoding; None when unknown.
        fast: run decoding passes through :mod:`model.engine.fast_forward` when it supports the model
            (default); False: always the library path (transformers, with peft for adapters).
        stop_strings: text that ends an answer (the output keeps it, as transformers' ``stop_strings``).
        context_limit: positions a generation may use at most, below ``max_position_embeddings``
            (a sliding-window model's window; :mod:`model.engine.guards`); None: no such limit.
        checkpoint_dir: the MTP directory (adapter or full model) this was loaded from, a ``Path``; None
            for a model without one. It may hold the checkpoint's measured sweep (``sweep.json``).
    """

    model: Any
    tokenizer: Any
    mask_token_id: int
    stop_token_ids: tuple[int, ...]
    prompt_format: str
    source: str
    mtp_trained: bool
    adapter: str | None = None
    warnings: list[str] = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    trained_k_max: int | None = None
    fast: bool = True
    stop_strings: tuple[str, ...] = ()
    context_limit: int | None = None
    checkpoint_dir: Any = None
    _token_bytes: Any = field(default=None, repr=False, compare=False)
    _token_texts: dict = field(default_factory=dict, repr=False, compare=False)
    # Shared by dataclasses.replace() copies of this object (same model, same inference structures).
    _fast: "_FastState" = field(default_factory=lambda: _FastState(), repr=False, compare=False)

    def decode_ids(self, ids: Sequence[int]) -> str:
        """``tokenizer.decode(ids)``; a single id's text is cached (a verify pass's record decodes a dozen single
        tokens: its proposals, drafts and blocks)."""
        if len(ids) != 1:
            return self.tokenizer.decode(list(ids))
        t = int(ids[0])
        text = self._token_texts.get(t)
        if text is None:
            text = self._token_texts[t] = self.tokenizer.decode([t])
        return text

    @property
    def token_bytes(self) -> Any:
        """A :class:`model.engine.text.TokenBytes` for this tokenizer: ``lm.token_bytes(id) -> bytes``."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    @property
    def default_k_max(self) -> int:
        """k_max to decode with when none is given: the adapter's trained k_max, else
        :data:`model.engine.strategies.DEFAULT_K_MAX`."""
        return self.trained_k_max or DEFAULT_K_MAX

    @property
    def max_positions(self) -> int | None:
        """Positions a sequence may use: the model's ``max_position_embeddings``, within
        :attr:`context_limit`; None if unknown."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        n = n if isinstance(n, int) and n > 0 else None
        if self.context_limit is not None:
            n = self.context_limit if n is None else min(n, self.context_limit)
        return n

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights compute in (``torch.bfloat16``, ``torch.float32``, ...)."""
        dt = getattr(self.model, "dtype", None)
        return dt if isinstance(dt, torch.dtype) else next(self.model.parameters()).dtype

    @property
    def real_tokens_run_base(self) -> bool:
        """Whether real (non-mask) tokens always run the base weights (no adapter, or aLoRA, whose adapter acts
        on the mask rows only): then standard decoding is the teacher's greedy decoding and its KV cache the
        teacher's (:func:`model.engine.scoring.teacher_logprob` may reuse it). False for LoRA (every row)."""
        return self.adapter != "lora"

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"``, ``"float32"``, ... (for headers and reports)."""
        return str(self.dtype).replace("torch.", "")

    def fast_engine(self) -> Any:
        """The :class:`model.engine.fast_forward.FastForward` of this model, built on first use and rebuilt when
        the model object or its weights changed since; None when the fast path is off, the model is in
        training mode, or the fast path does not support it (:attr:`forward_path` says why)."""
        if not self.fast or os.environ.get("MTP_FAST") == "0":
            return None
        model = self.model
        if getattr(model, "training", False):
            return None
        if self._fast.model is not None and self._fast.model is not model:
            # replace(lm, model=other) copied the state of another model: this object gets its own.
            self._fast = _FastState(adapter_off=self._fast.adapter_off)
        return self._fast.engine_for(model)

    @property
    def forward_path(self) -> str:
        """Which implementation :meth:`forward` uses for decoding, in words (CLI, benchmark, app header)."""
        engine = self.fast_engine()
        if engine is not None:
            desc = engine.describe()
            if engine.kind != "kernels":
                from .kernels import status

                desc += f" ({self._fast.kernel_note or status().reason})"
            return desc
        if not self.fast or os.environ.get("MTP_FAST") == "0":
            return "library path (transformers + peft): fast path switched off"
        if getattr(self.model, "training", False):
            return "library path (transformers + peft): model in training mode"
        return f"library path (transformers + peft): {self._fast.reason}"

    def new_cache(self) -> Any:
        """An empty KV cache for :meth:`forward` from :meth:`backend`: a :class:`model.engine.kv_cache.KVCache` on
        our kernels and the fast path, else a transformers ``DynamicCache``. Either has ``get_seq_length()``,
        ``crop(n)`` and ``layers[i].keys`` / ``.values``."""
        return self.backend().new_cache()

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, messages: str | Sequence[dict]) -> list[int]:
        """Token ids of a prompt, ready for the first forward pass.

        Args:
            messages: a user message (str) or a chat history in the messages format
                (``[{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]``),
                ending with a user turn.

        Returns:
            The prompt as a list of token ids (``prompt_len`` tokens), formatted with the
            model's prompt format and ending where the assistant's answer begins.

        Message contents are text, never markup: a message that spells a special token (the mask
        token, ``<|im_end|>``, ...) is tokenised as those characters (:mod:`model.engine.text`).

        Raises:
            ValueError: empty prompt, a malformed message, a history whose last turn is not the
                user's, or a chat template that rewrites message text.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = list(messages)
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(
                    m.get("content"), str):
                raise ValueError("Each message must be {'role': 'system' | 'user' | 'assistant', 'content': text}, "
                                 f"got {str(m)[:80]!r}.")
        if not messages or messages[-1].get("role") != "user":
            raise ValueError("The prompt must end with a user message.")
        if not str(messages[-1].get("content", "")).strip():
            raise ValueError("The prompt is empty: type a question first.")
        tok = self.tokenizer
        if self.prompt_format == "chat" and getattr(tok, "chat_template", None):
            return chat_prompt_ids(tok, [{"role": m.get("role"), "content": str(m.get("content", ""))}
                                         for m in messages])
        # bos_newlines: bos + question + "\n\n" (turns joined the same way); no markup but the BOS id
        return self.literal_ids("".join(str(m["content"]) + "\n\n" for m in messages))

    def literal_ids(self, text: str) -> list[int]:
        """``text`` tokenised literally (a substring that spells a special token stays characters),
        after the BOS id when the prompt format is ``bos_newlines`` and the tokenizer has one: how a
        ``bos_newlines`` model sees raw text (its prompts, lm-eval's contexts)."""
        ids = encode_literal(self.tokenizer, text)
        bos = self.tokenizer.bos_token_id
        if self.prompt_format == "bos_newlines" and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    # ---------------------------------------------------------------- forward
    def backend(self) -> Any:
        """The forward-pass backend of new caches (:mod:`model.engine.backend`): our kernels or the torch fast
        path when :meth:`fast_engine` builds one, else the library path (transformers + peft)."""
        return self.fast_engine() or self._library()

    def _library(self) -> LibraryForward:
        return LibraryForward(self.model, self.adapter, bool(self._fast.adapter_off), self.dtype, self.device)

    def backend_of(self, cache: Any) -> Any:
        """The backend that owns ``cache`` (a fast-path ``KVCache`` names its engine; anything else is the library's).

        Raises:
            RuntimeError: a ``KVCache`` of another model.
        """
        from .kv_cache import KVCache

        if not isinstance(cache, KVCache):
            return self._library()
        if cache.engine is None or cache.engine.source is not self.model:
            raise RuntimeError("This KV cache was made for another model; start a new generation (lm.new_cache()).")
        return cache.engine

    def pass_input(self, tokens: Any, cache: Any, num_masks: int = 0, logits_to_keep: int = 0,
                   positions: Sequence[int] | None = None, visible: torch.Tensor | None = None) -> PassInput:
        """A :class:`~model.engine.backend.PassInput` for one sequence, its adapter rows set: the trailing masks
        for aLoRA, every row for LoRA, none without an adapter or inside :meth:`base_model`.

        Args:
            tokens: ``[T]`` (or ``[1, T]``) token ids, or a list: real tokens not yet cached, then ``num_masks``
                mask tokens.
            cache, num_masks, logits_to_keep, positions, visible: see :class:`~model.engine.backend.PassInput`.

        Raises:
            ValueError: an empty pass or counts outside the tokens.
        """
        inp = PassInput(tokens, cache, num_masks, 0, logits_to_keep, positions, visible)
        n = int(inp.tokens.shape[0])
        if self.adapter is not None and not self._fast.adapter_off:
            inp.adapter_rows = num_masks if self.adapter == "alora" else n
        return inp

    def forward_batch(self, inputs: Sequence[PassInput]) -> list[torch.Tensor]:
        """One forward pass over several sequences' rows (:mod:`model.engine.backend`): on our kernels one pass over
        the weights for all of them, elsewhere one after the other; every row computes what it would alone.

        Args:
            inputs: from :meth:`pass_input`; every cache from this model's :meth:`new_cache` (one backend).

        Returns:
            One ``[logits_rows_i, V]`` logits tensor per input (model dtype); each cache extended by its ``T_i`` entries.

        Raises:
            ValueError: no inputs, or caches of different backends; RuntimeError: a cache of another model, or
            our kernels refused the shapes.
        """
        if not inputs:
            raise ValueError("forward_batch needs at least one sequence")
        backend = self.backend_of(inputs[0].cache)
        for p in inputs[1:]:
            if type(self.backend_of(p.cache)) is not type(backend):
                raise ValueError("forward_batch: every cache must come from the same backend")
        if isinstance(backend, LibraryForward):
            return backend.forward_batch(inputs)
        with torch.no_grad():
            return backend.forward_batch(inputs)

    def engine_step(self, cache: Any) -> contextlib.AbstractContextManager:
        """The context one engine step on ``cache`` runs in (a forward pass and the acceptance of its proposals):
        on our kernels :func:`~model.engine.threads.serial_torch` (torch's ops on the calling thread, the threads
        to our pool: an idle OpenMP thread spinning beside it halved a two-thread pass's speed), elsewhere nothing.

        Raises:
            RuntimeError: a cache of another model.
        """
        return serial_torch() if self.backend_of(cache).kind == "kernels" else contextlib.nullcontext()

    def forward(self, input_ids: torch.Tensor, past_key_values: Any, num_masks: int, logits_to_keep: int,
                positions: Sequence[int] | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass of one sequence: :meth:`forward_batch` of one :meth:`pass_input`.

        Real tokens run on the base weights with an activated (aLoRA) adapter: only the trailing ``num_masks`` rows
        get the adapter's delta; a LoRA adapter acts on every row. The cache's backend computes it: our kernels or
        the fast path for a ``KVCache``, the library path (transformers + peft) for a transformers ``Cache``; they
        give the same logits (bit for bit on the base weights; within bf16/fp32 rounding on adapter rows, see the
        backends' tests). Only the library path keeps autograd.

        Args:
            input_ids: ``[1, T]`` long tensor: the real tokens not yet cached, then ``num_masks`` mask tokens.
            past_key_values: a cache from :meth:`new_cache`; extended in place by ``T`` entries.
            num_masks: how many trailing inputs are mask tokens (for activated adapters).
            logits_to_keep: how many trailing positions need logits (0: all).
            positions: each input's position offset after the cached entries (None: ``0 .. T-1``); a tree of mask
                blocks puts several inputs at one position (:class:`~model.engine.phases.PassLayout`).
            visible: ``[T, T]`` bool, which inputs each input attends to besides the cache (None: causal).

        Returns:
            ``[1, logits_to_keep, V]`` logits (model dtype).
        """
        inp = self.pass_input(input_ids, past_key_values, num_masks, logits_to_keep, positions, visible)
        return self.forward_batch([inp])[0][None]

    @contextlib.contextmanager
    def base_model(self) -> Iterator[Any]:
        """Context in which the model runs with any MTP adapter disabled (the teacher): calls of
        ``self.model`` (peft's ``disable_adapter``) and :meth:`forward` on either path.

        Yields the model. Without an adapter this is the model itself (unchanged).
        """
        if self.adapter is None:
            yield self.model
            return
        self._fast.adapter_off += 1
        try:
            with self.model.disable_adapter():
                yield self.model
        finally:
            self._fast.adapter_off -= 1

    def without_adapter(self) -> "LoadedModel":
        """A view of this model that decodes with the base weights only (shares the weights and
        the fast path's structures): ``dataclasses.replace(self, adapter=None)``. Decode with it
        inside :meth:`base_model` on the library path (peft's adapter off)."""
        return dataclasses.replace(self, adapter=None)

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (``V``), mask token included."""
        return self.model.get_output_embeddings().weight.shape[0]
