"""Lossless verification (strategy ``verify``): output == standard decoding, cache invariant, drafts
accepted / rejected exactly, stop tokens and max_new_tokens inside accepted drafts."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from model.engine.loading import wrap_model
from model.engine.decoding import Decoder, generate, run
from model.engine.strategies import standard, verify
from tests.conftest import make_tiny, mtp_run, pretrained_teacher

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
]


def assert_cache_is_fresh_prefill(lm, dec, atol):
    assert dec.cache.get_seq_length() == len(dec.cached_ids)
    assert dec.cached_ids + dec.pending == dec.prompt_ids + dec.generated
    with torch.inference_mode():
        fresh = lm.model(torch.tensor([dec.cached_ids]), use_cache=True).past_key_values
    for layer, ref in zip(dec.cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=atol, rtol=atol)
        torch.testing.assert_close(layer.values, ref.values, atol=atol, rtol=atol)


@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("k_max", [2, 4, 8])
def test_verify_equals_standard_float64(base_tokenizer, arch, k_max):
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, arch=arch, dtype=torch.float64), tok, source=f"tiny-{arch}")
    for prompt in PROMPTS:
        ref = generate(lm, prompt, standard(), 40)
        out = generate(lm, prompt, verify(k_max), 40)
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert all(len(p.kept) == p.drafts_accepted + 1 or p.block_end in ("stop token", "max_new_tokens")
                   for p in out.passes)


def oracle_decoder(lm, prompt, n, k_max, drafts_of):
    """A verify decoder whose drafts before each pass are set by ``drafts_of(dec, reference)``: tests
    the acceptance path exactly, whatever the (random) mask proposals are."""
    ref = generate(lm, prompt, standard(), n + 8).token_ids
    dec = Decoder(lm, lm.prompt_ids(prompt), verify(k_max), n)
    return dec, ref


def test_right_drafts_are_all_accepted_and_a_wrong_one_is_corrected(tiny_lm64):
    lm = tiny_lm64
    dec, ref = oracle_decoder(lm, PROMPTS[2], 30, 4, None)
    rec = dec.run_pass()  # prefill: no drafts yet
    assert rec.fed_drafts == 0 and rec.kept == ref[:1]
    # three right drafts: all accepted plus the model's next token
    dec.drafts = ref[1:4]
    rec = dec.run_pass()
    assert rec.drafts == ref[1:4] and rec.drafts_accepted == 3 and rec.correction is None
    assert rec.kept == ref[1:5] and rec.fed_real == 1 and rec.fed_drafts == 3 and rec.fed_masks == 3
    assert rec.block_end == "k_max"
    assert dec.drafts == rec.proposals[1:]  # the masks' proposals become the next drafts
    assert_cache_is_fresh_prefill(lm, dec, 1e-10)
    # right, wrong, right: one accepted, the model's token replaces the wrong one, nothing after it
    wrong = (ref[6] + 1) % (lm.mask_token_id - 1)
    dec.drafts = [ref[5], wrong, ref[7]]
    rec = dec.run_pass()
    assert rec.drafts_accepted == 1 and rec.correction == ref[6] and rec.kept == ref[5:7]
    assert rec.block_end == "draft rejected" and dec.drafts == []
    assert rec.correction_text == lm.tokenizer.decode([ref[6]]) and len(rec.draft_texts) == 3
    assert len(rec.draft_confidences) == 3 and all(0.0 < c <= 1.0 for c in rec.draft_confidences)
    assert_cache_is_fresh_prefill(lm, dec, 1e-10)
    for _ in dec:
        assert_cache_is_fresh_prefill(lm, dec, 1e-10)
    assert dec.generated == ref[:30]


def test_stop_token_inside_accepted_drafts(tiny_lm64):
    # a prompt whose answer has a token at place 2..4 that did not occur before it: make it the stop token
    cases = [(p, generate(tiny_lm64, p, standard(), 12).token_ids) for p in PROMPTS]
    prompt, ref, i = next((p, r, i) for p, r in cases for i in range(2, 5) if r[i] not in r[:i])
    lm = dataclasses.replace(tiny_lm64, stop_token_ids=(ref[i],))
    dec = Decoder(lm, lm.prompt_ids(prompt), verify(6), 12)
    dec.run_pass()
    dec.drafts = ref[1:6]
    rec = dec.run_pass()
    assert rec.stopped and rec.block_end == "stop token" and dec.done
    assert dec.generated == ref[: i + 1]  # up to and including the stop token, nothing after it


@pytest.mark.parametrize("n", [2, 3, 4])
def test_max_new_tokens_inside_accepted_drafts(tiny_lm64, n):
    lm = dataclasses.replace(tiny_lm64, stop_token_ids=())
    ref = generate(lm, PROMPTS[1], standard(), 10).token_ids
    dec = Decoder(lm, lm.prompt_ids(PROMPTS[1]), verify(6), n)
    dec.run_pass()
    dec.drafts = ref[1:6]
    rec = dec.run_pass()
    assert dec.done and dec.generated == ref[:n] and rec.block_end == "max_new_tokens"


def test_verify_on_a_model_that_learned_a_repetitive_corpus(base_tokenizer, tmp_path, one_torch_thread):
    """A tiny model that learned a repetitive corpus, then MTP-trained with the project's trainer
    (activated LoRA, 40 steps): its mask proposals are right drafts, so verification keeps several
    tokens per pass, and the output still equals standard decoding. Measured effective k 2.7-3.2 per
    prompt (k_max 4: at most 4); the bar of 1.5 leaves a wide margin for other CPUs' trajectories."""
    teacher, examples = pretrained_teacher(base_tokenizer)
    mtp_run(teacher, examples, tmp_path / "run", seed=0, adapter="alora")
    lm = wrap_model(copy.deepcopy(teacher.model), teacher.tokenizer, prompt_format="bos_newlines",
                    mtp_dir=tmp_path / "run" / "final")
    assert lm.adapter == "alora"
    ks = []
    for prompt in [ex.prompt for ex in examples]:
        ref = generate(lm, prompt, standard(), 40)
        out = generate(lm, prompt, verify(4), 40)
        assert out.token_ids == ref.token_ids
        ks.append(out.effective_k)
    assert min(ks) > 1.5, ks


def test_verify_record_is_strict_json(tiny_lm):
    import json

    res = run(tiny_lm, tiny_lm.prompt_ids(PROMPTS[0]), verify(4), 12)
    d = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    assert {"drafts", "draft_texts", "draft_checks", "draft_confidences", "drafts_accepted", "correction",
            "correction_text", "block_end", "fed_drafts"} <= set(d["passes"][1])


SMOLLM2_PROMPTS = [
    "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.",
    "Write a Python function that reverses a string.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
]


@pytest.mark.integration
@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_verify_equals_standard_on_the_default_model_float32(smollm2_adapter, prompt):
    """The shipped activated adapter drafts; the base verifies: 64 tokens identical to standard decoding
    (float32: to the bit; docs/DESIGN.md explains bf16), the KV cache a fresh prefill after the run."""
    lm = smollm2_adapter
    assert lm.adapter == "alora" and lm.dtype == torch.float32
    ids = lm.prompt_ids(prompt)
    ref = run(lm, ids, standard(), 64)
    dec = Decoder(lm, ids, verify(lm.default_k_max), 64)
    for _ in dec:
        pass
    assert dec.generated == ref.token_ids
    assert dec.result().forward_passes <= ref.forward_passes
    with lm.base_model():
        assert_cache_is_fresh_prefill(lm, dec, 1e-3)

