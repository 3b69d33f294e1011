"""Lossless verification with mask blocks after several draft prefixes (model/engine/decoding.py:
``lay_out``, ``accept``; ``verify:K_MAX:LAYOUT``), and the acceptance figures of pass records.

The same guarantees as the linear layout's: token-identical to standard decoding (float64, both forward
paths, k_max 2/4/8), the KV cache a fresh prefill of exactly the kept tokens after every pass, stop
tokens and max_new_tokens respected inside accepted drafts. And what the tree adds: a block after ``a``
drafts proposes exactly what a linear pass that fed only those ``a`` drafts would propose."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from model.engine.decoding import Decoder, DraftCheck, PassRecord, acceptance_by_position, generate, lay_out, run
from model.engine.loading import wrap_model
from model.engine.strategies import resolve_strategy, standard, verify
from tests.conftest import make_tiny
from tests.engine.test_decoding import PROMPTS, assert_cache_is_fresh_prefill

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_layouts_are_resolved_and_spelled_once():
    assert verify(4).blocks is None and verify(4, "3").blocks is None  # one block after all drafts: linear
    assert verify(4, "full").blocks == (0, 1, 2, 3) and verify(4, "full").spec == "verify:4:full"
    assert resolve_strategy("verify:4:1/0").blocks == (0, 1) and resolve_strategy("verify:4:0/1").spec == "verify:4:0/1"
    with pytest.raises(ValueError, match="after 0 to 3 drafts"):
        verify(4, "4")
    assert verify(4, "full").lookahead == 3 + 4 * 3  # drafts + four blocks of masks held in the cache at once


def test_tree_layout_positions_and_visibility():
    lay = lay_out([7], [11, 12, 13], verify(4, "0/2"), mask_token_id=99)
    assert lay.tokens == [7, 11, 12, 13] + [99] * 6 and lay.num_masks == 6 and lay.logits_to_keep == 10
    assert lay.positions == [0, 1, 2, 3, 1, 2, 3, 3, 4, 5]  # block 0 after the pending token, block 2 after d2
    see = lay.visible
    assert see[5].tolist() == [True, False, False, False, True, True, False, False, False, False]
    assert see[8].tolist() == [True, True, True, False, False, False, False, True, True, False]
    assert lay_out([7], [11, 12, 13], verify(4), 99).visible is None  # linear: plain causal


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "library-path"])
@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("k_max, layout", [(2, "full"), (4, "full"), (4, "0/1"), (8, "0/3/7")])
def test_tree_verify_equals_standard_float64(base_tokenizer, arch, k_max, layout, fast):
    tok = copy.deepcopy(base_tokenizer)
    lm = dataclasses.replace(wrap_model(make_tiny(tok, arch=arch, dtype=torch.float64), tok), fast=fast)
    for prompt in PROMPTS[:2]:
        ref = generate(lm, prompt, standard(), 30)
        dec = Decoder(lm, lm.prompt_ids(prompt), verify(k_max, layout), 30)
        for rec in dec:
            assert_cache_is_fresh_prefill(lm, dec, 1e-10)
            assert rec.verification.mask_blocks == list(verify(k_max, layout).mask_blocks(rec.fed_drafts))
        assert dec.generated == ref.token_ids and dec.result().text == ref.text


def test_a_block_proposes_what_a_linear_pass_over_its_prefix_would(tiny_lm64):
    """Block ``a`` sees the cache, the pending token, the first ``a`` drafts and its own masks only: its
    proposals equal those of a linear pass that fed just those drafts (same state, float64)."""
    lm = tiny_lm64
    ids = lm.prompt_ids(PROMPTS[0])
    ref = generate(lm, PROMPTS[0], standard(), 12).token_ids
    drafts = [ref[1], ref[2], (ref[3] + 1) % 1000]  # two right drafts, then a wrong one
    tree = Decoder(lm, ids, verify(4, "full"), 12)
    tree.run_pass()
    tree.drafts = list(drafts)
    rec = tree.run_pass()
    assert rec.verification.accepted == 2 and rec.verification.mask_blocks == [0, 1, 2, 3]
    assert tree.drafts == rec.verification.block_proposals[2]  # the block after the accepted prefix drafts next
    for a in range(3):
        lin = Decoder(lm, ids, verify(4), 12)
        lin.run_pass()
        lin.drafts = list(drafts[:a])
        lin_rec = lin.run_pass()
        assert lin_rec.fed_drafts == a and lin_rec.proposals[1:] == rec.verification.block_proposals[a]


def test_stop_token_and_max_new_tokens_inside_drafts_with_a_tree(tiny_lm64):
    cases = [(p, generate(tiny_lm64, p, standard(), 12).token_ids) for p in PROMPTS]
    prompt, ref, i = next((p, r, i) for p, r in cases for i in range(2, 5) if r[i] not in r[:i])
    lm = dataclasses.replace(tiny_lm64, stop_token_ids=(ref[i],))
    dec = Decoder(lm, lm.prompt_ids(prompt), verify(6, "full"), 12)
    dec.run_pass()
    dec.drafts = ref[1:6]
    rec = dec.run_pass()
    assert rec.stopped and dec.done and dec.generated == ref[: i + 1] and rec.verification.next_drafts == []
    assert rec.counted_drafts == (i, i)  # the drafts after the stop token count neither as proposed nor accepted
    lm = dataclasses.replace(tiny_lm64, stop_token_ids=())
    dec = Decoder(lm, lm.prompt_ids(PROMPTS[1]), verify(6, "0/2/5"), 3)
    dec.run_pass()
    dec.drafts = generate(lm, PROMPTS[1], standard(), 10).token_ids[1:6]
    rec = dec.run_pass()
    assert dec.done and len(dec.generated) == 3 and rec.block_end == "max_new_tokens"


def _rec(drafts, accepted, kept, stopped=False, block_end="k_max"):
    return PassRecord(index=1, fed_real=1, fed_masks=3, proposals=[], proposal_texts=[], confidences=[], kept=kept,
                      text="", accepted=len(kept), seconds=0.01, stopped=stopped, block_end=block_end,
                      fed_drafts=len(drafts), verification=DraftCheck(drafts=drafts, accepted=accepted))


def test_acceptance_figures():
    """Per draft position: accepted / proposed (a draft after a rejected one counts as rejected); drafts after
    the end of the answer count neither way."""
    passes = [_rec([], 0, [1]), _rec([1, 2, 3], 3, [1, 2, 3, 4]), _rec([1, 2, 3], 1, [1, 9]),
              _rec([1, 2, 3], 2, [1, 2], stopped=True, block_end="stop token")]
    assert [p.counted_drafts for p in passes] == [(0, 0), (3, 3), (3, 1), (2, 2)]
    assert acceptance_by_position(passes) == pytest.approx([1.0, 2 / 3, 1 / 2])


@pytest.mark.integration
def test_full_tree_on_the_default_model_float32(smollm2_adapter):
    """The shipped adapter: the full tree is lossless (float32, to the bit), its cache a fresh prefill, and it
    keeps more tokens per pass than the linear layout on the same prompts."""
    lm = smollm2_adapter
    ids = lm.prompt_ids(PROMPTS[0])
    ref = run(lm, ids, standard(), 48)
    dec = Decoder(lm, ids, verify(4, "full"), 48)
    for _ in dec:
        pass
    assert dec.generated == ref.token_ids
    with lm.base_model():
        assert_cache_is_fresh_prefill(lm, dec, 1e-3)
    linear = run(lm, ids, verify(4), 48)
    assert dec.result().mean_acceptance_length >= linear.mean_acceptance_length
