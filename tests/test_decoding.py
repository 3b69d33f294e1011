"""Decoding strategies on tiny random models: greedy equivalence, cache invariants, stop tokens."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from model.engine.loading import wrap_model
from model.engine.decoding import Decoder, generate, hf_generate
from model.engine.strategies import confadapt, resolve_strategy, standard, static_k
from tests.conftest import make_tiny

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
]


def run(lm, prompt, strategy, n):
    dec = Decoder(lm, lm.prompt_ids(prompt), strategy, n)
    records = list(dec)
    return dec, records, dec.result()


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_standard_equals_hf_generate(base_tokenizer, arch):
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, arch=arch), tok, source=f"tiny-{arch}")
    for prompt in PROMPTS:
        ids = lm.prompt_ids(prompt)
        ours = generate(lm, prompt, standard(), 40)
        assert ours.token_ids == hf_generate(lm, ids, 40)
        assert ours.forward_passes == ours.new_tokens  # one token per forward pass


def test_static_k1_equals_standard(tiny_lm):
    for prompt in PROMPTS:
        a = generate(tiny_lm, prompt, standard(), 32)
        b = generate(tiny_lm, prompt, static_k(1), 32)
        assert a.token_ids == b.token_ids and a.text == b.text


def test_confadapt_tau_one_equals_standard_float64(tiny_lm64):
    for prompt in PROMPTS:
        a = generate(tiny_lm64, prompt, standard(), 32)
        _, records, b = run(tiny_lm64, prompt, confadapt(1.0, 8), 32)
        # tau = 1.0 accepts a mask proposal only at probability exactly 1; none reach it here.
        assert all(max(r.confidences[1:]) < 1.0 for r in records)
        assert b.token_ids == a.token_ids
        assert all(len(r.kept) == 1 for r in records)


def test_first_proposal_is_the_standard_token_float64(tiny_lm64):
    """Appending masks never changes the prediction at the last real token (causal attention)."""
    a = generate(tiny_lm64, PROMPTS[0], standard(), 24)
    _, records, b = run(tiny_lm64, PROMPTS[0], static_k(4), 24)
    assert b.token_ids[0] == a.token_ids[0]
    assert records[0].proposals[0] == a.token_ids[0]


@pytest.mark.parametrize("strategy", [standard(), static_k(3), confadapt(0.0, 6), confadapt(0.5, 16)],
                         ids=lambda s: s.spec)
def test_kv_cache_holds_exactly_the_fed_real_tokens(tiny_lm, strategy):
    lm = tiny_lm
    prompt_ids = lm.prompt_ids(PROMPTS[2])
    dec = Decoder(lm, prompt_ids, strategy, 30)
    for rec in dec:
        # pass layout: the tokens not yet cached + k_max - 1 masks
        assert rec.fed_masks == strategy.k_max - 1
        assert rec.fed_real == (len(prompt_ids) if rec.index == 0 else len(dec.passes[rec.index - 1].kept))
        # the cache holds the real tokens fed so far, no mask entries
        assert dec.cache.get_seq_length() == len(dec.cached_ids)
        assert dec.cached_ids == (prompt_ids + dec.generated)[: len(dec.cached_ids)]
        assert dec.cached_ids + dec.pending == prompt_ids + dec.generated
        # ... and equals a fresh prefill of those tokens (float32: atol 1e-4)
        with torch.inference_mode():
            fresh = lm.model(torch.tensor([dec.cached_ids]), use_cache=True).past_key_values
        for layer, ref in zip(dec.cache.layers, fresh.layers):
            torch.testing.assert_close(layer.keys, ref.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, ref.values, atol=1e-4, rtol=1e-4)
    assert dec.result().new_tokens == len(dec.generated)


def test_confadapt_keeps_leading_run_above_tau(tiny_lm):
    tau = 0.3
    _, records, res = run(tiny_lm, PROMPTS[1], confadapt(tau, 8), 40)
    for r in records:
        n = r.accepted
        assert n >= 1
        assert all(c >= tau for c in r.confidences[1:n])
        if n < len(r.confidences):
            assert r.confidences[n] < tau
        assert r.kept == r.proposals[: len(r.kept)]
    assert res.effective_k == pytest.approx(res.new_tokens / res.forward_passes)


def test_stop_token_inside_a_block_ends_generation_there(tiny_lm):
    _, records, _ = run(tiny_lm, PROMPTS[0], static_k(4), 8)
    block = records[0].proposals
    stop = block[1]
    assert stop not in block[:1]
    lm = dataclasses.replace(tiny_lm, stop_token_ids=(stop,))
    _, recs, res = run(lm, PROMPTS[0], static_k(4), 8)
    assert res.token_ids == block[:2]  # up to and including the stop token, nothing after it
    assert len(recs) == 1 and recs[0].stopped and recs[0].accepted == 4


@pytest.mark.parametrize("n", [1, 5, 6, 7])
def test_max_new_tokens_is_exact(tiny_lm, n):
    lm = dataclasses.replace(tiny_lm, stop_token_ids=())
    res = generate(lm, PROMPTS[1], static_k(3), n)
    assert res.new_tokens == n
    assert res.forward_passes == -(-n // 3)


def test_text_deltas_add_up_to_the_answer(tiny_lm):
    _, records, res = run(tiny_lm, PROMPTS[2], confadapt(0.2, 8), 40)
    assert "".join(r.text for r in records) == res.text
    assert res.text == tiny_lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)


def test_mask_token_is_never_proposed(tiny_lm):
    _, records, _ = run(tiny_lm, PROMPTS[0], static_k(8), 24)
    assert all(tiny_lm.mask_token_id not in r.proposals for r in records)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: confadapt(1.5, 16), "tau must be in"),
        (lambda: confadapt(-0.1, 16), "tau must be in"),
        (lambda: confadapt(float("nan"), 16), "tau must be in"),
        (lambda: confadapt(0.9, 0), "k_max must be"),
        (lambda: resolve_strategy("static", k=4, k_max=3), "cannot exceed k_max"),
        (lambda: static_k(0), "k must be"),
        (lambda: resolve_strategy("beam"), "Unknown strategy"),
        (lambda: resolve_strategy("confadapt:x"), "Bad strategy"),
        (lambda: resolve_strategy("confadapt", k_max=33, cap=32), "k_max must be from 1 to 32"),
        (lambda: resolve_strategy("static:40", cap=32), "k must be from 1 to 32"),
    ],
)
def test_bad_strategy_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_generation_arguments(tiny_lm):
    with pytest.raises(ValueError, match="empty"):
        tiny_lm.prompt_ids("   ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        Decoder(tiny_lm, tiny_lm.prompt_ids("hi"), standard(), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Decoder(tiny_lm, tiny_lm.prompt_ids("hi"), standard(), -3)
    with pytest.raises(ValueError, match="empty"):
        Decoder(tiny_lm, [], standard(), 4)


def test_resolve_strategy_round_trips_and_defaults():
    for spec in ["standard", "static:3", "confadapt:0.9:16", "confadapt:0.75:8", "verify:4"]:
        assert resolve_strategy(spec).spec == spec
    assert resolve_strategy("confadapt:0.9") == confadapt(0.9, 16)
    # a spec's own values win; what it leaves out comes from the arguments, then the model's default
    assert resolve_strategy("confadapt:0.7", default_k_max=4) == resolve_strategy("confadapt", tau=0.7, default_k_max=4)
    assert resolve_strategy("confadapt:0.7", default_k_max=4).k_max == 4
    assert resolve_strategy("confadapt:0.7:8", k_max=2) == confadapt(0.7, 8)
    assert resolve_strategy("verify:8") == resolve_strategy("verify", k_max=8)
    assert resolve_strategy("static:2") == resolve_strategy("static", k=2) == static_k(2)
    assert resolve_strategy(" Standard ") == standard()
    # the caller's cap bounds the model's default too
    assert resolve_strategy("verify", default_k_max=64, cap=32).k_max == 32


def test_multi_turn_prompt_uses_chat_template(tiny_lm):
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tiny_lm.tokenizer.decode(tiny_lm.prompt_ids(history))
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="end with a user"):
        tiny_lm.prompt_ids(history[:2])
