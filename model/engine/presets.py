"""What the authors' released MTP checkpoints need, by name: zero setup for a user (paper 4.5).

The authors' own ``generate(do_mtp=True, mask_id=..., eos_id=[...])`` makes every user pass the mask
token's id, the stop ids and the prompt format by hand, and they differ per checkpoint:

==================================  ===========  ======================================  ==============
checkpoint (hub id)                 mask id      stop tokens                             prompt format
==================================  ===========  ======================================  ==============
``jwkirchenbauer/L3-1-8B-Magpie-    128259       ``<|end_of_text|>`` ``<|eot_id|>``      the chat
MTP``                                            (128001, 128009)                        template
``jwkirchenbauer/Qwen3-4B-Inst-     151669       ``<|im_end|>`` ``<|endoftext|>``        ``bos + question
2507-MTP``                                       (151645, 151643)                        + "\\n\\n"``
==================================  ===========  ======================================  ==============

Both add 32 special tokens ``<|mtp_special_token_0|>`` ... ``_31|>`` and use only the first as the
mask. The Qwen3 checkpoint was trained without a chat template although its tokenizer has one, so the
rule "chat when the tokenizer has a template" would pick the wrong format for it. A :class:`Preset`
carries this per-checkpoint knowledge; :func:`find_preset` applies it from the hub id (also inside a
local path or the config's ``_name_or_path``) or, for a renamed copy, from the config and tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MTP_TOKENS = 32  # the authors add <|mtp_special_token_0|> ... <|mtp_special_token_31|>


@dataclass(frozen=True)
class Preset:
    """Per-checkpoint settings that :func:`model.engine.loading.load_checkpoint` applies.

    Attributes:
        name: short name shown to users.
        hub_id: the checkpoint's Hugging Face Hub id.
        model_type: the config's ``model_type``; ``vocab_size``: its vocabulary rows (config match).
        mask_token: the mask token's name (looked up in the tokenizer, never a hard-coded id).
        stop_tokens: names of every token that ends an answer.
        prompt_format: ``chat`` or ``bos_newlines``.
        stop_strings: text that ends an answer although no stop token came (none needed for these two:
            their stop tokens cover how they end).
        k_max: the block size the authors decode with.
        weight_bytes: the weights in bfloat16 (approximate), for the memory check before a download
            when the hub cannot be asked.
    """

    name: str
    hub_id: str
    model_type: str
    vocab_size: int
    mask_token: str
    stop_tokens: tuple[str, ...]
    prompt_format: str
    stop_strings: tuple[str, ...] = ()
    k_max: int = 16
    weight_bytes: int = 0


PRESETS: tuple[Preset, ...] = (
    Preset(name="L3.1-8B-Magpie-MTP", hub_id="jwkirchenbauer/L3-1-8B-Magpie-MTP", model_type="llama",
           vocab_size=128384, mask_token="<|mtp_special_token_0|>", stop_tokens=("<|end_of_text|>", "<|eot_id|>"),
           prompt_format="chat", weight_bytes=16_060_000_000),
    Preset(name="Qwen3-4B-Instruct-2507-MTP", hub_id="jwkirchenbauer/Qwen3-4B-Inst-2507-MTP", model_type="qwen3",
           vocab_size=151936, mask_token="<|mtp_special_token_0|>", stop_tokens=("<|im_end|>", "<|endoftext|>"),
           prompt_format="bos_newlines", weight_bytes=8_040_000_000),
)


def _norm(text: str) -> str:
    return text.strip().lower().rstrip("/")


def preset_by_name(source: str) -> Preset | None:
    """The preset whose hub id is ``source`` or ends it (``.../L3-1-8B-Magpie-MTP``: a local copy keeps
    the repository's name), case ignored; None otherwise."""
    s = _norm(source)
    for p in PRESETS:
        hub = p.hub_id.lower()
        if s == hub or s.endswith("/" + hub) or s.endswith("/" + hub.split("/")[1]) or s == hub.split("/")[1]:
            return p
    return None


def find_preset(source: str, config: Any | None = None, tokenizer: Any | None = None) -> Preset | None:
    """The preset for a checkpoint: by its hub id (:func:`preset_by_name` on the source, then on the
    config's ``_name_or_path``), else by the config (``model_type`` and ``vocab_size``) when the tokenizer
    holds the authors' 32 MTP tokens. None for any other model."""
    found = preset_by_name(source)
    if found is None and config is not None and getattr(config, "_name_or_path", None):
        found = preset_by_name(str(config._name_or_path))
    if found is not None or config is None or tokenizer is None:
        return found
    last = tokenizer.convert_tokens_to_ids(f"<|mtp_special_token_{MTP_TOKENS - 1}|>")
    if last is None or last == getattr(tokenizer, "unk_token_id", None) or \
            tokenizer.convert_ids_to_tokens(last) != f"<|mtp_special_token_{MTP_TOKENS - 1}|>":
        return None
    for p in PRESETS:
        if getattr(config, "model_type", None) == p.model_type and getattr(config, "vocab_size", None) == p.vocab_size:
            return p
    return None
