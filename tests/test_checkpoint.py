"""Checkpoint loading: sources, mask token lookup/addition, adapters' mask rows, clear errors."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from model.engine.adapter_format import META_FILE, MTPMeta, read_meta, save_mtp_checkpoint
from model.engine.loading import DEFAULT_MASK_TOKEN, find_mask_token, load_checkpoint, smollm2_gguf_path
from model.errors import CheckpointError
from model.engine.decoding import generate
from model.engine.strategies import confadapt, standard
from tests.conftest import make_tiny


@pytest.fixture
def tiny_dir(tmp_path, base_tokenizer):
    """A tiny Llama saved as a local HF model directory, with the real tokenizer (mask token included)."""
    tok = copy.deepcopy(base_tokenizer)
    model = make_tiny(tok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_local_dir_with_mask_token(tiny_dir):
    lm = load_checkpoint(str(tiny_dir), device="cpu")
    assert lm.mtp_trained and not lm.warnings
    assert lm.mask_token_id == lm.tokenizer.convert_tokens_to_ids(DEFAULT_MASK_TOKEN)
    assert lm.stop_token_ids == (lm.tokenizer.eos_token_id,)
    assert lm.prompt_format == "chat"
    res = generate(lm, "Hello", confadapt(0.9, 4), 8)
    assert 1 <= res.new_tokens <= 8 and res.forward_passes <= res.new_tokens


def test_missing_mask_token_is_added_and_flagged(tiny_dir, base_tokenizer):
    lm = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    assert not lm.mtp_trained
    assert any("not MTP-trained" in w for w in lm.warnings)
    assert lm.mask_token_id == len(base_tokenizer)  # one new row after the existing vocabulary
    assert lm.vocab_size == len(lm.tokenizer)
    assert find_mask_token(lm.tokenizer, "<|my_mask|>") == lm.mask_token_id


def test_added_mask_row_is_mean_initialised_and_reproducible(tiny_dir):
    a = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    b = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    ea, eb = a.model.get_input_embeddings().weight, b.model.get_input_embeddings().weight
    torch.testing.assert_close(ea[a.mask_token_id], eb[b.mask_token_id])
    mean = ea[:-1].mean(0)
    # drawn from N(mean, cov): much closer to the mean than a typical existing row is
    assert (ea[-1] - mean).norm() < (ea[:-1] - mean).norm(dim=-1).mean() * 2


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


@pytest.mark.parametrize(
    "source, message",
    [
        ("", "empty"),
        ("not a model source!", "Unknown model source"),
        ("/definitely/not/here", "No such local model"),
        ("./missing-dir", "No such local model"),
        ("missing.gguf", "No such local model"),
    ],
)
def test_bad_sources_raise_clear_errors(source, message):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(source)


def test_a_file_that_is_not_a_model(tmp_path):
    (tmp_path / "README.md").write_text("# hello")
    with pytest.raises(CheckpointError, match="is a file, not a model"):
        load_checkpoint(str(tmp_path / "README.md"))


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_bad_adapter_metadata(tmp_path):
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="Cannot read"):
        load_checkpoint(str(tmp_path))


def test_quantization_needs_cuda(tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(CheckpointError, match="needs a CUDA GPU"):
        load_checkpoint(str(tiny_dir), quantization="4bit")
    with pytest.raises(CheckpointError, match="Unknown quantization"):
        load_checkpoint(str(tiny_dir), quantization="3bit")


def test_bad_dtype(tiny_dir):
    with pytest.raises(CheckpointError, match="Unknown dtype"):
        load_checkpoint(str(tiny_dir), dtype="float7")


@pytest.mark.integration
def test_gguf_file_source_is_the_default_base(smollm2, tmp_path, monkeypatch):
    """A first load (empty cache: the GGUF is parsed and its dequantised copy written) gives the same
    model and forward path as every later load from the copy: plain weights, the fast path."""
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    lm = load_checkpoint(str(smollm2_gguf_path()), device="cpu")
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert lm.forward_path.startswith("fast path"), lm.forward_path
    assert not getattr(lm.model, "is_quantized", False)
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert lm.model.config.num_hidden_layers == 30 and lm.model.config.hidden_size == 576
    assert lm.mask_token_id == 49152 == smollm2.mask_token_id
    assert lm.stop_token_ids == (2,)
    assert generate(lm, "What is 2+2?", standard(), 12).token_ids == generate(smollm2, "What is 2+2?", standard(), 12).token_ids
