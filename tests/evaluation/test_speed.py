"""Speed (model/evaluation/speed.py): tokens/s against HF generate on the plain base, the width curve,
bandwidth.

No timing assertions: speed is what the benchmark reports, not what the tests check."""

from __future__ import annotations

import copy
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from model.evaluation.speed import (
    DEFAULT_DATA,
    DEFAULT_STRATEGIES,
    HF,
    bench,
    format_table,
    pass_bytes,
    plain_base,
    read_bandwidth,
    weight_bytes,
)
from model.engine.loading import wrap_model
from model.evaluation.gsm8k import load_problems
from model.engine.strategies import parse_strategies
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _alora_tiny(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok), tok, source="tiny-alora")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                     alora_invocation_tokens=[lm.mask_token_id])
    lm.model, lm.adapter = get_peft_model(lm.model, cfg).eval(), "alora"
    return lm


def test_bench_on_tiny_model(tiny_lm):
    rep = bench(tiny_lm, ["What is 2 + 3?", "Name a colour."], "standard,static:2,confadapt:0.0:4,verify:4",
                repeats=2, max_new_tokens=6, widths=(1, 2, 4), width_repeats=2, measure_bandwidth=False)
    methods = [r["method"] for r in rep["methods"]]
    assert methods == [HF, "standard", "static:2", "confadapt:0:4", "verify:4"]
    assert rep["standard_matches_hf"] is True  # our k=1 loop reproduces HF greedy exactly
    assert rep["verify_matches_standard"] == {"verify:4": True}  # lossless
    by = {r["method"]: r for r in rep["methods"]}
    assert by[HF]["ratio_to_hf"] == 1.0 and by[HF]["label"] == "HF generate, plain base"
    for r in rep["methods"]:
        assert len(r["runs"]) == 2 and r["tokens_per_second"] > 0
        assert r["ratio_to_hf"] == pytest.approx(r["tokens_per_second"] / by[HF]["tokens_per_second"])
    assert by["static:2"]["effective_k"] == 2.0 and by["standard"]["effective_k"] == 1.0
    assert by["confadapt:0:4"]["effective_k"] > 1.0  # tau = 0 keeps every proposal
    c = rep["config"]
    assert c["dtype"] == "float32" and c["forward_path"].startswith(("our kernels", "fast path")) and c["torch_threads"] == 1
    w = rep["width"]
    kernels = c["forward_path"].startswith("our kernels")  # then the torch path's pass is timed beside ours
    assert w["widths"] == [1, 2, 4] and [r["name"] for r in w["rows"]] == ["hf_plain", "ours_base"] + (
        ["torch_path"] if kernels else []) + ["ours_worker_thread"]
    if kernels:  # rows of each width bit-identical to one-token passes: all of them
        assert [(e["width"], e["mtp_equal"], e["real_equal"]) for e in rep["row_exactness"]] == [(2, 2, 2), (4, 4, 4)]
        assert rep["kernels"].startswith("our kernels")
    assert all(len(r["ms"]) == 3 and min(r["ms"]) > 0 for r in w["rows"])
    assert w["rows"][1]["ratio"][0] == 1.0  # the reference: our 1-token base pass
    assert rep["bandwidth"] is None
    table = format_table(rep)
    assert "x HF" in table and "ms per forward pass" in table and "verify:4 output == standard" in table
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ms per forward pass"))
    width_rows = lines[at + 3: at + 3 + len(w["rows"])]
    assert len({len(line) for line in width_rows}) == 1  # every row's cells in the same columns, long labels too


def test_weight_and_pass_bytes(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    untied = make_tiny(tok)
    n = sum(p.numel() for p in untied.parameters())
    assert weight_bytes(untied) == 4 * n
    emb = untied.get_input_embeddings().weight
    assert pass_bytes(untied) == 4 * n - 4 * emb.numel()  # a pass reads rows of an untied input embedding
    tied = make_tiny(tok, tied=True)
    assert pass_bytes(tied) == weight_bytes(tied) == 4 * sum(p.numel() for p in tied.parameters())  # counted once


def test_bench_with_an_adapter_uses_the_plain_base_for_hf(base_tokenizer):
    lm = _alora_tiny(base_tokenizer)
    plain = plain_base(lm)
    assert not isinstance(plain.model, PeftModel) and plain.adapter is None
    assert isinstance(lm.model, PeftModel) and lm.adapter == "alora"  # the loaded model is untouched
    assert weight_bytes(plain.model) < weight_bytes(lm.model)  # no LoRA weights in the baseline
    rep = bench(lm, ["What is 2 + 3?"], "standard,confadapt:0.5:4", repeats=1, max_new_tokens=5, widths=(1, 4),
                width_repeats=1, measure_bandwidth=False, plain=plain)
    assert rep["standard_matches_hf"] is True  # aLoRA: standard decoding is the base model
    names = [r["name"] for r in rep["width"]["rows"]]
    kernels = rep["config"]["forward_path"].startswith("our kernels")
    assert names == ["hf_plain", "ours_base", "ours_adapter"] + (["torch_path"] if kernels else []) + [
        "ours_worker_thread"]
    assert rep["config"]["adapter"] == "alora" and "aLoRA" in rep["config"]["forward_path"]


def test_read_bandwidth_on_cpu():
    bw, how = read_bandwidth(torch.device("cpu"), nbytes=32 << 20, repeats=2)
    assert bw > 1e8 and "sum" in how


def test_bench_reports_bandwidth(tiny_lm):
    import model.evaluation.speed as mb

    orig = mb.read_bandwidth
    mb.read_bandwidth = lambda device: orig(device, nbytes=32 << 20, repeats=2)
    try:
        rep = bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(1,), width_repeats=1)
    finally:
        mb.read_bandwidth = orig
    b = rep["bandwidth"]
    assert b["measured_bytes_per_second"] > 0 and b["pass_bytes"] == pass_bytes(tiny_lm.model)
    for name in ("ours_base", "hf_plain"):
        assert b[name]["bytes_per_second"] == pytest.approx(b["pass_bytes"] / (b[name]["ms_per_pass"] / 1e3))
    assert "bandwidth achieved, ours" in format_table(rep)


def test_width_table_keeps_its_columns_for_slow_rows(tiny_lm):
    """A row ten or more times the reference (the torch path on a loaded machine) or over 1,000 ms widens its
    cells: every row of the width table still puts its cells in the same columns as the header's widths."""
    rep = bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(1, 2), width_repeats=1,
                measure_bandwidth=False, llama_cpp=False)
    rows = rep["width"]["rows"]
    rows[-1]["ms"], rows[-1]["ratio"] = [123.4, 1234.5], [12.34, 123.45]
    rows[0]["ratio"] = None  # a row without ratios prints milliseconds only
    rows[0]["ms"] = [98765.4, 1.0]
    lines = format_table(rep).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ms per forward pass"))
    header, table = lines[at + 1], lines[at + 3: at + 3 + len(rows)]
    assert len({len(line) for line in table + [header]}) == 1, table
    assert "123.4 (12.34x)" in table[-1] and "1234.5 (123.45x)" in table[-1] and "98765.4" in table[0]


def test_default_prompts_are_in_the_repository():
    problems = load_problems(DEFAULT_DATA, 3)
    assert len(problems) == 3 and all(p["question"] for p in problems)
    assert "verify" in DEFAULT_STRATEGIES and len(parse_strategies(DEFAULT_STRATEGIES)) >= 3


# ------------------------------------------------------------------ llama.cpp as the second baseline
def test_llama_cpp_baseline_says_why_it_is_skipped(tiny_lm):
    """Without llama-cpp-python (CI installs nothing optional) or without a GGUF of the same weights (a tiny
    model in memory), the bench says so in one line and runs the rest."""
    from model.evaluation import llama_cpp

    rep = bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(1,), width_repeats=1,
                measure_bandwidth=False)
    note = rep["llama_cpp"]["note"]
    assert note.startswith("llama.cpp baseline skipped: ")
    assert ("not installed" in note) == (llama_cpp.available() is not None)
    assert [r["method"] for r in rep["methods"]] == [HF, "standard"]
    assert note in format_table(rep)
    rep = bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(), measure_bandwidth=False,
                llama_cpp=False)
    assert rep["llama_cpp"] == {"note": None}


def test_llama_cpp_baseline_warns_when_openmp_threads_sleep():
    """llama.cpp waits between its operations through OpenMP: under OMP_WAIT_POLICY=PASSIVE (which app.py and this
    suite set) its threads sleep there, so a multi-threaded llama.cpp baseline is slower than it can be and the
    report must say so. One thread has no OpenMP team: no caveat; nor without the policy."""
    from model.evaluation.llama_cpp import openmp_caveat

    line = openmp_caveat(2, {"OMP_WAIT_POLICY": "passive"})
    assert line is not None and "OMP_WAIT_POLICY=PASSIVE" in line and "at 2 threads" in line
    assert openmp_caveat(4, {"OMP_WAIT_POLICY": " PASSIVE "}) is not None
    assert openmp_caveat(1, {"OMP_WAIT_POLICY": "PASSIVE"}) is None
    assert openmp_caveat(2, {"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert openmp_caveat(2, {}) is None


@pytest.mark.integration
def test_llama_cpp_greedy_equals_ours_on_the_default_model(smollm2):
    """Where llama-cpp-python is installed: llama.cpp's greedy decoding of a BF16 GGUF of the same weights
    (written from the packaged file by llama.cpp itself) gives the tokens of our standard decoding."""
    from model.engine.decoding import run
    from model.engine.loading import smollm2_gguf_path
    from model.engine.strategies import standard
    from model.evaluation import llama_cpp

    if llama_cpp.available() is not None:
        pytest.skip(llama_cpp.available())
    ll = llama_cpp.LlamaCpp(llama_cpp.bf16_gguf(smollm2_gguf_path()))
    try:
        ids = smollm2.prompt_ids("What is 3 plus 4?")
        ours = run(smollm2, ids, standard(), 12).token_ids
        theirs = ll.generate(ids, 12, smollm2.stop_token_ids)
        assert sum(a == b for a, b in zip(ours, theirs)) >= 8  # bf16 weights against float32: near-ties may part
        assert len(ll.pass_ms(ids, (1, 4), repeats=1)) == 2
    finally:
        ll.close()


def test_width_curve_over_a_longer_cache(tiny_lm):
    """``width_context``: the width curve's passes follow a cache of at least that many tokens (the prompt repeated),
    reported in the table; a context the model's positions cannot hold is refused before any timing."""
    from model.evaluation.speed_passes import width_prompt

    assert len(tiny_lm.prompt_ids(width_prompt(tiny_lm, 0))) < 300
    rep = bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(1, 4), width_repeats=1,
                width_context=300, measure_bandwidth=False, llama_cpp=False)
    assert 300 <= rep["width"]["context_tokens"] < 400
    assert f"cache of {rep['width']['context_tokens']} tokens" in format_table(rep)
    for bad in (-1, 2048 - 64, 1.5, True):
        with pytest.raises(ValueError, match="width curve's context"):
            bench(tiny_lm, ["Hi"], "standard", repeats=1, max_new_tokens=3, widths=(1, 64), width_context=bad)
    assert len(tiny_lm.prompt_ids(width_prompt(tiny_lm, 2048 - 64, widest=4))) <= 2048 - 4  # room for the widest
