"""Integration: the real SmolLM2-135M-Instruct GGUF (embedded default) through the engine and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from model.engine.decoding import Decoder, generate, hf_generate
from model.engine.strategies import confadapt, standard, static_k
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.",
    "Write a Python function that reverses a string.",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_standard_equals_hf_generate_64_tokens(smollm2, prompt):
    ours = generate(smollm2, prompt, standard(), 64)
    ref = hf_generate(smollm2, smollm2.prompt_ids(prompt), 64)
    assert ours.token_ids == ref
    assert len(ref) == 64 or ref[-1] in smollm2.stop_token_ids


def test_default_model_facts(smollm2):
    assert smollm2.mask_token_id == 49152  # appended after the 49152-token vocabulary
    assert smollm2.stop_token_ids == (2,)  # <|im_end|>
    assert smollm2.prompt_format == "chat"
    assert not smollm2.mtp_trained  # adapter=False: the untrained mask token is flagged
    assert smollm2.warnings


def test_confadapt_and_cache_on_real_model(smollm2):
    prompt_ids = smollm2.prompt_ids(PROMPTS[1])
    dec = Decoder(smollm2, prompt_ids, confadapt(0.5, 8), 24)
    for rec in dec:
        assert dec.cache.get_seq_length() == len(dec.cached_ids)
    with torch.inference_mode():
        fresh = smollm2.model(torch.tensor([dec.cached_ids]), use_cache=True).past_key_values
    for layer, ref in zip(dec.cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-3, rtol=1e-3)
    # the first token of each block equals standard decoding's token at that place
    std = generate(smollm2, PROMPTS[1], standard(), 24).token_ids
    pos = 0
    for rec in dec.passes:
        if pos < len(std) and dec.generated[:pos] == std[:pos]:
            assert rec.kept[0] == std[pos]
        pos += len(rec.kept)


def test_static_k_tokens_are_the_proposals(smollm2):
    # The untrained mask token often proposes <|im_end|>: without stop tokens every proposal is kept.
    res = generate(dataclasses.replace(smollm2, stop_token_ids=()), PROMPTS[0], static_k(3), 12)
    assert res.new_tokens == 12 and res.forward_passes == 4
    assert res.token_ids == [t for p in res.passes for t in p.proposals[:3]]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "model.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_json(smollm2):
    out = _cli("--prompt", "What is 2+2?", "--strategy", "confadapt", "--tau", "0.9", "--k-max", "16",
               "--max-new-tokens", "16", "--json", "--no-adapter")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert set(obj) >= {"text", "new_tokens", "forward_passes", "effective_k", "seconds", "passes"}
    assert obj["new_tokens"] == sum(len(p["kept"]) for p in obj["passes"]) <= 16
    assert obj["forward_passes"] == len(obj["passes"])
    assert obj["passes"][0]["fed_masks"] == 15 and len(obj["passes"][0]["confidences"]) == 16
    assert obj["text"] == generate(smollm2, "What is 2+2?", confadapt(0.9, 16), 16).text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--tau", "1.5"], "tau must be in"),
        (["--prompt", "hi", "--k-max", "0"], "k_max must be"),
        (["--prompt", "hi", "--strategy", "static", "--k", "5", "--k-max", "4"], "cannot exceed"),
        (["--prompt", "hi", "--model", "no/such/model/path"], "No such local model"),
        (["--prompt", "hi", "--model", "bogus source"], "Unknown model source"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "hi", "--strategy", "bogus"], "Unknown strategy 'bogus'"),
        (["--prompt", "hi", "--device", "banana"], "Unknown device 'banana'"),
        (["--prompt", "hi", "--strategy", "confadapt:1.5"], "tau must be in"),
        (["--prompt", "hi", "--strategy", "static:abc"], "Bad strategy 'static:abc'"),
        (["--prompt", "hi", "--strategy", "confadapt:0.9", "--k-max", "0"], "k_max must be"),
    ],
)
def test_cli_bad_input(args, message, capsys):
    """Bad arguments: exit 2 and one ``error:`` line, before any model is loaded."""
    from model.generate import main

    assert main(args) == 2  # in-process: the same entry point as `python -m model.generate`
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
