"""The student-forced self-distillation objective (model/training/objective.py, paper 3.3) on tiny
random models; the activated-LoRA objective (two phases: the cached ground truth, then the mask spans
with the adapter on)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from model.engine.loading import wrap_model
from model.training.layout import Region, build_layout, build_span_layout, place_regions
from model.training.objective import (
    alora_objective,
    mtp_objective,
    phase1_prefix,
    phase2_logits,
    student_logits,
    teacher_input_ids,
)
from tests.conftest import make_tiny


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(tok):
    rows = [("What is 3 plus 4?", "3 plus 4 is 7. The answer is 7."),
            ("Say hello.", "Hello! It is nice to meet you today, friend.")]
    seqs, starts = [], []
    for q, a in rows:
        p = tok(q, add_special_tokens=False)["input_ids"]
        seqs.append(p + tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        starts.append(len(p))
    return seqs, starts


def test_teacher_sees_the_students_block(tiny_lm64):
    """Mask slot j of the teacher holds the student's argmax at block position j-1, and the teacher's
    logits there equal its plain causal forward of x_1..x_a, y'_1..y'_j."""
    student = tiny_lm64
    tok = student.tokenizer
    teacher = make_tiny(tok, dtype=torch.float64, seed=1)  # a different model, so labels differ from y'
    seqs, starts = _batch(tok)
    regions = place_regions(seqs, starts, k=5, offset=2, spacing=6, num_regions=2, eos_token_id=tok.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=student.mask_token_id, pad_token_id=tok.pad_token_id)
    out = mtp_objective(student.model, lay, mask_token_id=student.mask_token_id, eos_token_id=tok.eos_token_id,
                        teacher=teacher)
    y = out.student_tokens
    t_ids = teacher_input_ids(lay, y)
    for p in range(lay.num_predictions):
        b, slot, j = int(lay.pred_batch[p]), int(lay.pred_index[p]), int(lay.pred_block[p])
        if j > 0:
            assert int(t_ids[b, slot]) == int(y[p - 1])
            assert int(lay.input_ids[b, slot]) == student.mask_token_id
        else:
            assert int(t_ids[b, slot]) == int(lay.input_ids[b, slot])  # ground truth untouched
    with torch.no_grad():
        for rid, reg in enumerate(regions):
            ps = (lay.pred_region == rid).nonzero().flatten().tolist()
            prefix = seqs[reg.batch][: reg.anchor + 1] + [int(y[p]) for p in ps[:-1]]
            ref = teacher(input_ids=torch.tensor([prefix])).logits[0, reg.anchor:]
            ref[:, student.mask_token_id] = float("-inf")
            labels = ref.argmax(-1)
            after = lay.pred_after_eos[ps]
            labels = torch.where(after, torch.full_like(labels, tok.eos_token_id), labels)
            assert out.labels[ps].tolist() == labels.tolist()
    assert out.loss.requires_grad and out.loss.item() > 0
    m = out.metrics()
    assert 0 <= m["agreement"] <= 1 and m["k"] == 5 and m["predictions"] == lay.num_predictions


def test_student_equals_teacher_with_k1_labels_are_own_argmax(tiny_lm64):
    lm = tiny_lm64
    tok = lm.tokenizer
    seqs, starts = _batch(tok)
    regions = place_regions(seqs, starts, k=1, offset=0, spacing=3, num_regions=4, eos_token_id=tok.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    assert int((lay.input_ids == lm.mask_token_id).sum()) == 0
    out = mtp_objective(lm.model, lay, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id)
    assert torch.equal(out.labels, out.student_tokens)
    assert out.metrics()["agreement"] == 1.0
    s = student_logits(lm.model, lay).detach()
    assert torch.allclose(out.loss.detach(), F.cross_entropy(s, s.argmax(-1)), atol=1e-12)
    # Soft teacher == the student itself: the loss is the student's entropy.
    soft = mtp_objective(lm.model, lay, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id,
                         soft_teacher=True)
    p = torch.softmax(s, -1)
    entropy = -(p * torch.log_softmax(s, -1)).sum(-1).mean()
    assert torch.allclose(soft.loss.detach(), entropy, atol=1e-9)


def test_labels_after_eos_are_eos_and_mask_token_is_never_proposed(tiny_lm64):
    lm = tiny_lm64
    tok = lm.tokenizer
    seq = tok("Hi", add_special_tokens=False)["input_ids"] + tok(" Hello there.", add_special_tokens=False)["input_ids"]
    seq = seq + [tok.eos_token_id]
    eos_at = len(seq) - 1
    lay = build_layout([seq], [Region(0, eos_at - 1, 6, eos_at)], mask_token_id=lm.mask_token_id,
                       pad_token_id=tok.pad_token_id)
    # Make the mask token the most likely output everywhere: it must still never be proposed.
    with torch.no_grad():
        lm.model.lm_head.weight[lm.mask_token_id] = lm.model.model.embed_tokens.weight.abs().max() * 50
    out = mtp_objective(lm.model, lay, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id)
    assert lay.pred_after_eos.tolist() == [False, True, True, True, True, True]
    assert out.labels[1:].tolist() == [tok.eos_token_id] * 5
    assert lm.mask_token_id not in out.student_tokens.tolist()
    assert lm.mask_token_id not in out.labels.tolist()


def test_gradient_reaches_only_trainable_weights_with_lora_teacher(base_tokenizer):
    """With LoRA the teacher is the same module with adapters off; only adapter + mask row learn."""
    from peft import LoraConfig, get_peft_model

    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok), tok)
    base_copy = copy.deepcopy(lm.model)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                     trainable_token_indices={"embed_tokens": [lm.mask_token_id]})
    peft_model = get_peft_model(lm.model, cfg)
    seqs, starts = _batch(tok)
    regions = place_regions(seqs, starts, k=4, offset=1, spacing=6, num_regions=2, eos_token_id=tok.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    out = mtp_objective(peft_model, lay, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id,
                        teacher_context=peft_model.disable_adapter)
    # The teacher's labels equal those of an untouched copy of the base model.
    ref = mtp_objective(peft_model, lay, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id,
                        teacher=base_copy)
    assert torch.equal(out.labels, ref.labels)
    out.loss.backward()
    grads = {n for n, p in peft_model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all("lora_" in n or "trainable_tokens" in n for n in grads)
    assert any("trainable_tokens" in n for n in grads)


# -------------------------------------------------- activated LoRA (two phases)
def _alora(model, mask_id, r=4):
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False,
                     alora_invocation_tokens=[mask_id], trainable_token_indices=[mask_id])
    return get_peft_model(model, cfg)


def _rows(tok):
    seqs, starts = [], []
    for q, a in [("What is 6 times 7?", "6 times 7 is 42, since 6 times 6 is 36 and 36 plus 6 is 42."),
                 ("Name a fruit.", "An apple is a fruit that grows on trees.")]:
        p = tok(q, add_special_tokens=False)["input_ids"]
        seqs.append(p + tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        starts.append(len(p))
    return seqs, starts


def test_phase2_equals_single_pass_layout(tiny_lm64):
    """Adapter disabled: phase 1 (cached ground truth) + phase 2 (all mask spans over the cache, own
    positions, 4D mask) give the single-pass blocked layout's logits at every predicted position
    (float64, tolerance 1e-10). Adapter enabled: real positions stay the base's."""
    lm = tiny_lm64
    tok = lm.tokenizer
    seqs, starts = _rows(tok)
    regions = place_regions(seqs, starts, k=5, offset=1, spacing=7, num_regions=3, eos_token_id=tok.eos_token_id)
    assert len(regions) == 5
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    span = build_span_layout(lay, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    model = _alora(lm.model, lm.mask_token_id)
    masks = lay.pred_block > 0
    with torch.no_grad(), model.disable_adapter():
        single = student_logits(model, lay)
        cache, anchor = phase1_prefix(model, span)
        n_cached = cache.get_seq_length()
        two = phase2_logits(model, span, cache)
        assert cache.get_seq_length() == n_cached  # the spans were cropped off again
    assert torch.allclose(two[masks], single[masks], atol=1e-10, rtol=0), (two[masks] - single[masks]).abs().max()
    assert torch.allclose(anchor[~masks], single[~masks], atol=1e-10, rtol=0)
    # With the adapter on the spans, the mask logits move; the cached prefix is untouched base.
    with torch.no_grad():
        on = phase2_logits(model, span, cache, alora_offsets=[span.span_len] * 2)
    assert not torch.allclose(on[masks], single[masks], atol=1e-3)
    # The engine's single pass (prefix + trailing masks, alora_offsets=[masks]) == phase 1 + phase 2.
    reg = regions[0]
    prefix = seqs[reg.batch][: reg.anchor + 1]
    ids = torch.tensor([prefix + [lm.mask_token_id] * (reg.k - 1)])
    with torch.no_grad():
        one = model(input_ids=ids, alora_offsets=[reg.k - 1]).logits[0, -(reg.k - 1):]
        with model.disable_adapter():
            base = model(input_ids=ids).logits[0, : len(prefix)]
        real = model(input_ids=ids, alora_offsets=[reg.k - 1]).logits[0, : len(prefix)]
    sel = (lay.pred_region == 0) & masks
    assert torch.allclose(one, on[sel], atol=1e-10, rtol=0)
    assert torch.equal(real, base)


def test_alora_objective_trains_only_masks(tiny_lm64):
    lm = tiny_lm64
    tok = lm.tokenizer
    seqs, starts = _rows(tok)
    regions = place_regions(seqs, starts, k=4, offset=0, spacing=6, num_regions=3, eos_token_id=tok.eos_token_id)
    lay = build_layout(seqs, regions, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    span = build_span_layout(lay, mask_token_id=lm.mask_token_id, pad_token_id=tok.pad_token_id)
    model = _alora(lm.model, lm.mask_token_id)
    out = alora_objective(model, span, mask_token_id=lm.mask_token_id, eos_token_id=tok.eos_token_id,
                          base_context=model.disable_adapter)
    m = out.block > 0
    # Block position 0 is the base's own greedy token: student == teacher there.
    assert torch.equal(out.student_tokens[~m], out.labels[~m])
    # The loss covers the mask positions only: it is the cross-entropy of the student's mask logits (phase 2,
    # adapter on, recomputed here) against the labels there, not of all predicted positions.
    with torch.no_grad():
        with model.disable_adapter():
            cache, _ = phase1_prefix(model, span)
        s_mask = phase2_logits(model, span, cache, alora_offsets=[span.span_len] * span.gt_ids.shape[0])
        masks_only = torch.nn.functional.cross_entropy(s_mask[m], out.labels[m])
    assert float(out.loss.detach()) == pytest.approx(float(masks_only), rel=1e-9)
    # The teacher's labels at masks: the base's argmax after the student's block, checked by a plain forward.
    rid = 1
    ps = (lay.pred_region == rid).nonzero().flatten().tolist()
    reg = regions[rid]
    prefix = seqs[reg.batch][: reg.anchor + 1] + [int(out.student_tokens[p]) for p in ps[:-1]]
    with torch.no_grad(), model.disable_adapter():
        ref = model(input_ids=torch.tensor([prefix])).logits[0, reg.anchor:]
    ref[:, lm.mask_token_id] = float("-inf")
    assert out.labels[ps].tolist() == ref.argmax(-1).tolist()
    out.loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all("lora_" in n or "trainable_tokens" in n for n in grads)
