"""Activated MTP adapters: mask-only LoRA, two-phase training, exact standard decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from model.engine.loading import load_checkpoint, wrap_model
from model.engine.decoding import Decoder, generate, hf_generate
from model.engine.strategies import confadapt, standard
from model.training.layout import build_layout, build_span_layout, place_regions
from model.training.objective import alora_objective, phase1_prefix, phase2_logits, student_logits
from model.train import main
from model.training.config import TrainConfig
from model.training.trainer import export_model, load_for_training
from tests.conftest import make_tiny


pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


@pytest.mark.integration
def test_smollm2_alora_standard_is_base_and_blocks_start_with_base_greedy(smollm2, tmp_path):
    """An aLoRA adapter (random, non-zero weights) on SmolLM2, saved and loaded with the engine's
    loader: standard decoding == the base model's HF generate token for token; every ConfAdapt block
    starts with the base model's greedy token."""
    tok = copy.deepcopy(smollm2.tokenizer)
    lm = wrap_model(copy.deepcopy(smollm2.model), tok, source="smollm2-135m")
    cfg = TrainConfig(base="smollm2-135m", data="x", output=str(tmp_path), adapter="alora", lora_rank=4)
    setup = load_for_training(cfg, torch.device("cpu"), lm=lm)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in setup.student.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    out = export_model(cfg, setup.lm, setup.student, tmp_path / "alora")
    assert json.loads((out / "mtp_adapter.json").read_text())["adapter"] == "alora"
    mtp = load_checkpoint(str(out), device="cpu")
    assert mtp.adapter == "alora" and mtp.mask_token_id == smollm2.mask_token_id
    assert (out / "adapter_model.safetensors").stat().st_size < 8_000_000  # no whole embedding matrix
    n = 16
    for q in ["What is 15 plus 27?"]:
        ids = smollm2.prompt_ids(q)
        want = hf_generate(smollm2, ids, n)
        assert generate(mtp, q, standard(), n).token_ids == want
        dec = Decoder(mtp, ids, confadapt(0.0, 4), max_new_tokens=n)  # tau 0: keep whole blocks of 4
        recs = list(dec)
        got = dec.result().token_ids
        with torch.no_grad():
            logits = smollm2.model(input_ids=torch.tensor([ids + got])).logits[0].float()
        logits[:, smollm2.mask_token_id] = float("-inf")
        greedy = logits.argmax(-1)
        i = 0
        for r in recs:
            assert r.kept[0] == int(greedy[len(ids) + i - 1]), (r.index, r.kept)
            i += len(r.kept)
        assert any(r.accepted > 1 for r in recs)
        assert got != want  # the adapter's mask proposals are not the base's continuation


def test_cli_alora_checkpoint_saves_reloads_and_decodes(base_tokenizer, tmp_path):
    tok = copy.deepcopy(base_tokenizer)
    d = tmp_path / "tiny"
    make_tiny(tok).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i} and {i}.", "response": f"{i} plus {i} is {2 * i}."}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    assert main(["--base", str(d), "--data", str(data), "--output", str(out), "--adapter", "alora", "--lora-rank", "4",
                 "--max-steps", "2", "--batch-size", "2", "--k-max", "4", "--seq-len", "40", "--lr", "1e-2",
                 "--prompt-format", "bos_newlines",
                 "--warmup", "0"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and all(r["loss"] > 0 for r in log)
    mtp = load_checkpoint(str(out / "final"), device="cpu")
    base = load_checkpoint(str(d), device="cpu")
    assert mtp.adapter == "alora" and mtp.mtp_trained and mtp.prompt_format == "bos_newlines"
    base.prompt_format = "bos_newlines"
    ids = mtp.prompt_ids("Add 2 and 2.")
    assert generate(mtp, "Add 2 and 2.", standard(), 12).token_ids == hf_generate(base, ids, 12)
    dec = Decoder(mtp, ids, confadapt(0.5, 4), max_new_tokens=12)
    recs = list(dec)
    assert recs[0].fed_masks == 3 and len(recs[0].proposals) == 4 and dec.result().new_tokens >= 1
