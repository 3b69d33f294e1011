"""Checks made before a model is loaded: can the engine decode it correctly, and does it fit in memory.

* :func:`check_architecture` reads the config alone. MTP decoding crops the KV cache after every pass
  (mask entries, rejected drafts). A recurrent or linear-attention layer (Mamba, RWKV, Qwen3-Next's
  gated delta net, Falcon-H1, Jamba, ...) keeps a state that cannot be cropped: such models are
  refused. A sliding-window layer can be cropped only while the cache is shorter than its window
  (transformers' ``DynamicSlidingWindowLayer``); there, attention is also plain causal attention, so
  the model is decoded with its context limited to ``window - 1`` positions (past that, a generation is
  refused with :class:`~model.errors.ContextBudgetError` instead of being decoded wrongly).
* :func:`check_memory` compares the bytes the weights will take (from the local files' safetensors
  headers, the hub's file sizes, or a preset's known size) with the free RAM (or VRAM on CUDA), before
  anything is read or downloaded. ``MTP_MEMORY_LIMIT`` (bytes, or with a K/M/G suffix) caps the free
  memory it assumes: a small deployment can refuse large models early, and tests can lower it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

log = logging.getLogger(__name__)

#: Model types whose layers keep a recurrent / linear-attention state (no KV cache to crop).
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "rwkv", "rwkv5", "rwkv6", "rwkv7", "recurrent_gemma", "jamba", "falcon_h1", "falcon_mamba",
    "zamba", "zamba2", "bamba", "granitemoehybrid", "nemotron_h", "qwen3_next", "lfm2", "lfm2_moe", "xlstm",
    "minimax", "plamo2", "kimi_linear", "olmo_hybrid",
})
#: ``config.layer_types`` values of layers without a croppable KV cache.
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"})
#: ``config.layer_types`` values of windowed attention layers.
WINDOWED_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention", "window_attention"})


def check_architecture(config: Any) -> int | None:
    """Refuse a model whose KV cache the engine cannot crop; return the context limit a windowed model
    must keep under (``window - 1`` positions), or None when the model has no window.

    Raises:
        CheckpointError: recurrent, linear-attention or hybrid layers, named in the message.
    """
    model_type = str(getattr(config, "model_type", "") or "")
    layer_types = set(getattr(config, "layer_types", None) or [])
    recurrent = sorted(layer_types & RECURRENT_LAYER_TYPES)
    if model_type in RECURRENT_MODEL_TYPES or recurrent:
        what = f"layers of type {', '.join(recurrent)}" if recurrent else f"its {model_type!r} architecture"
        raise CheckpointError(
            f"This model cannot be decoded with MTP here: {what} keep a recurrent state, not a KV cache, and MTP "
            "drops the entries of every mask token and rejected draft after each forward pass, which such a state "
            "cannot undo. Use a transformer with full (or sliding-window) attention.")
    windowed = bool(layer_types & WINDOWED_LAYER_TYPES)
    if not layer_types:  # configs without layer_types: a window is active when set (and not switched off)
        windowed = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) \
            is not False
    if not windowed:
        return None
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    if not isinstance(window, int) or window < 2:
        raise CheckpointError("This model has windowed attention layers without a usable window size in its config; "
                              "the engine cannot tell how far it may crop their KV cache.")
    return window - 1


# ------------------------------------------------------------------------------- memory
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"1500000000"`` -> bytes.

    Raises:
        ValueError: anything else.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"Not a size in bytes: {text!r} (e.g. 2G, 512M, 1500000000).")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def free_memory(device: torch.device) -> tuple[int | None, str]:
    """``(bytes free, what)`` on ``device``: CUDA's free memory, else the smaller of the machine's
    ``MemAvailable`` and the container's cgroup limit minus its usage; capped by ``MTP_MEMORY_LIMIT``.
    ``(None, what)`` when it cannot be read."""
    free: int | None = None
    if device.type == "cuda":
        try:
            free, what = int(torch.cuda.mem_get_info(device)[0]), f"GPU memory ({device})"
        except (RuntimeError, AssertionError):
            what = f"GPU memory ({device})"
    else:
        what = "RAM"
        free = _mem_available()
        limit = _cgroup_room()
        if limit is not None:
            free = limit if free is None else min(free, limit)
    cap = os.environ.get("MTP_MEMORY_LIMIT")
    if cap:
        free = parse_bytes(cap) if free is None else min(free, parse_bytes(cap))
        what += " (capped by MTP_MEMORY_LIMIT)"
    return free, what


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """The container's memory limit minus its usage (cgroup v2, then v1); None without a limit."""
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            return max(0, int(raw) - int(Path(usage_f).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def _safetensors_params(path: Path) -> int:
    """Parameters in a safetensors file, from its header alone."""
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
    return total


def _local_params(directory: Path) -> int | None:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return sum(_safetensors_params(f) for f in files)
    bins = sorted(directory.glob("*.bin"))
    if bins:  # pickled weights: no header to read; assume the config's dtype (bf16 when it names none)
        try:
            cfg = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        itemsize = 4 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "").endswith("float32") else 2
        return sum(f.stat().st_size for f in bins) // itemsize
    return None


def _gguf_params(path: Path) -> int | None:
    try:
        from gguf import GGUFReader

        return int(sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors))
    except Exception as e:  # noqa: BLE001 - an unreadable file fails later with the loader's own message
        log.info("could not count the parameters of %s: %s", path, e)
        return None


def _hub_params(repo_id: str) -> int | None:
    """Parameters of a hub model from its file sizes (no download; None offline or on error). Weight files
    are assumed to be bf16 / fp16 (2 bytes a parameter), as published LLM checkpoints are."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - no network, gated repo, ...: the loader reports it
        log.info("could not ask the hub for the size of %s: %s", repo_id, e)
        return None
    files = [s for s in info.siblings or [] if s.size and "/" not in s.rfilename]
    weights = [s for s in files if s.rfilename.endswith(".safetensors")] or \
        [s for s in files if s.rfilename.endswith(".bin")]
    return sum(s.size for s in weights) // 2 if weights else None


def weights_bytes(kind: str, where: str, dtype: torch.dtype, quantization: str | None,
                  preset_bytes: int = 0) -> int | None:
    """Bytes the weights of a source take once loaded in ``dtype`` (or 4 / 8-bit), None when unknown.

    Args:
        kind, where: the resolved source (:class:`~model.engine.loading.Source`).
        preset_bytes: a preset's known bf16 size, used when the hub cannot be asked.
    """
    params: int | None = None
    if kind in ("hf_dir", "mtp_dir"):
        params = _local_params(Path(where))
    elif kind == "gguf":
        params = _gguf_params(Path(where))
    elif kind == "hub":
        params = _hub_params(where)
        if params is None and preset_bytes:
            params = preset_bytes // 2
    if params is None:
        return None
    per = {"4bit": 0.5, "8bit": 1.0}.get(quantization or "", torch.tensor([], dtype=dtype).element_size())
    return int(params * per)


def check_memory(name: str, need: int | None, device: torch.device) -> None:
    """Refuse a model whose weights (``need`` bytes) exceed the free memory of ``device``.

    Raises:
        CheckpointError: naming both numbers.
    """
    if need is None:
        return
    free, what = free_memory(device)
    if free is not None and need > free:
        raise CheckpointError(
            f"{name} needs {need / 1e9:.1f} GB for its weights, but only {free / 1e9:.1f} GB of {what} is free: "
            "not loaded (nothing was downloaded). Choose a smaller model, a 4bit/8bit quantization on a GPU, or a "
            "machine with more memory.")
