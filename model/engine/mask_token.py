"""The mask token and the stop tokens of a checkpoint (paper 3.1, 3.3): found by name in the tokenizer, or added to
the vocabulary and the embeddings with mean initialisation when a model has none yet."""

from __future__ import annotations

import warnings
from typing import Any

import torch


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
