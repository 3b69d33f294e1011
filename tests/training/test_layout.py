"""The blocked training layout (paper 3.3): positions, the 4D mask, the region grid, the EOS rule."""

from __future__ import annotations

import random

import pytest
import torch

from model.training.layout import GT, MASK, PAD, Region, build_layout, default_num_regions, place_regions, sample_block


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(tok, n_rows=3, seed=0):
    """Real-text ground-truth rows of different lengths: prompt ids + response ids + EOS."""
    texts = [("What is 12 times 7?", "12 times 7 is 84, because 10 times 7 is 70 and 2 times 7 is 14."),
             ("Name a colour.", "Blue is a colour of the sky on a clear day."),
             ("Count to five.", "One, two, three, four, five. That is all of them, counted one by one.")]
    seqs, starts = [], []
    for q, a in texts[:n_rows]:
        p = tok(q, add_special_tokens=False)["input_ids"]
        r = tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + r)
        starts.append(len(p))
    return seqs, starts


def test_ground_truth_logits_equal_plain_causal_forward(tiny_lm64):
    lm = tiny_lm64
    seqs, starts = _rows(lm.tokenizer)
    regions = place_regions(seqs, starts, k=4, offset=1, spacing=5, num_regions=3, eos_token_id=lm.tokenizer.eos_token_id)
    assert len(regions) == 9  # three regions in each row
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=lm.tokenizer.pad_token_id)
    assert int((lay.kind == MASK).sum()) == 9 * 3
    with torch.no_grad():
        out = lm.model(input_ids=lay.input_ids, position_ids=lay.position_ids,
                       attention_mask=lay.attention_mask.to(torch.float64)).logits
        for b, seq in enumerate(seqs):
            ref = lm.model(input_ids=torch.tensor([seq])).logits[0]
            got = out[b, lay.gt_index[b, : len(seq)]]
            assert got.shape == ref.shape
            assert torch.allclose(got, ref, atol=1e-10, rtol=0), (got - ref).abs().max()


def test_eager_attention_reads_the_float_mask_too(tiny_lm64):
    lm = tiny_lm64
    seqs, starts = _rows(lm.tokenizer, 2)
    regions = place_regions(seqs, starts, k=3, offset=0, spacing=4, num_regions=2, eos_token_id=lm.tokenizer.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=lm.tokenizer.pad_token_id)
    lm.model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = lm.model(input_ids=lay.input_ids, position_ids=lay.position_ids,
                           attention_mask=lay.attention_mask.to(torch.float64)).logits
            ref = lm.model(input_ids=torch.tensor([seqs[1]])).logits[0]
    finally:
        lm.model.config._attn_implementation = "sdpa"
    got = out[1, lay.gt_index[1, : len(seqs[1])]]
    # eager attention takes its softmax in float32 even for float64 models: float32-level tolerance.
    assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()


def test_positions_and_mask_structure():
    # Ground truth 0..11 (token id = 100 + position); two regions with k = 3 at anchors 3 and 7.
    seq = [100 + t for t in range(12)]
    regions = [Region(0, 3, 3, None), Region(0, 7, 3, None)]
    lay = build_layout([seq], regions, mask_token_id=9, pad_token_id=0)
    ids = lay.input_ids[0].tolist()
    assert ids == [100, 101, 102, 103, 9, 9, 104, 105, 106, 107, 9, 9, 108, 109, 110, 111]
    assert lay.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 8, 9, 10, 11]
    allowed = (lay.attention_mask[0, 0] == 0)
    mask_slots = (lay.kind[0] == MASK).nonzero().flatten().tolist()
    assert mask_slots == [4, 5, 10, 11]
    # Each mask sees ground truth 0..anchor and its own span's earlier masks, nothing else.
    expect = {4: [0, 1, 2, 3, 4], 5: [0, 1, 2, 3, 4, 5], 10: [0, 1, 2, 3, 6, 7, 8, 9, 10], 11: [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]}
    for q, keys in expect.items():
        assert allowed[q].nonzero().flatten().tolist() == keys
    # A mask never attends to another span; ground truth never attends to any mask.
    assert not allowed[10, 4] and not allowed[11, 5]
    gt_slots = (lay.kind[0] == GT).nonzero().flatten()
    assert not allowed[gt_slots][:, mask_slots].any()
    assert allowed[gt_slots][:, gt_slots].equal(torch.tril(torch.ones(12, 12, dtype=torch.bool)))
    # Predictions: region by region, block index ascending; anchor slot then its masks.
    assert lay.pred_index.tolist() == [3, 4, 5, 9, 10, 11]
    assert lay.pred_block.tolist() == [0, 1, 2, 0, 1, 2]
    assert lay.pred_region.tolist() == [0, 0, 0, 1, 1, 1]
    assert lay.pred_target.tolist() == [4, 5, 6, 8, 9, 10]
    assert lay.attention_mask.dtype == torch.float32 and lay.attention_mask.min() == float("-inf")


def test_a_mask_is_blind_to_other_spans(tiny_lm64):
    """Changing the tokens in one span leaves every other span's logits unchanged."""
    lm = tiny_lm64
    seqs, starts = _rows(lm.tokenizer, 1)
    regions = place_regions(seqs, starts, k=4, offset=0, spacing=5, num_regions=3, eos_token_id=lm.tokenizer.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=0)
    span0 = lay.pred_index[(lay.pred_region == 0) & (lay.pred_block > 0)]
    others = lay.pred_index[lay.pred_region != 0]
    ids2 = lay.input_ids.clone()
    ids2[0, span0] = torch.tensor([11, 22, 33])
    with torch.no_grad():
        a = lm.model(input_ids=lay.input_ids, position_ids=lay.position_ids, attention_mask=lay.attention_mask.double()).logits
        b = lm.model(input_ids=ids2, position_ids=lay.position_ids, attention_mask=lay.attention_mask.double()).logits
    assert torch.equal(a[0, others], b[0, others])
    assert not torch.allclose(a[0, span0[1:]], b[0, span0[1:]])  # its own later masks do see it


def test_grid_sits_in_the_response_and_obeys_eos():
    eos = 2
    prompt = [5] * 10
    seq = prompt + [7] * 20 + [eos] + [eos] * 5          # response 10..29, EOS at 30
    regs = place_regions([seq], [10], k=6, offset=3, spacing=8, num_regions=10, eos_token_id=eos)
    assert [r.anchor for r in regs] == [12, 20, 28]       # 9 + 3 + 8m, all before the EOS at 30
    assert all(r.eos == 30 for r in regs)
    lay = build_layout([seq], regs, mask_token_id=9, pad_token_id=0)
    last = lay.pred_region == 2
    # anchor 28 predicts positions 29..34: 29 and 30 (the EOS) are real, 31.. lie after the EOS.
    assert lay.pred_target[last].tolist() == [29, 30, 31, 32, 33, 34]
    assert lay.pred_after_eos[last].tolist() == [False, False, True, True, True, True]
    assert not lay.pred_after_eos[~last].any()
    # The offset 0 anchor is the last prompt token (it predicts the first response token).
    assert place_regions([seq], [10], k=2, offset=0, spacing=8, num_regions=1, eos_token_id=eos)[0].anchor == 9
    # A truncated row (no EOS) keeps anchors before its last token.
    regs = place_regions([prompt + [7] * 6], [10], k=4, offset=0, spacing=2, num_regions=9, eos_token_id=eos)
    assert [r.anchor for r in regs] == [9, 11, 13]
    with pytest.raises(ValueError, match="response starts"):
        place_regions([prompt], [10], k=2, offset=0, spacing=4, num_regions=1, eos_token_id=eos)


def test_padding_rows_and_sampling():
    lay = build_layout([[1, 2, 3, 4, 5, 6], [1, 2, 3]], [Region(0, 2, 3, None), Region(1, 1, 2, None)],
                       mask_token_id=9, pad_token_id=0)
    assert lay.input_ids.tolist() == [[1, 2, 3, 9, 9, 4, 5, 6], [1, 2, 9, 3, 0, 0, 0, 0]]
    assert lay.kind[1].tolist() == [GT, GT, MASK, GT, PAD, PAD, PAD, PAD]
    assert lay.gt_index.tolist() == [[0, 1, 2, 5, 6, 7], [0, 1, 3, -1, -1, -1]]
    allowed = lay.attention_mask[1, 0] == 0
    assert allowed[4:, :].equal(torch.eye(8, dtype=torch.bool)[4:])  # padding sees only itself
    assert default_num_regions(160, 16) == 5 and default_num_regions(10, 16) == 1
    rng = random.Random(0)
    draws = [sample_block(rng, 16, 32) for _ in range(2000)]
    assert {k for k, _ in draws} == set(range(2, 17))
    assert {o for _, o in draws} == set(range(32))
    with pytest.raises(ValueError):
        sample_block(rng, 1, 32)
