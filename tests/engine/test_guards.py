"""Checks before loading (model/engine/guards.py): weights larger than the free memory are refused naming
both numbers, recurrent / hybrid architectures are refused, sliding-window models decode within their
window only (where the KV cache crops exactly) and exactly there."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from model.engine.decoding import Decoder, hf_generate, run
from model.engine.guards import check_architecture, free_memory, parse_bytes, weights_bytes
from model.engine.loading import load_checkpoint, wrap_model
from model.engine.strategies import confadapt, standard, verify
from model.errors import CheckpointError, ContextBudgetError
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def tiny_dir(base_tokenizer, tmp_path):
    tok = copy.deepcopy(base_tokenizer)
    make_tiny(tok).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_memory_guard_refuses_naming_both_numbers(tiny_dir, monkeypatch):
    need = weights_bytes("hf_dir", str(tiny_dir), torch.float32, None)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_dir).parameters())
    assert need == params * 4  # from the safetensors header alone
    assert weights_bytes("hf_dir", str(tiny_dir), torch.bfloat16, None) == params * 2
    monkeypatch.setenv("MTP_MEMORY_LIMIT", str(need // 2))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(tiny_dir), dtype="float32")
    msg = str(e.value)
    assert f"{need / 1e9:.1f} GB" in msg and f"{need // 2 / 1e9:.1f} GB" in msg and "MTP_MEMORY_LIMIT" in msg
    monkeypatch.setenv("MTP_MEMORY_LIMIT", str(need * 4))
    assert load_checkpoint(str(tiny_dir), dtype="float32").model is not None  # fits: loads


def test_free_memory_and_sizes():
    free, what = free_memory(torch.device("cpu"))
    assert free is None or free > 0 and what.startswith("RAM")
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("1500") == 1500
    with pytest.raises(ValueError):
        parse_bytes("lots")


def _qwen3(**kw):
    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, **kw)


def test_recurrent_and_hybrid_architectures_are_refused():
    with pytest.raises(CheckpointError, match="linear_attention"):
        check_architecture(_qwen3(layer_types=["full_attention", "linear_attention"]))
    cfg = _qwen3()
    cfg.model_type = "mamba"
    with pytest.raises(CheckpointError, match="recurrent state"):
        check_architecture(cfg)
    assert check_architecture(_qwen3()) is None  # full attention: no limit
    assert check_architecture(_qwen3(use_sliding_window=True, sliding_window=48, max_window_layers=0)) == 47


def test_a_recurrent_checkpoint_is_refused_before_its_weights_load(base_tokenizer, tmp_path):
    cfg = _qwen3(layer_types=["full_attention", "linear_attention"])
    cfg.save_pretrained(tmp_path / "hybrid")  # a config and no weights: the check must come first
    with pytest.raises(CheckpointError, match="cannot be decoded with MTP"):
        load_checkpoint(str(tmp_path / "hybrid"), dtype="float32")


def test_sliding_window_model_decodes_within_its_window_only(base_tokenizer):
    """A Qwen3 whose every layer has a window of 48: decoding (standard, ConfAdapt, verify) is exact within
    the window (== HF generate, the library path: the fast path does not take windowed models), and a
    generation that could pass the window is refused, never decoded wrongly."""
    tok = copy.deepcopy(base_tokenizer)
    model = make_tiny(tok, arch="qwen", dtype=torch.float64)
    model.config.use_sliding_window, model.config.sliding_window = True, 48
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(model.config).to(torch.float64).eval()
    lm = wrap_model(model, tok)
    lm.context_limit = check_architecture(model.config)
    ids = tok("Natalia sold clips", add_special_tokens=False)["input_ids"]
    n = 47 - len(ids) - 15  # room for a full tree at k_max 4 (3 drafts + 4 blocks of 3 masks)
    ref = hf_generate(lm, ids, n)
    assert run(lm, ids, standard(), n).token_ids == ref
    assert run(lm, ids, verify(4, "full"), n).token_ids == ref
    assert len(run(lm, ids, confadapt(0.0, 4), n - 3).token_ids) == n - 3
    with pytest.raises(ContextBudgetError, match="47"):
        Decoder(lm, ids, standard(), 47)
