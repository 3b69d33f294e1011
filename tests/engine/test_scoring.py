"""An answer's log-likelihood under the teacher (model/engine/scoring.py)."""

from __future__ import annotations

import math

import pytest
import torch

from model.engine.decoding import Decoder
from model.engine.scoring import teacher_nll
from model.engine.strategies import standard


def test_teacher_nll_of_standard_decoding_is_minus_log_confidence(tiny_lm64):
    ids = tiny_lm64.prompt_ids("What is 2 + 3?")
    dec = Decoder(tiny_lm64, ids, standard(), 6)
    recs = list(dec)
    nll, n = teacher_nll(tiny_lm64, ids, dec.generated)
    assert n == len(dec.generated) == 6
    expected = -sum(math.log(r.confidences[0]) for r in recs)
    assert nll == pytest.approx(expected, abs=1e-5)  # confidences are float32
    assert teacher_nll(tiny_lm64, ids, []) == (0.0, 0)


@pytest.mark.parametrize("path", ["fast", "library"])
def test_teacher_score_on_a_prompt_cache_feeds_only_the_answer(base_tokenizer, path):
    """Given a KV cache of the teacher over the prompt (the standard side's cache of an aLoRA model: real
    tokens run the base weights), the scoring pass feeds the prompt's last token and the answer only (the
    prompt's other entries are copied): the same log-probability and greedy flag as a pass over the whole
    sequence (float64), and the given cache is left as it was."""
    from transformers import DynamicCache

    from model.engine.scoring import teacher_logprob
    from tests.engine.test_fast_forward import _tiny

    lm = _tiny(base_tokenizer, adapter="alora")
    ctx = lm.prompt_ids("What is 2 + 3?")
    dec = Decoder(lm, ctx, standard(), 8)
    list(dec)
    answer = dec.generated
    cache, cached_ids = dec.cache, dec.cached_ids
    if path == "library":  # a transformers cache over the same ids
        cache = DynamicCache(config=lm.model.config)
        lm.forward(torch.tensor([cached_ids]), cache, num_masks=0, logits_to_keep=1)
    assert cached_ids[:len(ctx)] == ctx and len(cached_ids) > len(ctx)
    before = [layer.keys.clone() for layer in cache.layers]
    want = teacher_logprob(lm, ctx, answer)

    fed = []
    run = lm.forward
    lm.forward = lambda ids, *a, **k: fed.append(ids.shape[1]) or run(ids, *a, **k)
    try:
        got = teacher_logprob(lm, ctx, answer, context_cache=(cache, cached_ids))
        short = teacher_logprob(lm, ctx, answer, context_cache=(cache, cached_ids[:3]))  # a shorter prefix
        other = teacher_logprob(lm, ctx, answer, context_cache=(cache, [t + 1 for t in cached_ids]))  # none shared
    finally:
        lm.forward = run
    assert fed == [1 + len(answer), len(ctx) - 3 + len(answer), len(ctx) + len(answer)]  # none shared: all
    for res in (got, short, other):
        assert res[0] == pytest.approx(want[0], abs=1e-9) and res[1] == want[1]
    assert cache.get_seq_length() == len(cached_ids)
    assert all(torch.equal(layer.keys, b) for layer, b in zip(cache.layers, before))
