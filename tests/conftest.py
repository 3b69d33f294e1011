"""Shared fixtures: tiny random models (unit tests) and the real SmolLM2 GGUF (integration)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the Hub in tests
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that spin-wait between forward passes starve the app server the tests start beside
# them (measured ~10x slowdowns on 2 shared cores); passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"

from model.checkpoint import LoadedModel, load_checkpoint, wrap_model  # noqa: E402


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: on a CPU shared with other jobs, 2 OpenMP threads spin-wait and
    run small forward passes up to ~15x slower (measured). Results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct base (GGUF), mask token added, no adapter. Read-only use!"""
    try:
        return load_checkpoint("smollm2-135m", adapter=False)
    except Exception as e:  # package missing: integration tests cannot run
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def base_tokenizer(smollm2):
    """A private copy of the real SmolLM2 tokenizer (49152 tokens + the mask token)."""
    return copy.deepcopy(smollm2.tokenizer)


def make_tiny(tokenizer, arch: str = "llama", dtype=torch.float32, seed: int = 0, layers: int = 2):
    """A 2-layer random-initialised Llama or Qwen3 causal LM over ``tokenizer``'s vocabulary."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen3Config(head_dim=16, **common)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    # Sharper random logits than the default init, so greedy choices are well separated.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)
    model.eval()
    return model


def make_tiny_untied(tok, dtype=torch.float32):
    """make_tiny with ordinary-scale embeddings and an untied random LM head: its greedy answers
    depend on the whole prompt (the tied x20 embeddings of make_tiny just repeat the last token)."""
    model = make_tiny(tok, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = model.get_input_embeddings().weight
        w.div_(20.0)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(w.shape, generator=g, dtype=dtype))
    model.config.tie_word_embeddings = False
    return model


@pytest.fixture
def tiny_lm(base_tokenizer) -> LoadedModel:
    """A fresh tiny Llama (float32) wrapped with the real tokenizer; mask token present."""
    tok = copy.deepcopy(base_tokenizer)
    return wrap_model(make_tiny(tok), tok, source="tiny-llama")


@pytest.fixture
def tiny_lm64(base_tokenizer) -> LoadedModel:
    """The same tiny Llama in float64 (exact-equivalence tests)."""
    tok = copy.deepcopy(base_tokenizer)
    return wrap_model(make_tiny(tok, dtype=torch.float64), tok, source="tiny-llama-f64")


def gsm8k_path(split: str = "test") -> Path:
    """../shared/data/gsm8k/{split}.jsonl, or skip the test when absent."""
    p = GSM8K_DIR / f"{split}.jsonl"
    if not p.is_file():
        pytest.skip(f"{p} not present")
    return p
