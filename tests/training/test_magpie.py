"""Magpie-style general instructions (model/training/magpie.py): the user-turn prefix of any chat template,
the filters, near-duplicate detection, the held-out split, resumable sampling, the answer mix. Tiny random
models over the real SmolLM2 tokenizer; Llama-3 and Qwen-style templates on copies of it."""

from __future__ import annotations

import copy
import json

import pytest

from model.engine.loading import wrap_model
from model.engine.text import chat_prompt_ids, user_turn_prefix_ids
from model.magpie import main
from model.training.magpie import (NearDuplicates, answer_problem, heldout_bucket, heldout_path, instruction_problem,
                                   mix, repeated_ngram_share, words, sample_user_turns, write_instructions)
from tests.conftest import make_tiny, write_jsonl
from tests.engine.test_presets import LLAMA_TEMPLATE, QWEN_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _with_template(base_tokenizer, template):
    tok = copy.deepcopy(base_tokenizer)
    if template == "llama":
        tok.add_tokens(["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
                       special_tokens=True)
        tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA_TEMPLATE
    elif template == "qwen":
        tok.chat_template = QWEN_TEMPLATE
    return tok


@pytest.mark.parametrize("template", ["smollm2", "llama", "qwen"])
def test_user_turn_prefix_is_the_template_up_to_the_users_text(base_tokenizer, template):
    """The prefix is the text of a rendered one-message chat up to where the user's text begins (its tokens
    may split a boundary differently: "\n\n" + "Name" vs "\n\nName"); its markup tokens are special ids
    (not the characters that spell them)."""
    tok = _with_template(base_tokenizer, template)
    prefix = user_turn_prefix_ids(tok)
    full = chat_prompt_ids(tok, [{"role": "user", "content": "Name a colour."}], add_generation_prompt=False)
    text = tok.decode(prefix)
    assert tok.decode(full).startswith(text) and tok.decode(full)[len(text):].startswith("Name a colour.")
    expected_end = {"smollm2": "<|im_start|>user\n", "llama": "<|start_header_id|>user<|end_header_id|>\n\n",
                    "qwen": "<|im_start|>user\n"}[template]
    assert text.endswith(expected_end)
    if template == "smollm2":  # SmolLM2's template adds its default system prompt: Magpie keeps it
        assert "You are a helpful AI assistant named SmolLM" in text
    header = {"smollm2": "<|im_start|>", "llama": "<|start_header_id|>", "qwen": "<|im_start|>"}[template]
    assert tok.convert_tokens_to_ids(header) in prefix


def test_user_turn_prefix_without_template_is_an_error(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_turn_prefix_ids(tok)


@pytest.mark.parametrize("text,why", [
    ("", "empty"),
    ("Hi there", "too short"),
    ("word " * 130, "too long"),
    ("What is the capital of France?<|im_end|>", "markup"),
    ("Tell me a joke.\nassistant: Why did the chicken cross the road?", "markup"),
    ("I need help I need help I need help I need help I need help with my garden", "looping"),
    ("12 + 34 = 46; 56 + 78 = 134; 910 / 2 = 455 ???", "not text"),
])
def test_instruction_filters(text, why):
    assert instruction_problem(text) == why


@pytest.mark.parametrize("text", [
    "Can you recommend a free online tool that helps me track my daily exercises?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "I'm planning a trip to Portugal in May. What should I pack?",
])
def test_sensible_instructions_pass(text):
    assert instruction_problem(text) is None


def test_looping_measure_and_answer_filter():
    loop = "The sky is blue because the air scatters blue light. " * 5
    prose = ("Sunlight is scattered by the molecules of the air, and blue light is scattered more than red light "
             "because its wavelength is shorter, so the sky looks blue from the ground.")
    assert repeated_ngram_share(words(loop), 3) > 0.9
    assert repeated_ngram_share(words(prose), 3) == 0.0
    assert answer_problem(loop) == "looping" and answer_problem(prose) is None
    assert answer_problem("  \n") == "empty"
    listing = "1. Pack light clothes.\n2. Pack a rain jacket.\n3. Pack comfortable shoes.\n4. Bring a charger."
    assert answer_problem(listing) is None  # a list with a repeated stem is no loop


def test_near_duplicates():
    d = NearDuplicates(0.7)
    first = "Can you give me some tips for a job interview at a software company next week?"
    d.add(first)
    assert d.is_duplicate("can you give me some tips for a job interview at a software company next week")
    assert d.is_duplicate("Can you give me some tips for a job interview at a software company next month?")
    assert not d.is_duplicate("Can you give me a recipe for a vegetarian lasagna with spinach?")
    assert not d.is_duplicate("Tips for a job interview?")  # shares a few 3-grams, not 70% of them


def test_heldout_split_is_stable_and_about_the_share():
    texts = [f"Question number {i}: what is the colour of object {i * 7}?" for i in range(2000)]
    held = [t for t in texts if heldout_bucket(t, 0.1)]
    assert 140 < len(held) < 260
    assert held == [t for t in reversed(texts) if heldout_bucket(t, 0.1)][::-1]  # order does not matter
    assert heldout_bucket("Hello, how are you today?", 0.1) == heldout_bucket("hello how are you today", 0.1)


def test_sampled_turns_are_reproducible_and_resumable(base_tokenizer, tmp_path):
    """A tiny random model's sampled user turns are noise: loose limits keep some. The same seed gives the
    same turns; a second call continues the file (no row repeated), a rerun at the count does nothing."""
    from model.training.magpie import InstructionLimits

    import torch

    tok = copy.deepcopy(base_tokenizer)
    model = make_tiny(tok)
    head = model.lm_head  # a random model almost never samples EOS: a bias makes ~1 in 7 tokens end the turn
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight)
        model.lm_head.bias.zero_()
        model.lm_head.bias[tok.convert_tokens_to_ids("<|im_end|>")] = 9.0
    lm = wrap_model(model, tok, source="tiny")
    a = sample_user_turns(lm, 4, seed=7, max_new_tokens=12)
    assert a == sample_user_turns(lm, 4, seed=7, max_new_tokens=12)
    assert a != sample_user_turns(lm, 4, seed=8, max_new_tokens=12)
    loose = InstructionLimits(min_chars=1, min_words=1, max_repeated_share=1.0, min_letter_share=0.0)
    out = tmp_path / "instr.jsonl"
    s1 = write_instructions(lm, out, 6, batch_size=8, max_new_tokens=12, limits=loose, heldout_share=0.3,
                            show_progress=False, dedup_threshold=0.99)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    held = [json.loads(l) for l in heldout_path(out).read_text().splitlines()]
    assert s1["kept"] == 6 == len(rows) + len(held) and s1["sampled"] >= 6
    s2 = write_instructions(lm, out, 10, batch_size=8, max_new_tokens=12, limits=loose, heldout_share=0.3,
                            show_progress=False, dedup_threshold=0.99)
    rows2 = [json.loads(l) for l in out.read_text().splitlines()] + \
        [json.loads(l) for l in heldout_path(out).read_text().splitlines()]
    assert s2["kept"] == 10 == len(rows2)
    assert sorted(r["index"] for r in rows2) == list(range(10))
    assert len({r["prompt"].lower() for r in rows2}) == 10  # no duplicate kept across the two calls
    assert min(r["batch"] for r in rows2 if r["index"] >= 6) > max(r["batch"] for r in rows2 if r["index"] < 6) - 1
    assert write_instructions(lm, out, 10, limits=loose, show_progress=False)["sampled"] == 0


def test_mix_filters_and_shares(tmp_path):
    good = "Sunlight is scattered by the air, blue light more than red light, so the sky looks blue."
    loop = "the blue sky is blue and the blue sky is blue " * 4
    a = write_jsonl(tmp_path / "general.jsonl", [
        {"index": i, "prompt": f"general question {i}", "response": good if i % 5 else loop, "tokens": 20,
         "stopped": True, "generated_by": "m"} for i in range(40)])
    b = write_jsonl(tmp_path / "math.jsonl", [
        {"index": i, "prompt": f"math question {i}", "response": f"The answer is {i}.", "tokens": 5,
         "stopped": True, "generated_by": "m"} for i in range(30)])
    out = tmp_path / "mix.jsonl"
    report = mix([(a, 3.0), (b, 1.0)], out, seed=1)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert report[str(a)]["looping"] == 8 and report[str(a)]["kept"] == 32
    # the largest total without a repeat: 42 (general's 32 rows are 3/4 of it), so 32 + 10 rows
    assert report[str(a)]["used"] == 32 and report[str(b)]["used"] == 10
    assert len(rows) == 42
    assert all(r["response"] != loop for r in rows)
    assert {r["source"] for r in rows} == {"general.jsonl", "math.jsonl"}
    assert rows != sorted(rows, key=lambda r: r["source"])  # shuffled
    # repeated on request, and the CLI says the same in JSON
    assert main(["mix", "--out", str(tmp_path / "m2.jsonl"), "--total", "100", f"{a}=1", f"{b}=1"]) == 0
    assert len((tmp_path / "m2.jsonl").read_text().splitlines()) == 100
    assert main(["mix", "--out", str(tmp_path / "m3.jsonl"), f"{a}=x"]) == 2
