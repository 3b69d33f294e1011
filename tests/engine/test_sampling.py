"""Sampling (model/engine/sampling.py, the decoder's sampled accept phase): settings and their checks, the
filters, greedy at temperature 0 bit for bit, the same seed the same text (alone or in a shared pass), and
lossless verification exact in distribution, computed by enumerating every random choice of the real decoder
on a tiny model (no sampling noise)."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict

import pytest
import torch

from model.engine.decoding import Decoder, run
from model.engine.loading import wrap_model
from model.engine.sampling import Sampling, TokenSampler, parse_sampling, speculative_accept
from model.engine.strategies import confadapt, standard, static_k, verify
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- settings and filters
def test_settings_are_checked_in_the_users_words():
    assert parse_sampling() == Sampling() and parse_sampling().greedy
    assert parse_sampling("0.7", "0.9", "40", "3") == Sampling(0.7, 0.9, 40, 3)
    assert parse_sampling(0.7, "", None, "") == Sampling(0.7, 1.0, 0, None)  # empty boxes are the defaults
    for bad, words in [(dict(temperature=-1), "temperature"), (dict(temperature="hot"), "temperature"),
                       (dict(temperature=float("nan")), "temperature"), (dict(top_p=0), "top-p"),
                       (dict(top_p=1.5), "top-p"), (dict(top_k=2.5), "top-k"), (dict(top_k=-1), "top-k"),
                       (dict(seed=-3), "seed"), (dict(seed="x"), "seed")]:
        with pytest.raises(ValueError, match=words):
            parse_sampling(**bad)
    assert Sampling(0.7, 0.95).label == "temperature 0.7, top-p 0.95" and Sampling().label == "greedy"


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]))  # last: the mask token (never)
    p = Sampling(1.0).probabilities(logits, mask_token_id=4)
    assert torch.allclose(p, torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]))
    p = Sampling(1.0, top_k=2).probabilities(logits, 4)
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    p = Sampling(1.0, top_p=0.7).probabilities(logits, 4)  # 0.5 < 0.7: the second token is needed, not the third
    assert torch.allclose(p, torch.tensor([[2 / 3, 1 / 3, 0, 0, 0]]))
    p = Sampling(1.0, top_p=0.01).probabilities(logits, 4)  # the most likely token always stays
    assert torch.allclose(p, torch.tensor([[1.0, 0, 0, 0, 0]]))
    hot = Sampling(2.0).probabilities(logits, 4)
    assert hot[0, 0] < 0.5 and hot[0, 3] > 0.1  # a higher temperature flattens
    with pytest.raises(ValueError, match="Greedy"):
        Sampling().probabilities(logits)


def test_speculative_accept_keeps_p():
    """One draft place, enumerated: accepted with min(1, p/q), else the residual: the emitted token is p."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.2, 0.7, 0.1]])
    dist = torch.zeros(3)
    for x in range(3):  # the draft drawn from q
        ratio = min(1.0, float(p[0, x] / q[0, x]))
        dist[x] += q[0, x] * ratio
        residual = (p[0] - q[0]).clamp(min=0)
        dist += q[0, x] * (1 - ratio) * residual / residual.sum()
    assert torch.allclose(dist, p[0])
    s = TokenSampler(0)
    a, tok, ratios = speculative_accept(s, [1], p, q)
    assert ratios == [pytest.approx(0.3 / 0.7)] and (a, tok) in {(1, 0), (1, 1), (1, 2), (0, 0)}


def test_a_draw_follows_the_probabilities_and_never_picks_a_zero():
    """TokenSampler.draw: 40,000 draws from a 6-token distribution land within 0.01 of each probability, a token
    of probability 0 (first, middle, last) is never drawn, a one-token support always gives that token, and a row
    of a vocabulary's size in float32 whose sum is off 1 by rounding draws inside its support."""
    s = TokenSampler(7)
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    counts = torch.bincount(torch.tensor([s.draw(p) for _ in range(40_000)]), minlength=6).double() / 40_000
    assert counts[0] == counts[2] == counts[5] == 0
    assert torch.allclose(counts, p.double(), atol=0.01), counts
    for only in (0, 3, 5):
        one = torch.zeros(6)
        one[only] = 1.0
        assert {s.draw(one) for _ in range(50)} == {only}
    wide = torch.zeros(49_153)
    wide[-3:] = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    wide[:1000] = 1e-9  # many tiny entries: the float32 sum is not exactly 1
    drawn = [s.draw(wide) for _ in range(200)]
    assert all(t >= 49_153 - 3 or t < 1000 for t in drawn)


# ----------------------------------------------------------------------------- the real decoder, enumerated
class Enumerating(TokenSampler):
    """A random source that follows a script of choices (the index among the options of each decision) and
    multiplies the probabilities of the choices it made: depth-first enumeration of every run."""

    def __init__(self, script):
        super().__init__(0)
        self.script, self.i, self.prob, self.options = list(script), 0, 1.0, []

    def _pick(self, outcomes):
        outcomes = [(o, p) for o, p in outcomes if p > 0]
        choice = self.script[self.i] if self.i < len(self.script) else 0
        self.options.append(len(outcomes))
        self.i += 1
        value, p = outcomes[choice]
        self.prob *= p
        return value

    def draw(self, probs):
        support = torch.nonzero(probs > 0).flatten().tolist()
        return self._pick([(t, float(probs[t])) for t in support])

    def coin(self, p):
        return self._pick([(True, float(p)), (False, 1.0 - float(p))])


def fork(dec: Decoder) -> Decoder:
    """A copy of ``dec`` with its own KV cache and state; the model, its engine and the random source are not
    copied (the copy gets no random source: the caller gives it one)."""
    keep = {id(dec.lm): dec.lm, id(dec.sampler): None}
    engine = getattr(dec.cache, "engine", None)
    if engine is not None:
        keep[id(engine)] = engine
    return copy.deepcopy(dec, keep)


def exact_distribution(lm, prompt, strategy, sampling, n):
    """The exact distribution of the first ``n`` tokens the decoder emits, by enumerating its choices, and the
    number of distinct runs. Depth first over the decoder's passes, each driven through its own steps as a batch
    runner drives it (``next_layout``, ``pass_input``, ``forward_batch``, ``finish_pass``): a pass's forward runs
    once, and its acceptance once per combination of the choices made in it, each on a copy of the decoder taken
    after the forward (a run's choices in one pass never change that pass's logits)."""
    dist: dict = defaultdict(float)
    runs = 0
    stack = [(Decoder(lm, prompt, strategy, n, sampling), 1.0)]
    with torch.inference_mode():
        while stack:
            dec, prob = stack.pop()
            if dec.done:
                dist[tuple(dec.generated)] += prob
                runs += 1
                continue
            with lm.engine_step(dec.cache):
                layout = dec.next_layout()
                logits = lm.forward_batch([dec.pass_input(layout)])[0]
                script: list[int] = []
                while True:  # every combination of this pass's choices
                    child = fork(dec)
                    child.sampler = Enumerating(script)
                    child.finish_pass(layout, logits, 0.0)
                    stack.append((child, prob * child.sampler.prob))
                    options = child.sampler.options
                    script = list(script) + [0] * (len(options) - len(script))
                    while script and script[-1] + 1 >= options[len(script) - 1]:
                        script.pop()
                    if not script:
                        break
                    script[-1] += 1
    return dict(dist), runs


@pytest.fixture(scope="module")
def tiny64(base_tokenizer):
    """A tiny float64 Llama whose output layer favours 4 ordinary tokens at every position (the others' rows
    scaled down): the real places and the masks then propose from overlapping supports, so speculative
    sampling accepts some drafts, rejects others, and a rejection's residual differs from ``p`` (a random model
    left alone proposes unrelated tokens at its masks: every draft rejected, the residual equal to ``p``, and a
    wrong residual would go unnoticed)."""
    tok = copy.deepcopy(base_tokenizer)
    model = make_tiny(tok, dtype=torch.float64)
    favoured = [tok.convert_tokens_to_ids(t) for t in ("Ġthe", "Ġa", "Ġof", "Ġand")]
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        keep = w[favoured].clone()
        w.mul_(0.05)
        w[favoured] = keep
    return wrap_model(model, tok, source="tiny-f64")


SAMPLING = Sampling(temperature=3.0, top_k=2)


@pytest.mark.parametrize("strategy,n", [(verify(2), 3), (verify(3), 3), (verify(3, "full"), 3), (verify(4, "0/2"), 2),
                                        (verify(3, "auto"), 3)], ids=lambda s: getattr(s, "spec", str(s)))
def test_lossless_verify_is_exact_in_distribution(tiny64, strategy, n, monkeypatch):
    """Every n-token continuation (n = 3; 2 for the widest layout, whose runs branch most): verify's probability
    equals standard sampling's (within float32 rounding), for each k_max and layout offered; the distribution is
    not degenerate, and drafts are both accepted and rejected on the way. ``verify:auto`` chooses its shape from
    the CPU's measured width costs (on a loaded CPU it may choose one token a pass, no drafts at all): here every
    width is made to cost one pass, so that it drafts on every CPU."""
    if strategy.auto:
        from model.engine import width

        monkeypatch.setattr(width, "_AUTO", {})
        monkeypatch.setattr(width, "pass_times", lambda lm, widths, repeats=5, **kw: {w: [1.0] * repeats
                                                                                       for w in widths})
    prompt = tiny64.prompt_ids("Tell me a story.")
    ref, _ = exact_distribution(tiny64, prompt, standard(), SAMPLING, n)
    assert sum(ref.values()) == pytest.approx(1.0, abs=1e-6)
    assert sum(1 for v in ref.values() if v > 0.05) >= 3
    got, runs = exact_distribution(tiny64, prompt, strategy, SAMPLING, n)
    assert runs > len(ref)  # the coins and the drafts branch more than standard's draws
    assert set(got) <= set(ref)
    for seq, p in ref.items():
        assert got.get(seq, 0.0) == pytest.approx(p, abs=2e-6), seq


def test_confadapt_draws_each_proposal_from_its_own_position(tiny64):
    """tau 0: every proposal kept (k_max per pass); tau 1: the first only, which is standard sampling exactly
    (same distribution over 2 tokens). Static k keeps k per pass."""
    prompt = tiny64.prompt_ids("Hi")
    ref, _ = exact_distribution(tiny64, prompt, standard(), SAMPLING, 2)
    one, _ = exact_distribution(tiny64, prompt, confadapt(1.0, 3), SAMPLING, 2)
    assert one.keys() == ref.keys() and all(one[k] == pytest.approx(ref[k], abs=1e-6) for k in ref)
    dec = Decoder(tiny64, prompt, confadapt(0.0, 3), 6, Sampling(1.0, seed=1))
    assert [len(r.kept) for r in dec] == [3, 3]
    dec = Decoder(tiny64, prompt, static_k(2), 6, Sampling(1.0, seed=1))
    recs = list(dec)
    assert [len(r.kept) for r in recs] == [2, 2, 2]
    for r in recs:  # a drawn proposal's confidence is its probability under the model's distribution
        assert all(0 < c <= 1 for c in r.confidences)


def test_confadapt_thresholds_the_models_own_probability_not_the_tempered_one(tiny64):
    """tau is compared with the drawn token's probability under the model's distribution (softmax at temperature
    1), whatever the sampling temperature: near temperature 0 the draws are the greedy proposals and ConfAdapt
    keeps exactly what greedy ConfAdapt keeps (a tempered probability would be ~1 for every draw and keep every
    proposal); the recorded confidences are the greedy ones."""
    prompt = tiny64.prompt_ids("Hi there")
    strategy = confadapt(0.5, 4)
    greedy = run(tiny64, prompt, strategy, 12)
    assert {len(p.kept) for p in greedy.passes} != {4}  # tau 0.5 cuts some blocks short
    cold = run(tiny64, prompt, strategy, 12, Sampling(1e-4, seed=3))
    assert cold.token_ids == greedy.token_ids
    assert [len(p.kept) for p in cold.passes] == [len(p.kept) for p in greedy.passes]
    for a, b in zip(cold.passes, greedy.passes):
        assert a.confidences == pytest.approx(b.confidences, abs=1e-6)


# ----------------------------------------------------------------------------- seeds and greedy
def test_temperature_zero_is_greedy_bit_for_bit(tiny64):
    prompt = tiny64.prompt_ids("Hi there")
    for s in (standard(), confadapt(0.5, 3), verify(3, "full")):
        a, b = run(tiny64, prompt, s, 10), run(tiny64, prompt, s, 10, Sampling(0.0, top_p=0.5, seed=4))
        assert a.token_ids == b.token_ids
        assert [p.confidences for p in a.passes] == [p.confidences for p in b.passes]


def test_same_seed_same_text_different_seed_differs(tiny64):
    prompt = tiny64.prompt_ids("Hi there")
    s = Sampling(2.0, seed=11)
    for strategy in (standard(), confadapt(0.3, 3), verify(3)):
        a, b = run(tiny64, prompt, strategy, 12, s), run(tiny64, prompt, strategy, 12, s)
        assert a.token_ids == b.token_ids and a.sampling["seed"] == 11
    texts = {tuple(run(tiny64, prompt, standard(), 12, Sampling(2.0, seed=i)).token_ids) for i in range(5)}
    assert len(texts) > 1
    fresh = run(tiny64, prompt, standard(), 4, Sampling(2.0))
    assert isinstance(fresh.sampling["seed"], int)  # a fresh seed is reported, so the run can be repeated
    again = run(tiny64, prompt, standard(), 4, Sampling(2.0, seed=fresh.sampling["seed"]))
    assert again.token_ids == fresh.token_ids


def test_a_request_in_a_shared_pass_samples_what_it_samples_alone(base_tokenizer):
    """Four sampled requests (standard, ConfAdapt, verify linear and tree) share passes on our kernels: each
    one's tokens equal its solo run with the same seed (its own generator; rows exact)."""
    from model.engine import kernels as K
    from model.engine.batch import BatchRunner

    if K.choose_isa("auto") is None:
        pytest.skip("no kernel path on this CPU")
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok), tok, source="tiny")
    cases = [(standard(), "Hi"), (confadapt(0.2, 3), "Tell me a story."), (verify(3), "Hello"),
             (verify(3, "full"), "Why is the sky blue?")]
    solo = [run(lm, lm.prompt_ids(p), s, 10, Sampling(1.5, top_p=0.9, seed=i)).token_ids
            for i, (s, p) in enumerate(cases)]
    decoders = [Decoder(lm, lm.prompt_ids(p), s, 10, Sampling(1.5, top_p=0.9, seed=i)) for i, (s, p) in enumerate(cases)]
    runner = BatchRunner(lm)
    for d in decoders:
        runner.add(d)
    steps = runner.run()
    assert any(len(st.records) > 1 for st in steps)  # passes were shared
    assert [d.generated for d in decoders] == solo


# ----------------------------------------------------------------------------- the real model, sampled
def sampled_marginals(lm, prompt: list[int], strategy, n: int, sampling: Sampling, first_seed: int) -> list:
    """Counts of the 2nd and 3rd generated token over ``n`` sampled 3-token answers (seeds ``first_seed + i``),
    the prompt's KV cache computed once and copied to each; shared passes on our kernels where they load."""
    from collections import Counter

    from model.engine import kernels as K
    from model.engine.batch import BatchRunner

    base = Decoder(lm, prompt, standard(), 1)
    base.prefill_chunk(len(prompt))
    held = base.cache.get_seq_length()
    decoders = [Decoder(lm, prompt, strategy, 3, dataclasses.replace(sampling, seed=first_seed + i),
                        prefix=(base.cache.copy_prefix(held), prompt[:held])) for i in range(n)]
    if K.choose_isa("auto") is not None:
        runner = BatchRunner(lm, max_rows=256, max_sessions=64)
        for d in decoders:
            runner.add(d)
        runner.run()
    else:
        for d in decoders:
            for _ in d:
                pass
    return [Counter(d.generated[j] for d in decoders) for j in (1, 2)]


def total_variation(a, b) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


@pytest.mark.slow
def test_lossless_verify_samples_standard_samplings_distribution_on_smollm2(smollm2_adapter_bf16):
    """SmolLM2 with the shipped adapter, bf16: 600 sampled answers each side (temperature 0.4), the 2nd and 3rd
    tokens' marginals of lossless verify:2 against standard sampling: total variation < 0.12 (two sets of 600
    standard samples differ by 0.03-0.06 on this prompt, so the bound leaves a margin for sampling noise on any
    CPU). ConfAdapt at tau 0, which keeps every sampled mask proposal and is not lossless, is far off (> 0.3):
    the check can tell."""
    lm = smollm2_adapter_bf16
    prompt = lm.prompt_ids("Write a haiku about autumn.")
    s = Sampling(0.4)
    ref = sampled_marginals(lm, prompt, standard(), 600, s, 0)
    got = sampled_marginals(lm, prompt, verify(2), 600, s, 10_000)
    assert min(len(c) for c in ref) >= 5  # not degenerate: several tokens at each place
    tvs = [total_variation(a, b) for a, b in zip(ref, got)]
    assert max(tvs) < 0.12, tvs
    lossy = sampled_marginals(lm, prompt, confadapt(0.0, 3), 100, s, 20_000)
    assert max(total_variation(a, b) for a, b in zip(ref, lossy)) > 0.3
