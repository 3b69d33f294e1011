"""The torch fast forward path (model/engine/fast_forward.py, its weights packed by fast_weights.py, its
KV cache kv_cache.py; ``MTP_KERNELS=off``) against the library path (transformers + peft).

``lm.forward`` picks the implementation from the cache it is given: ``lm.new_cache()`` (a
``KVCache``) runs the fast path, a transformers ``DynamicCache`` the library path, so the same pass
sequence runs through both. Tolerances:

* base weights (no adapter, or aLoRA real rows): bit for bit in float64 / float32 (the same ops in
  the same order); in bfloat16 bit for bit on this project's CPU (AVX512-BF16), checked here with
  atol 0 as well (prepacked oneDNN weights run the kernel F.linear runs);
* adapter rows (aLoRA mask rows, every LoRA row): float64 1e-10 (the fast path stacks the LoRA
  factors: another summation order); SmolLM2 float32 1e-4 absolute on logits up to ~30 (measured
  3.6e-5); SmolLM2 bfloat16: 0.05 x the largest |logit| (measured 0.5 on 30, i.e. 0.017: bf16
  rounding differences compound over 30 layers) and the same greedy token wherever the top two
  logits differ by more than two bf16 steps at that magnitude (measured: 143 of 144 equal, the one
  difference an exact tie).
* the mask token's own logit: peft swaps in the trainable-token row for every row of an adapter
  pass; so does the fast path, computed separately (float32 rounding differs there; the decoder
  never proposes the mask token).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import DynamicCache

from model.engine.decoding import Decoder, generate, hf_generate
from model.engine.fast_forward import build_engine
from model.engine.kv_cache import KVCache
from model.engine.loading import load_checkpoint, wrap_model
from model.engine.strategies import confadapt, standard, static_k, verify
from model.errors import Unsupported
from tests.conftest import make_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_fast_path")


@pytest.fixture
def torch_fast_path(monkeypatch):
    """This module tests the torch fast path (``MTP_KERNELS=off``): same bits as transformers. Our kernels'
    own guarantees (rows exact at every width, close to transformers) are tests/engine/test_kernels.py's."""
    monkeypatch.setenv("MTP_KERNELS", "off")


PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def _tiny(base_tokenizer, arch="llama", dtype=torch.float64, adapter=None, r=4, override=False):
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, arch=arch, dtype=dtype), tok, source=f"tiny-{arch}")
    if adapter:
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False,
                         alora_invocation_tokens=[lm.mask_token_id] if adapter == "alora" else None,
                         trainable_token_indices=[lm.mask_token_id])
        torch.manual_seed(1)
        peft_model = get_peft_model(lm.model, cfg).eval()
        if override:  # a trained mask row that differs from the base row (peft swaps it in)
            with torch.no_grad():
                for n, p in peft_model.named_parameters():
                    if "trainable_tokens_delta" in n:
                        p.add_(0.5)
        lm.model, lm.adapter = peft_model, adapter
    return lm


def _schedule(lm, n_masks=3):
    """A decoder-like pass sequence: (ids, num_masks, logits_to_keep, entries to crop after)."""
    ids = lm.prompt_ids(PROMPT)
    m = lm.mask_token_id
    return [
        (ids + [m] * n_masks, n_masks, 1 + n_masks, n_masks),  # prefill + masks
        ([101], 0, 1, 0),  # a standard pass
        ([102, 103] + [m] * n_masks, n_masks, 2 + n_masks, n_masks),  # two pending + masks
        ([104, 105, 106] + [m] * n_masks, n_masks, 3 + n_masks, n_masks + 1),  # verify-like: 2 drafts, one rejected
        ([107], 0, 1, 0),
        ([108] + [m] * (2 * n_masks), 2 * n_masks, 1 + 2 * n_masks, 2 * n_masks),  # a wider pass
    ]


def _both(lm, schedule):
    """Logits of every pass on the library path and on the fast path, and the two caches."""
    lib, fast = DynamicCache(config=lm.model.config), lm.new_cache()
    assert isinstance(fast, KVCache), lm.forward_path
    out = []
    with torch.inference_mode():
        for ids, m, keep, crop in schedule:
            x = torch.tensor([ids])
            a = lm.forward(x, lib, num_masks=m, logits_to_keep=keep)
            b = lm.forward(x, fast, num_masks=m, logits_to_keep=keep)
            out.append((a[0], b[0], m))
            if crop:
                lib.crop(-crop)
                fast.crop(-crop)
            assert fast.get_seq_length() == lib.get_seq_length()
    return out, lib, fast


@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_base_model_bit_for_bit(base_tokenizer, arch, dtype):
    """No adapter: every logit and every cached key/value equal the library path's exactly."""
    lm = _tiny(base_tokenizer, arch, dtype)
    passes, lib, fast = _both(lm, _schedule(lm))
    for a, b, _ in passes:
        assert torch.equal(a, b), (a - b).abs().max()
    for mine, ref in zip(fast.layers, lib.layers):
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


@pytest.mark.parametrize("kind", ["alora", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("override", [False, True])
def test_adapter_matches_peft_float64(base_tokenizer, kind, arch, override):
    """aLoRA: real rows bit for bit the base (peft's logits: equal); mask rows = peft within 1e-10.
    LoRA: every row = peft within 1e-10. With a trained mask row that differs from the base row, the
    mask token's logit column follows peft too (1e-10)."""
    lm = _tiny(base_tokenizer, arch, torch.float64, adapter=kind, override=override)
    engine = lm.fast_engine()
    assert engine is not None and engine.adapter_kind == kind
    assert (engine.weights.adapter_embed is not None) == override
    passes, _, _ = _both(lm, _schedule(lm))
    cols = torch.ones(lm.vocab_size, dtype=torch.bool)
    cols[lm.mask_token_id] = False
    for a, b, m in passes:
        real = a.shape[0] - m if kind == "alora" else 0
        assert torch.equal(a[:real][:, cols], b[:real][:, cols])
        torch.testing.assert_close(a[:real], b[:real], atol=1e-10, rtol=0)
        torch.testing.assert_close(a[real:], b[real:], atol=1e-10, rtol=0)
    # the adapter does act on the adapter rows
    base = lm.without_adapter()
    with torch.inference_mode():
        x = torch.tensor([lm.prompt_ids(PROMPT) + [lm.mask_token_id] * 3])
        on = lm.forward(x, lm.new_cache(), num_masks=3, logits_to_keep=4)
        off = base.forward(x, base.new_cache(), num_masks=3, logits_to_keep=4)
    assert not torch.allclose(on[0, 1:], off[0, 1:], atol=1e-3)
    if kind == "alora":
        assert torch.equal(on[0, 0, cols], off[0, 0, cols])


def test_alora_real_rows_equal_plain_base_exactly(base_tokenizer):
    """With an aLoRA adapter the real rows of a mask pass are the plain base model's logits, bit for
    bit (the mask column aside), in bf16 as in float64."""
    for dtype in (torch.float64, torch.bfloat16):
        plain = _tiny(base_tokenizer, "llama", dtype)
        lm = _tiny(base_tokenizer, "llama", dtype, adapter="alora", override=True)
        ids = torch.tensor([lm.prompt_ids(PROMPT) + [lm.mask_token_id] * 3])
        with torch.inference_mode():
            a = plain.forward(ids, plain.new_cache(), num_masks=3, logits_to_keep=ids.shape[1])[0]
            b = lm.forward(ids, lm.new_cache(), num_masks=3, logits_to_keep=ids.shape[1])[0]
        n = ids.shape[1] - 3
        assert torch.equal(a[:n, : lm.mask_token_id], b[:n, : lm.mask_token_id])


@pytest.mark.parametrize("kind", ["alora", "lora"])
def test_decoding_same_tokens_on_both_paths(base_tokenizer, kind):
    """Every strategy decodes the same tokens on both paths (float64, adapter loaded)."""
    lm = _tiny(base_tokenizer, "qwen", torch.float64, adapter=kind)
    lib = dataclasses.replace(lm, fast=False)
    for s in (standard(), confadapt(0.3, 4), static_k(3), verify(4)):
        a, b = generate(lm, PROMPT, s, 24), generate(lib, PROMPT, s, 24)
        assert a.token_ids == b.token_ids and [p.kept for p in a.passes] == [p.kept for p in b.passes]
        torch.testing.assert_close(torch.tensor([c for p in a.passes for c in p.confidences]),
                                   torch.tensor([c for p in b.passes for c in p.confidences]), atol=1e-6, rtol=0)
    assert isinstance(Decoder(lm, lm.prompt_ids(PROMPT), standard(), 4).cache, KVCache)
    assert isinstance(Decoder(lib, lib.prompt_ids(PROMPT), standard(), 4).cache, DynamicCache)


def test_standard_with_alora_equals_hf_generate_on_base(base_tokenizer):
    """An aLoRA model's standard decoding is the base model: HF generate on the plain base, in the
    default-like bf16 as in float32 (same bits on the fast path)."""
    for dtype in (torch.float32, torch.bfloat16):
        plain = _tiny(base_tokenizer, "llama", dtype)
        lm = _tiny(base_tokenizer, "llama", dtype, adapter="alora")
        ids = lm.prompt_ids(PROMPT)
        assert generate(lm, PROMPT, standard(), 32).token_ids == hf_generate(plain, ids, 32)


def test_base_model_context_switches_the_adapter_off(base_tokenizer):
    """Inside lm.base_model() a mask pass runs on the base weights on both paths (the teacher), and
    lm.without_adapter() decodes with the base."""
    lm = _tiny(base_tokenizer, "llama", torch.float64, adapter="lora")
    plain_ids = torch.tensor([lm.prompt_ids(PROMPT) + [lm.mask_token_id] * 3])
    with torch.inference_mode():
        on = lm.forward(plain_ids, lm.new_cache(), num_masks=3, logits_to_keep=4)
        with lm.base_model():
            fast_off = lm.forward(plain_ids, lm.new_cache(), num_masks=3, logits_to_keep=4)
            lib_off = lm.forward(plain_ids, DynamicCache(config=lm.model.config), num_masks=3, logits_to_keep=4)
        again = lm.forward(plain_ids, lm.new_cache(), num_masks=3, logits_to_keep=4)
    assert torch.equal(on, again) and not torch.allclose(on, fast_off)
    cols = torch.arange(lm.vocab_size) != lm.mask_token_id
    assert torch.equal(fast_off[..., cols], lib_off[..., cols])
    base = lm.without_adapter()
    assert base.adapter is None and base.fast_engine() is lm.fast_engine()  # shared structures
    assert generate(base, PROMPT, static_k(2), 10).token_ids == generate(
        dataclasses.replace(base, fast=False), PROMPT, static_k(2), 10).token_ids


def test_changed_weights_rebuild_and_training_mode_uses_the_library(base_tokenizer):
    lm = _tiny(base_tokenizer, "llama", torch.float64, adapter="alora")
    engine = lm.fast_engine()
    assert lm.fast_engine() is engine  # cached
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.mul_(2.0)  # an optimizer step, say
    assert lm.fast_engine() is not engine
    passes, _, _ = _both(lm, _schedule(lm)[:3])
    for a, b, m in passes:
        torch.testing.assert_close(a[-m:] if m else a, b[-m:] if m else b, atol=1e-10, rtol=0)
    lm.model.train()
    assert lm.fast_engine() is None and "training mode" in lm.forward_path
    assert isinstance(lm.new_cache(), DynamicCache)
    lm.model.eval()
    assert lm.fast_engine() is not None


def test_every_kind_of_weight_change_rebuilds_the_engine(base_tokenizer):
    """The engine is cached across new KV caches and built again after any change to the weights: a tensor changed
    in place, a parameter's data swapped, a parameter or a module replaced, its parameter dict written directly
    (as ``Module._apply`` may), a module added (peft's new adapter members)."""
    lm = _tiny(base_tokenizer, "llama", torch.float64, adapter="lora")
    layer = lm.model.base_model.model.model.layers[0]
    proj = layer.mlp.down_proj.base_layer
    changes = [
        lambda: proj.weight.mul_(1.5),  # as an optimizer steps (a change through .data bumps no version: not seen)
        lambda: setattr(proj.weight, "data", proj.weight.data.clone()),
        lambda: setattr(proj, "weight", torch.nn.Parameter(proj.weight.data.clone(), requires_grad=False)),
        lambda: proj._parameters.__setitem__("weight", torch.nn.Parameter(proj.weight.data.clone())),
        lambda: setattr(layer.mlp, "act_fn", torch.nn.SiLU()),
        lambda: layer.mlp.down_proj.lora_A.__setitem__("extra", torch.nn.Linear(4, 4, dtype=torch.float64)),
    ]
    for i, change in enumerate(changes):
        engine = lm.fast_engine()
        assert engine is not None and lm.fast_engine() is engine and lm.new_cache().engine is engine  # cached
        with torch.no_grad():
            change()
        assert lm.fast_engine() is not engine, i


def test_fallback_for_unsupported_models(base_tokenizer):
    """An architecture the fast path does not know runs on the library path, saying why."""
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = copy.deepcopy(base_tokenizer)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=512)
    lm = wrap_model(AutoModelForCausalLM.from_config(cfg).eval(), tok, source="tiny-gpt2")
    with pytest.raises(Unsupported, match="gpt2"):
        build_engine(lm.model)
    assert lm.fast_engine() is None and "library path" in lm.forward_path and "gpt2" in lm.forward_path
    assert isinstance(lm.new_cache(), DynamicCache)
    res = generate(lm, PROMPT, confadapt(0.5, 4), 8)
    assert res.new_tokens == 8
    off = dataclasses.replace(_tiny(base_tokenizer), fast=False)
    assert off.fast_engine() is None and "switched off" in off.forward_path


def test_a_cache_of_another_model_is_refused(base_tokenizer):
    a, b = _tiny(base_tokenizer, "llama"), _tiny(base_tokenizer, "llama")
    x = torch.tensor([a.prompt_ids(PROMPT)])
    with pytest.raises(RuntimeError, match="another model"):
        b.forward(x, a.new_cache(), num_masks=0, logits_to_keep=1)


def test_lora_outside_the_projections_falls_back(base_tokenizer):
    """A LoRA on the output embedding (or peft modules_to_save) is not applied by the fast path: it says
    so and the library path runs, so the adapter is never silently dropped."""
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, dtype=torch.float64), tok, source="tiny")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    lm.model, lm.adapter = get_peft_model(lm.model, cfg).eval(), "lora"
    assert lm.fast_engine() is None and "outside the attention and MLP" in lm.forward_path
    tok2 = copy.deepcopy(base_tokenizer)
    lm2 = wrap_model(make_tiny(tok2, dtype=torch.float64), tok2, source="tiny")
    cfg2 = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    lm2.model, lm2.adapter = get_peft_model(lm2.model, cfg2).eval(), "lora"
    assert lm2.fast_engine() is None and "modules_to_save" in lm2.forward_path
    assert isinstance(lm2.new_cache(), DynamicCache)


def test_partial_lora_targets_match_peft(base_tokenizer):
    """LoRA on some projections only (q, v, down): block-diagonal B with gaps; equal to peft (1e-10)."""
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, arch="qwen", dtype=torch.float64), tok, source="tiny")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                     alora_invocation_tokens=[lm.mask_token_id])
    lm.model, lm.adapter = get_peft_model(lm.model, cfg).eval(), "alora"
    assert lm.fast_engine() is not None
    passes, _, _ = _both(lm, _schedule(lm))
    for a, b, m in passes:
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


# ----------------------------------------------------------------- the KV cache
def test_cache_grows_and_crops(base_tokenizer):
    """A cache that starts with 4 positions grows (doubling) through a long generation and still holds
    exactly a fresh prefill's keys/values; crop follows DynamicCache.crop (negative: drop, else keep)."""
    lm = _tiny(base_tokenizer, "llama", torch.float64)
    engine = lm.fast_engine()
    dec = Decoder(lm, lm.prompt_ids(PROMPT), confadapt(0.5, 4), 40)
    dec.cache = engine.new_cache(capacity=4)
    list(dec)
    assert dec.cache.capacity >= dec.cache.get_seq_length() == len(dec.cached_ids)
    with torch.inference_mode():
        fresh = lm.model(torch.tensor([dec.cached_ids]), use_cache=True, logits_to_keep=1).past_key_values
    for layer, ref in zip(dec.cache.layers, fresh.layers):
        assert layer.keys.shape == ref.keys.shape
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-10, rtol=0)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-10, rtol=0)
    assert dec.generated == generate(dataclasses.replace(lm, fast=False), PROMPT, confadapt(0.5, 4), 40).token_ids
    c = dec.cache
    n = c.get_seq_length()
    c.crop(-3)
    assert c.get_seq_length() == n - 3
    c.crop(n + 10)  # longer than cached: nothing happens
    assert c.get_seq_length() == n - 3
    c.crop(5)
    assert c.get_seq_length() == 5 and c.layers[0].keys.shape[2] == 5


def test_cache_growth_stops_at_the_model_positions():
    c = KVCache(2, 1, 4, torch.float32, torch.device("cpu"), capacity=4, max_capacity=10)
    c.k[0][:, :, :3] = 1.0
    c.length = 3
    c.reserve(5)
    assert c.capacity == 8 and torch.equal(c.k[0][:, :, :3], torch.ones(1, 1, 3, 4))
    c.reserve(9)
    assert c.capacity == 10  # not 16: the model has 10 positions
    assert len(c.layers) == 2 and c.layers[1].values.shape == (1, 1, 3, 4)


# -------------------------------------------------------- SmolLM2 (integration)
@pytest.fixture(scope="module")
def shipped():
    """The embedded default with its shipped aLoRA adapter, in float32 and in bfloat16."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MTP_KERNELS", "off")  # the torch fast path (module docstring)
            return {dt: load_checkpoint("smollm2-135m", dtype=dt) for dt in ("float32", "bfloat16")}
    except Exception as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_adapter_matches_peft(shipped, dtype):
    lm = shipped[dtype]
    assert lm.adapter == "alora" and lm.dtype_name == dtype and lm.fast_engine() is not None
    passes, lib, fast = _both(lm, _schedule(lm))
    cols = torch.arange(lm.vocab_size) != lm.mask_token_id
    agree = total = 0
    for a, b, m in passes:
        real = a.shape[0] - m
        assert torch.equal(a[:real][:, cols], b[:real][:, cols])  # base rows: bit for bit
        if not m:
            continue
        am, bm = a[real:].float().clone(), b[real:].float().clone()
        if dtype == "float32":
            torch.testing.assert_close(am, bm, atol=1e-4, rtol=0)
        else:
            assert (am - bm).abs().max() <= 0.05 * am.abs().max()
        am[:, ~cols], bm[:, ~cols] = float("-inf"), float("-inf")
        top2 = am.topk(2, dim=-1).values
        step = 2.0 ** (torch.floor(torch.log2(top2[:, 0].abs())) - 7)  # one bf16 step at that magnitude
        clear = (top2[:, 0] - top2[:, 1]) > 2 * step
        assert torch.equal(am.argmax(-1)[clear], bm.argmax(-1)[clear])
        agree += int((am.argmax(-1) == bm.argmax(-1)).sum())
        total += am.shape[0]
    assert agree >= total - 1
    for mine, ref in zip(fast.layers, lib.layers):  # the cache holds real tokens only: base keys, bit for bit
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


@pytest.mark.integration
def test_smollm2_bf16_standard_with_adapter_equals_hf_generate(shipped):
    """Default dtype on this CPU (bf16 when native): standard decoding with the shipped adapter loaded
    equals HF generate on the plain base model, token for token."""
    lm = shipped["bfloat16"]
    plain = dataclasses.replace(lm, model=copy.deepcopy(lm.model).unload(), adapter=None)
    prompt = "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step."
    assert generate(lm, prompt, standard(), 64).token_ids == hf_generate(plain, lm.prompt_ids(prompt), 64)
    assert lm.fast_engine() is not None and lm.fast_engine().source is lm.model  # plain did not take it over
