"""The on-disk MTP checkpoint format (model/engine/adapter_format.py): the one writer and the one
reader agree; unreadable or unknown metadata is refused with a clear error."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.engine.adapter_format import META_FILE, MTPMeta, read_meta, save_mtp_checkpoint
from model.engine.decoding import generate
from model.engine.loading import DEFAULT_MASK_TOKEN, load_checkpoint
from model.engine.strategies import standard
from model.errors import CheckpointError


def test_full_model_round_trip_keeps_its_metadata(tiny_dir, tmp_path):
    """The one writer (save_mtp_checkpoint) and the one reader (load_checkpoint) agree on a full model:
    weights, mask row, prompt format and trained k_max come back."""
    lm = load_checkpoint(str(tiny_dir), device="cpu")
    with torch.no_grad():
        lm.model.get_input_embeddings().weight[lm.mask_token_id] = 0.5
    meta = MTPMeta(base=str(tiny_dir), adapter="full", mask_token=DEFAULT_MASK_TOKEN, prompt_format="bos_newlines",
                   k_max=6)
    out = save_mtp_checkpoint(tmp_path / "full", lm.model, meta, mask_token_id=lm.mask_token_id,
                              tokenizer=lm.tokenizer, save_dtype=torch.float32)
    assert read_meta(out) == meta
    loaded = load_checkpoint(str(out), device="cpu")
    assert loaded.mtp_trained and loaded.adapter is None
    assert loaded.prompt_format == "bos_newlines" and loaded.trained_k_max == 6
    row = loaded.model.get_input_embeddings().weight[loaded.mask_token_id]
    assert torch.all(row == 0.5)
    same_prompts = dataclasses.replace(lm, prompt_format="bos_newlines")
    assert generate(loaded, "Hi", standard(), 6).token_ids == generate(same_prompts, "Hi", standard(), 6).token_ids


def test_unknown_adapter_kind_is_refused(tmp_path):
    (tmp_path / META_FILE).write_text(json.dumps({"base": "x", "adapter": "mask_only"}))
    with pytest.raises(CheckpointError, match="unknown adapter kind 'mask_only'"):
        load_checkpoint(str(tmp_path))


def test_bad_adapter_metadata(tmp_path):
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="Cannot read"):
        load_checkpoint(str(tmp_path))
