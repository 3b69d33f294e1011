"""The lm-eval-harness model ``mtp`` (model/evaluation/lm_eval_model.py): generate_until with our
decoding, log-likelihoods under the base model, a local task end to end (no Hub data)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from lm_eval.api.instance import Instance

from model.engine.decoding import Decoder
from model.engine.scoring import teacher_logprob, teacher_nll
from model.engine.strategies import confadapt, standard
from model.evaluation.lm_eval_model import MTPLM
from tests.conftest import TASK_DIR


def _gen_request(context: str, **gen_kwargs) -> Instance:
    return Instance(request_type="generate_until", doc={}, arguments=(context, gen_kwargs), idx=0)


def test_registered_as_mtp():
    from lm_eval.api.registry import get_model

    assert get_model("mtp") is MTPLM


def test_generate_until_matches_decoder_and_cuts_at_stop(tiny_lm):
    lm_eval_model = MTPLM(tiny_lm, strategy="standard", max_gen_toks=10)
    ctx = "Question: what is 2 + 3?\nAnswer:"
    ref = Decoder(tiny_lm, tiny_lm.tokenizer(ctx, add_special_tokens=False)["input_ids"], standard(), 10)
    for _ in ref:
        pass
    full = ref.result().text
    assert lm_eval_model.generate_until([_gen_request(ctx, until=[])], disable_tqdm=True) == [full]
    # a stop string taken from the real output cuts the text before it
    stop = full[len(full) // 2:][:3]
    assert stop
    [cut] = lm_eval_model.generate_until([_gen_request(ctx, until=[stop])], disable_tqdm=True)
    assert cut == full.split(stop, 1)[0]
    # max_gen_toks from the task wins over the model's default
    [short] = lm_eval_model.generate_until([_gen_request(ctx, until=[], max_gen_toks=3)], disable_tqdm=True)
    assert full.startswith(short) and len(short) < len(full)
    s = lm_eval_model.stats
    assert s["requests"] == 3 and s["effective_k"] == 1.0 and s["strategy"] == "standard"


def test_confadapt_stats_report_effective_k(tiny_lm, tmp_path):
    stats_file = tmp_path / "stats.json"
    m = MTPLM(tiny_lm, strategy="confadapt", tau=0.0, k_max=4, max_gen_toks=8, stats_file=str(stats_file))
    assert m.strategy == confadapt(0.0, 4)
    m.generate_until([_gen_request("Hello there", until=[]), _gen_request("One two three", until=[])],
                     disable_tqdm=True)
    s = json.loads(stats_file.read_text())
    assert s["requests"] == 2 and s["new_tokens"] <= 16
    assert s["effective_k"] == pytest.approx(s["new_tokens"] / s["forward_passes"])
    assert s["effective_k"] > 1.0  # tau = 0 keeps every proposal


def test_loglikelihood_under_base_model(tiny_lm64):
    m = MTPLM(tiny_lm64, strategy="standard")
    tok = tiny_lm64.tokenizer
    ctx, cont = "The cat sat on the", " mat"
    [(ll, greedy)] = m.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    nll, n = teacher_nll(tiny_lm64, tok(ctx, add_special_tokens=False)["input_ids"],
                         tok(cont, add_special_tokens=False)["input_ids"])
    assert ll == pytest.approx(-nll, rel=1e-9) and ll < 0 and isinstance(greedy, bool)
    # the greedy continuation is reported as greedy
    ids = tok(ctx, add_special_tokens=False)["input_ids"]
    dec = Decoder(tiny_lm64, ids, standard(), 2)
    for _ in dec:
        pass
    ll_g, greedy_g = teacher_logprob(tiny_lm64, ids, dec.generated)
    assert greedy_g and ll_g == pytest.approx(sum(math.log(p.confidences[0]) for p in dec.passes), abs=1e-6)
    [rolling] = m.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("The cat sat.",), 0)])
    assert rolling < 0


def test_bad_model_args():
    with pytest.raises(ValueError, match="tau"):
        MTPLM.create_from_arg_string("pretrained=smollm2-135m,tau=1.5")
    with pytest.raises(ValueError, match="Unknown model_args"):
        MTPLM.create_from_arg_string("pretrained=smollm2-135m,bogus=1")


def test_simple_evaluate_on_local_task_tiny_model(tiny_lm):
    """The harness end to end (task loading, filters, metric) on the local task with a tiny model."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    m = MTPLM(tiny_lm, strategy="confadapt", tau=0.5, k_max=4, max_gen_toks=8)
    tasks = TaskManager(include_path=str(TASK_DIR), include_defaults=False)  # skip indexing lm-eval's own tasks
    out = lm_eval.simple_evaluate(model=m, tasks=["gsm8k_mini"], task_manager=tasks, limit=2, log_samples=True)
    res = out["results"]["gsm8k_mini"]
    assert res["exact_match,flexible-extract"] in (0.0, 0.5, 1.0)
    assert m.stats["requests"] == 2 and m.stats["effective_k"] >= 1.0
    samples = out["samples"]["gsm8k_mini"]
    assert [s["target"] for s in samples] == ["5", "12"]


def test_model_without_bos_or_eos_in_lm_eval(tiny_lm):
    from model.evaluation.lm_eval_model import MTPLM

    tok = copy.deepcopy(tiny_lm.tokenizer)
    lm = dataclasses.replace(tiny_lm, tokenizer=tok, stop_token_ids=(), prompt_format="bos_newlines")
    tok.bos_token = None
    assert lm.prompt_ids("hi")[0] != tok.convert_tokens_to_ids("<|im_start|>")
    m = MTPLM(lm, strategy="standard")
    with pytest.raises(ValueError, match="neither a BOS nor an EOS"):
        m._prefix_id()


def test_generate_until_honours_do_sample_and_temperature(tiny_lm):
    """``do_sample`` / ``temperature`` sample as transformers reads them (request i seeded seed + i: the same
    texts on a rerun); ``do_sample=False`` stays greedy whatever the temperature."""
    ctx = "Question: what is 2 + 3?\nAnswer:"
    greedy = MTPLM(tiny_lm, strategy="standard", max_gen_toks=12).generate_until([_gen_request(ctx)], True)
    off = MTPLM(tiny_lm, strategy="standard", max_gen_toks=12).generate_until(
        [_gen_request(ctx, do_sample=False, temperature=0.9)], True)
    assert off == greedy

    def sampled(seed):
        m = MTPLM(tiny_lm, strategy="verify", k_max=3, max_gen_toks=12, seed=seed)
        return m.generate_until([_gen_request(ctx, do_sample=True, temperature=1.5, top_p=0.95)] * 4, True)

    a = sampled(5)
    assert a == sampled(5) and a != sampled(6)
    assert len(set(a)) > 1 and a != greedy * 4  # request i draws with its own seed
    assert MTPLM(tiny_lm, strategy="standard")._sampling({"temperature": 0.7}, 3).seed == 3
    with pytest.raises(ValueError, match="top-p"):
        MTPLM(tiny_lm, strategy="standard")._sampling({"do_sample": True, "top_p": 2}, 0)
