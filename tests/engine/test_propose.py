"""The proposals of a pass (paper 3.4): greedy token and confidence of every row, computed by our kernels
(``mtp_propose``) and by torch; a bf16 model's logits stored by the kernel in bf16; the rotary rows and KV
cache addresses a pass reuses.

Exact where behaviour is exact: the token is the first largest logit without the mask token on both paths;
the confidence is a float32 softmax maximum, whose sum our kernel takes in another order (the bound below is
~10x the float32 rounding of a 49,153-term sum)."""

from __future__ import annotations

import pytest
import torch

from model.engine.phases import propose
from model.errors import NonFiniteLogitsError
from tests.engine.test_kernels import RUNNABLE, _tiny, on_kernels

pytestmark = pytest.mark.skipif(not RUNNABLE, reason="our kernels cannot run on this CPU")
CONF_RTOL = 1e-5


@pytest.fixture(params=RUNNABLE)
def engine(request, base_tokenizer, monkeypatch):
    """Our kernels' backend of a tiny bf16 model, on each path this CPU runs."""
    return on_kernels(_tiny(base_tokenizer), request.param, monkeypatch).fast_engine()


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 49153), (5, 49153), (3, 1001), (2, 7)])
def test_kernel_proposals_equal_torch(engine, dtype, rows, vocab):
    """Tokens equal torch's, confidences within CONF_RTOL; the mask token's logit, made the largest, is skipped;
    of two equal largest logits the first wins."""
    x = _logits(rows, vocab, dtype)
    mask = vocab - 1 if vocab > 10 else 3
    x[:, mask] = 100.0
    x[0, 1] = x[0, vocab // 2] = 50.0  # a tie: both paths take index 1
    tok, conf = propose(x, mask, engine)
    ref_tok, ref_conf = propose(x, mask)  # no backend: torch
    assert tok == ref_tok and tok[0] == 1 and mask not in tok
    assert conf == pytest.approx(ref_conf, rel=CONF_RTOL)
    assert all(0.0 < c <= 1.0 for c in conf)


def test_kernel_confidence_is_close_to_float64(engine):
    x = _logits(4, 49153, torch.float32, seed=3)
    _, conf = propose(x, 49152, engine)
    exact = torch.softmax(x[:, :49152].double(), -1).amax(-1)
    assert conf == pytest.approx(exact.tolist(), rel=CONF_RTOL)


def test_kernel_proposals_do_not_depend_on_threads(engine, monkeypatch):
    x = _logits(7, 49153, torch.bfloat16, seed=5)
    got = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        got.append(propose(x, 49152, engine))
    assert got[0] == got[1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_logit_is_named(engine, bad):
    x = _logits(3, 1001, torch.float32)
    x[1, 17] = bad
    with pytest.raises(NonFiniteLogitsError, match="at 1 of 3 positions"):
        propose(x, 1000, engine)


def test_minus_infinity_alone_is_a_masked_logit(engine):
    x = _logits(2, 1001, torch.bfloat16)
    x[:, :500] = float("-inf")
    tok, conf = propose(x, 1000, engine)
    ref_tok, ref_conf = propose(x, 1000)
    assert tok == ref_tok and all(t >= 500 for t in tok)
    assert conf == pytest.approx(ref_conf, rel=CONF_RTOL)


def test_a_bad_shape_is_refused_by_the_kernel(engine):
    with pytest.raises(RuntimeError, match="refused"):
        engine.propose(torch.zeros(2, 0), 0)


# ------------------------------------------------------------ what a pass reuses
def test_bf16_logits_are_the_float32_logits_rounded(base_tokenizer, monkeypatch, one_torch_thread):
    """A bf16 model's logits come out of the kernel in bf16, with no float32 copy: the bits of the same pass's
    float32 logits rounded to nearest even, as ``Tensor.to`` rounds them."""
    lm = on_kernels(_tiny(base_tokenizer), RUNNABLE[0], monkeypatch)
    eng, ids = lm.fast_engine(), torch.tensor([lm.prompt_ids("The lighthouse keeper")])
    assert eng.logits_dtype == torch.bfloat16
    with torch.no_grad():
        bf16 = lm.forward(ids, lm.new_cache(), 0, ids.shape[1])
        eng.logits_dtype = torch.float32
        f32 = lm.forward(ids, lm.new_cache(), 0, ids.shape[1])
    assert bf16.dtype == torch.bfloat16 and f32.dtype == torch.float32
    assert torch.equal(bf16.view(torch.int16), f32.to(torch.bfloat16).view(torch.int16))


def test_rotary_rows_are_the_tables_rows_in_float32(base_tokenizer, monkeypatch):
    eng = on_kernels(_tiny(base_tokenizer), RUNNABLE[0], monkeypatch).fast_engine()
    table = eng.rotary_table
    for start, end in [(0, 1), (5, 9), (250, 262), (600, 601)]:  # 262 and 601 grow the table
        cos, sin = table.rows_float32(start, end)
        ref_cos, ref_sin = table(torch.arange(start, end))
        assert cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, ref_cos.float()) and torch.equal(sin, ref_sin.float())


def test_a_grown_cache_is_read_at_its_new_address(base_tokenizer, monkeypatch, one_torch_thread):
    """A pass that outgrows the cache's 256 positions moves its tensors; the next passes read and write the new
    ones (float32: within 1e-4 of transformers' after 300 positions)."""
    from transformers import DynamicCache

    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.float32), RUNNABLE[0], monkeypatch)
    m = lm.mask_token_id
    ids = (lm.prompt_ids(" ".join(["The keeper climbs the stairs and lights the lamp."] * 30)) * 2)[:300]
    assert len(ids) == 300

    def passes(cache):
        with torch.no_grad():
            lm.forward(torch.tensor([ids[:200]]), cache, 0, 1)
            lm.forward(torch.tensor([ids[200:]]), cache, 0, 1)
            return lm.forward(torch.tensor([[101] + [m] * 3]), cache, 3, 4).float()

    cache = lm.new_cache()
    ours = passes(cache)
    assert cache.capacity > 256 and cache.length == 304
    lib = passes(DynamicCache(config=lm.model.config))
    assert float((ours - lib).abs().max()) <= 1e-4 * float(lib.abs().max())
