"""The authors' checkpoints by name (model/engine/presets.py): tiny random checkpoints laid out as theirs
(their 32 ``<|mtp_special_token_N|>`` tokens, their stop tokens, a Qwen3-like tokenizer that has a chat
template the checkpoint was not trained with) load with the right mask id, stop ids and prompt ids."""

from __future__ import annotations

import copy

import pytest
import torch

from model.engine.loading import load_checkpoint, trained_k_max
from model.engine.presets import PRESETS, find_preset, preset_by_name
from model.engine.text import chat_prompt_ids, encode_literal
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA = next(p for p in PRESETS if p.model_type == "llama")
QWEN = next(p for p in PRESETS if p.model_type == "qwen3")
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                  "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>"
                  "assistant<|end_header_id|>\n\n{% endif %}")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _authors_layout(base_tokenizer, preset, directory):
    """A tiny checkpoint shaped like ``preset``'s: its special tokens, 32 MTP tokens, its vocabulary size."""
    tok = copy.deepcopy(base_tokenizer)
    if preset is LLAMA:
        tok.add_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                        "<|end_header_id|>"], special_tokens=True)
        tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA_TEMPLATE
    else:  # SmolLM2 already has <|im_start|>, <|im_end|>, <|endoftext|>; Qwen3's tokenizer has no BOS
        tok.bos_token, tok.eos_token, tok.chat_template = None, "<|im_end|>", QWEN_TEMPLATE
    tok.add_tokens([f"<|mtp_special_token_{i}|>" for i in range(1, 32)], special_tokens=True)
    model = make_tiny(tok, arch=preset.model_type.replace("qwen3", "qwen"), tied=preset is QWEN)
    model.resize_token_embeddings(preset.vocab_size)  # the authors pad the vocabulary
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok


@pytest.mark.parametrize("preset", [LLAMA, QWEN], ids=["llama", "qwen3"])
@pytest.mark.parametrize("named", [True, False], ids=["by-name", "by-config"])
def test_preset_mask_stops_and_prompt_ids(base_tokenizer, tmp_path, preset, named):
    d = tmp_path / (preset.hub_id.split("/")[1] if named else "renamed-copy")
    tok = _authors_layout(base_tokenizer, preset, d)
    lm = load_checkpoint(str(d), dtype="float32")
    assert lm.mask_token_id == tok.convert_tokens_to_ids("<|mtp_special_token_0|>")
    assert lm.mtp_trained  # the mask token was there: nothing added
    assert set(lm.stop_token_ids) >= {tok.convert_tokens_to_ids(t) for t in preset.stop_tokens}
    assert lm.prompt_format == preset.prompt_format and lm.trained_k_max == preset.k_max
    assert any(preset.name in w for w in lm.warnings)
    if preset is LLAMA:  # the chat template, contents literal
        assert lm.prompt_ids("What is 2+2?") == chat_prompt_ids(tok, [{"role": "user", "content": "What is 2+2?"}])
    else:  # trained without a template, although the tokenizer has one: bos (if any) + question + "\n\n"
        assert lm.prompt_ids("What is 2+2?") == encode_literal(tok, "What is 2+2?\n\n")
        assert lm.prompt_ids("What is 2+2?") != chat_prompt_ids(tok, [{"role": "user", "content": "What is 2+2?"}])


def test_preset_lookup_by_hub_id_and_path():
    assert preset_by_name("jwkirchenbauer/L3-1-8B-Magpie-MTP") is LLAMA
    assert preset_by_name("JWKirchenbauer/l3-1-8b-magpie-mtp") is LLAMA  # case ignored
    assert preset_by_name("/models/Qwen3-4B-Inst-2507-MTP/") is QWEN  # a local copy keeps the repo's name
    assert preset_by_name("smollm2-135m") is None and preset_by_name("someone/L3-1-8B") is None
    assert trained_k_max("jwkirchenbauer/Qwen3-4B-Inst-2507-MTP") == QWEN.k_max  # known before any download
    assert find_preset("x", None, None) is None


def test_no_preset_for_an_ordinary_model(base_tokenizer, tmp_path):
    tok = copy.deepcopy(base_tokenizer)
    model = make_tiny(tok)
    model.save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    lm = load_checkpoint(str(tmp_path / "plain"), dtype="float32")
    assert lm.prompt_format == "chat" and not any("authors' settings" in w for w in lm.warnings)
    assert lm.stop_token_ids == (tok.eos_token_id,)
    assert torch.equal(torch.tensor(lm.prompt_ids("Hi")), torch.tensor(chat_prompt_ids(tok, [{"role": "user",
                                                                                              "content": "Hi"}])))
