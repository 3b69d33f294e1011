"""Many sequences in one forward pass (model/engine/batch.py, LoadedModel.forward_batch on our kernels): each
generation's records are identical, bit for bit, to running it alone, whatever the mix of strategies, prompt lengths and
join / leave order."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from model.engine import kernels as K
from model.engine.batch import BatchRunner
from model.engine.decoding import Decoder
from model.engine.loading import wrap_model
from model.engine.strategies import confadapt, standard, static_k, verify
from model.errors import NonFiniteLogitsError
from tests.conftest import make_tiny

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(K.choose_isa("auto") is None, reason="no kernel path on this CPU")]

PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "What is 2 + 3?",
           "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much?",
           "Hi", "Betty is saving money for a new wallet which costs $100."]
STRATEGIES = [standard(), confadapt(0.3, 4), verify(4, "full"), static_k(3), verify(3)]


@pytest.fixture(scope="module")
def lm(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    m = wrap_model(make_tiny(tok, dtype=torch.bfloat16), tok, source="tiny-llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                     alora_invocation_tokens=[m.mask_token_id], trainable_token_indices=[m.mask_token_id])
    torch.manual_seed(1)
    m.model, m.adapter = get_peft_model(m.model, cfg).eval(), "alora"
    assert m.forward_path.startswith("our kernels"), m.forward_path
    return m


def _signature(dec):
    return [(r.kept, r.proposals, r.confidences, r.verification and r.verification.drafts,
             r.verification and r.verification.block_proposals) for r in dec.passes], dec.generated


def _solo(lm, prompt, strategy, n):
    dec = Decoder(lm, lm.prompt_ids(prompt), strategy, n)
    for _ in dec:
        pass
    return _signature(dec)


def test_forward_batch_rows_equal_solo_passes(lm):
    m = lm.mask_token_id
    eng = lm.fast_engine()
    caches, solo_caches, items = [], [], []
    for i, p in enumerate(PROMPTS[:3]):
        ids = lm.prompt_ids(p)
        a, b = lm.new_cache(), lm.new_cache()
        lm.forward(torch.tensor([ids]), a, 0, 1)
        lm.forward(torch.tensor([ids]), b, 0, 1)
        caches.append(a)
        solo_caches.append(b)
        tokens = [100 + i] + [m] * (i + 1)
        items.append(lm.pass_input(tokens, a, num_masks=i + 1, logits_to_keep=len(tokens)))
    vis = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    items[2] = lm.pass_input([7, m, m], caches[2], num_masks=2, logits_to_keep=3, positions=[0, 1, 1], visible=vis)
    assert [p.adapter_rows for p in items] == [1, 2, 2]  # aLoRA: the mask rows
    assert eng.shares_passes
    outs = lm.forward_batch(items)
    for it, cache, out in zip(items, solo_caches, outs):
        solo = lm.forward(it.tokens[None], cache, it.num_masks, it.logits_to_keep, positions=it.positions,
                          visible=it.visible)
        assert torch.equal(out[None], solo)
    for a, b in zip(caches, solo_caches):
        assert a.length == b.length
        assert all(torch.equal(x[:, :, : a.length], y[:, :, : b.length]) for x, y in zip(a.k + a.v, b.k + b.v))


def test_mixed_strategies_and_staggered_joins_equal_solo(lm):
    lengths = [24, 9, 30, 16, 20]
    want = [_solo(lm, p, s, n) for p, s, n in zip(PROMPTS, STRATEGIES, lengths)]
    runner = BatchRunner(lm, max_rows=48, max_sessions=4)
    decs = [Decoder(lm, lm.prompt_ids(p), s, n) for p, s, n in zip(PROMPTS, STRATEGIES, lengths)]
    runner.add(decs[0])
    runner.add(decs[1])
    shared = 0
    step = 0
    while runner.pending or step < 6:
        if step == 2:
            runner.add(decs[2])
        if step == 4:
            runner.add(decs[3])
            runner.add(decs[4])  # beyond max_sessions while 4 are active: waits
        res = runner.step()
        shared += len(res.records) > 1
        step += 1
        if step > 500:
            raise AssertionError("the runner did not finish")
    assert shared > 3  # passes were shared
    for dec, w in zip(decs, want):
        assert _signature(dec) == w


def test_stop_one_touches_no_other(lm):
    decs = [Decoder(lm, lm.prompt_ids(p), s, 20) for p, s in zip(PROMPTS[:3], STRATEGIES[:3])]
    want = [_solo(lm, p, s, 20) for p, s in zip(PROMPTS[:3], STRATEGIES[:3])]
    runner = BatchRunner(lm)
    for d in decs:
        runner.add(d)
    runner.step()
    runner.step()
    runner.stop(decs[1])
    passes = len(decs[1].passes)
    res = runner.step()
    assert decs[1] not in res.records and len(decs[1].passes) == passes
    runner.run()
    assert _signature(decs[0]) == want[0] and _signature(decs[2]) == want[2]


def test_a_failing_request_ends_alone(lm):
    """A decoder whose logits are not finite ends with its error; the others finish as alone."""
    bad_lm = copy.copy(lm)
    good = Decoder(lm, lm.prompt_ids(PROMPTS[0]), STRATEGIES[1], 12)
    bad = Decoder(lm, lm.prompt_ids(PROMPTS[1]), standard(), 12)
    runner = BatchRunner(lm, max_rows=256)  # both prefills in the first pass
    runner.add(good)
    runner.add(bad)
    real_finish = bad.finish_pass

    def poisoned(layout, logits, t0):  # this request's pass comes back non-finite
        return real_finish(layout, torch.full_like(logits, float("nan")), t0)

    bad.finish_pass = poisoned
    first = runner.step()
    assert good in first.records
    assert isinstance(first.errors.get(bad), NonFiniteLogitsError) and bad.done
    runner.run()
    assert _signature(good) == _solo(bad_lm, PROMPTS[0], STRATEGIES[1], 12)


def test_refuses_a_model_off_our_kernels(base_tokenizer):
    tok = copy.deepcopy(base_tokenizer)
    m = wrap_model(make_tiny(tok, dtype=torch.float64), tok, source="tiny-llama")
    with pytest.raises(ValueError, match="need our CPU kernels"):
        BatchRunner(m)


def test_concurrency_bench_on_the_tiny_model(lm):
    from model.evaluation.concurrency import concurrency_bench, format_concurrency

    rows = concurrency_bench(lm, PROMPTS[:3], [standard(), confadapt(0.3, 4)], [1, 3], max_new_tokens=8)
    assert [(r["concurrency"], r["strategy"]) for r in rows] == [(1, "standard"), (1, "confadapt:0.3:4"),
                                                                 (3, "standard"), (3, "confadapt:0.3:4")]
    assert all(all(r["identical_to_solo"]) and r["aggregate_tokens_per_second"] > 0 for r in rows)
    assert rows[2]["ratio_to_standard"] == 1.0 and rows[3]["rows_per_pass"] > rows[1]["rows_per_pass"]
    assert "identical" in format_concurrency(rows)


def test_sixteen_requests_at_once_equal_solo(lm):
    """16 concurrent requests of four strategies (caps admit 8 at a time, the rest queue): none errors, none
    crosses another, each equals its solo run."""
    specs = [(PROMPTS[i % len(PROMPTS)], STRATEGIES[i % 4], 6 + i % 5) for i in range(16)]
    want = {}
    for p, s, n in specs:
        want.setdefault((p, s.spec, n), _solo(lm, p, s, n))
    runner = BatchRunner(lm, max_rows=128, max_sessions=8)
    decs = [Decoder(lm, lm.prompt_ids(p), s, n) for p, s, n in specs]
    for d in decs:
        runner.add(d)
    steps = runner.run()
    assert not runner.errors and max(len(r.records) for r in steps) == 8
    for d, (p, s, n) in zip(decs, specs):
        assert _signature(d) == want[(p, s.spec, n)]


def test_concurrency_bench_staggered_arrivals_equal_solo_and_report(lm):
    """Staggered arrivals (request i joins before shared pass i, its prefill beside the others' decoding rows):
    every request equals its solo run in every round (``repeats="auto"``: 4 rounds at 1 request, 1 at 4); the
    report is strict JSON with the keys the README's plot reads."""
    import json

    from model.evaluation.concurrency import concurrency_bench, concurrency_report, dumps_strict, format_ratios

    strategies = [standard(), confadapt(0.3, 4), verify(4, "full")]
    rows = concurrency_bench(lm, PROMPTS[:4], strategies, [1, 4], max_new_tokens=8,
                             arrivals=("together", "staggered"), repeats="auto")
    assert [(r["concurrency"], r["arrival"], r["strategy"]) for r in rows] == [
        (n, a, s.spec) for n in (1, 4) for a in ("together", "staggered") for s in strategies]
    for r in rows:
        assert len(r["identical_to_solo"]) == r["concurrency"] and all(r["identical_to_solo"]), r
        rounds = 4 // r["concurrency"]
        assert r["repeats"] == rounds and len(r["aggregate_tokens_per_second_rounds"]) == rounds
        assert r["errors"] == 0 and r["tokens"] == 8 * 4 and r["rows_per_pass"] > 0
        assert r["aggregate_tokens_per_second"] > 0 and r["median_request_tokens_per_second"] > 0
    staggered = [r for r in rows if r["arrival"] == "staggered" and r["concurrency"] == 4]
    assert all(r["arrived_at_pass"] == [0, 1, 2, 3] for r in staggered)
    assert all(r["arrived_at_pass"] == [0] * 4 for r in rows if r["arrival"] == "together" and r["concurrency"] == 4)
    assert all(r["ratio_to_standard"] == 1.0 == r["ratio_to_standard_cpu"] for r in rows if r["strategy"] == "standard")
    assert all(r["aggregate_tokens_per_cpu_second"] > 0 for r in rows)

    report = json.loads(dumps_strict(concurrency_report(rows, threads=1, max_new_tokens=8)))
    assert set(report) == {"concurrency", "config", "ratios", "all_identical_to_solo"}
    assert report["all_identical_to_solo"] is True and report["config"]["threads"] == 1
    assert "load_average" in report["config"]
    assert set(report["ratios"]) == {"together", "staggered"}
    assert set(report["ratios"]["staggered"]) == {s.spec for s in strategies}
    assert set(report["ratios"]["staggered"]["verify:4:full"]) == {"1", "4"}
    assert set(report["concurrency"][0]) >= {
        "concurrency", "arrival", "strategy", "aggregate_tokens_per_second", "median_request_tokens_per_second",
        "ratio_to_standard", "rows_per_pass", "identical_to_solo", "arrived_at_pass"}
    table = format_ratios(rows)
    assert "staggered" in table and "x verify:4:full" in table and table.splitlines()[-1].endswith("all")
    assert "CPU second" in format_ratios(rows, cpu=True)
