"""The on-disk format of a trained MTP checkpoint: one writer, one reader.

:func:`save_mtp_checkpoint` (called by training) writes a directory that
:func:`model.engine.loading.load_checkpoint` reads back through :func:`read_meta`,
:func:`load_mask_rows` and peft. Every MTP directory holds ``mtp_adapter.json``:

``base``
    the source of the base model (``smollm2-135m``, a local path, a hub id); for ``full``, the
    model the run started from (informative: the weights are in the directory itself).
``adapter``
    ``"alora"`` (activated LoRA: real tokens run on the base weights, mask positions through the
    adapter), ``"lora"`` (the adapter acts on every token) or ``"full"`` (a whole model).
``mask_token``
    the name of the mask token (paper 3.1), looked up in the tokenizer by name.
``prompt_format``
    ``"chat"`` or ``"bos_newlines"`` (how prompts were laid out in training).
``k_max``
    the largest block size trained with: a sensible default ``k_max`` for decoding.

Adapters (``lora`` / ``alora``) also hold peft's ``adapter_config.json`` and
``adapter_model.safetensors`` (LoRA weights and the mask row's trainable-token delta) and
``mask_rows.safetensors``: ``embed`` ``[1, H]``, the mask token's input embedding row as the trained
model sees it (with tied embeddings it is also the output row; ``lm_head`` ``[1, H]`` when untied).
The base's embedding is never saved whole. A ``full`` directory is an ordinary Hugging Face model
directory (config, safetensors, tokenizer with the mask token) plus ``mtp_adapter.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

DEFAULT_MASK_TOKEN = "<|mtp_special_token_0|>"  # the authors' name for the mask token (paper 3.1)
META_FILE = "mtp_adapter.json"
MASK_ROWS_FILE = "mask_rows.safetensors"
KINDS = ("full", "lora", "alora")


@dataclass(frozen=True)
class MTPMeta:
    """The contents of ``mtp_adapter.json`` (see the module docstring for each field)."""

    base: str
    adapter: str
    mask_token: str
    prompt_format: str | None = None
    k_max: int | None = None

    @property
    def is_adapter(self) -> bool:
        """True for ``lora`` / ``alora`` (peft files on top of ``base``); False for ``full``."""
        return self.adapter != "full"


def is_mtp_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory holding ``mtp_adapter.json``."""
    return (Path(path) / META_FILE).is_file()


def read_meta(path: str | Path) -> MTPMeta:
    """Read and check ``path/mtp_adapter.json``.

    Raises:
        CheckpointError: unreadable JSON, no ``base``, an unknown adapter kind, or an adapter kind
            whose peft files are missing.
    """
    path = Path(path)
    try:
        raw = json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"Cannot read {path / META_FILE}: {e}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("base"), str):
        raise CheckpointError(f"{path / META_FILE} does not name its base model ('base').")
    kind = raw.get("adapter", "lora")
    if kind not in KINDS:
        raise CheckpointError(f"{path / META_FILE}: unknown adapter kind {kind!r} (known: {', '.join(KINDS)}).")
    if kind != "full" and not (path / "adapter_config.json").is_file():
        raise CheckpointError(f"{path} says adapter {kind!r} but has no adapter_config.json.")
    if kind == "full" and not (path / "config.json").is_file():
        raise CheckpointError(f"{path} says adapter 'full' but has no config.json (model weights).")
    return MTPMeta(base=raw["base"], adapter=kind, mask_token=raw.get("mask_token", DEFAULT_MASK_TOKEN),
                   prompt_format=raw.get("prompt_format"), k_max=raw.get("k_max"))


def load_mask_rows(model: Any, path: str | Path, mask_token_id: int) -> None:
    """Copy the trained mask-token rows of ``path/mask_rows.safetensors`` into ``model``'s embeddings
    (input row; output row too when untied and saved). No file: nothing changes."""
    from safetensors.torch import load_file

    rows_path = Path(path) / MASK_ROWS_FILE
    if not rows_path.is_file():
        return
    rows = load_file(str(rows_path))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[mask_token_id].copy_(rows["embed"].reshape(-1).to(emb))
        out = model.get_output_embeddings()
        if "lm_head" in rows and out is not None and out.weight.data_ptr() != emb.data_ptr():
            out.weight[mask_token_id].copy_(rows["lm_head"].reshape(-1).to(out.weight))


def save_mtp_checkpoint(
    out_dir: str | Path,
    model: Any,
    meta: MTPMeta,
    *,
    mask_token_id: int,
    tokenizer: Any = None,
    save_dtype: torch.dtype = torch.bfloat16,
    state_dict: dict | None = None,
) -> Path:
    """Write a trained MTP model so that ``load_checkpoint(out_dir)`` decodes it.

    Args:
        out_dir: the directory (created).
        model: for ``full`` the model; for ``lora`` / ``alora`` the peft model (adapter enabled).
        meta: what goes into ``mtp_adapter.json``.
        mask_token_id: the mask token's id (its trained rows go into ``mask_rows.safetensors``).
        tokenizer: saved with a ``full`` model (it carries the mask token); unused for adapters.
        save_dtype: dtype of the saved floating-point weights.
        state_dict: the weights to save (e.g. gathered by accelerate); default ``model.state_dict()``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        CheckpointError: an unknown adapter kind.
    """
    from safetensors.torch import save_file

    if meta.adapter not in KINDS:
        raise CheckpointError(f"Unknown adapter kind {meta.adapter!r} (known: {', '.join(KINDS)}).")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = state_dict if state_dict is not None else model.state_dict()
    if meta.adapter == "full":
        sd = {k: v.detach().to(save_dtype) if v.is_floating_point() else v for k, v in sd.items()}
        model.save_pretrained(str(out), state_dict=sd)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    else:
        sd = {k: v.detach().to(save_dtype) if v.is_floating_point() else v for k, v in sd.items()
              if "lora_" in k or "trainable_tokens" in k}
        # The resized embedding is not saved whole: the mask row travels in mask_rows.safetensors and in
        # peft's trainable-token delta.
        model.save_pretrained(str(out), state_dict=sd, save_embedding_layers=False)
        with torch.no_grad():  # the mask row as the adapter-enabled model sees it
            ids = torch.tensor([mask_token_id], device=next(model.parameters()).device)
            row = model.get_input_embeddings()(ids).detach().float().cpu().contiguous()
        save_file({"embed": row}, str(out / MASK_ROWS_FILE))
    (out / META_FILE).write_text(json.dumps(asdict(meta), indent=1, allow_nan=False))
    return out
