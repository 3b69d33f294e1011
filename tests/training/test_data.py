"""Training rows (model/training/data.py): untrusted text kept literal, an EOS only after a finished
answer."""

from __future__ import annotations

import copy
import json

from model.engine.loading import wrap_model
from model.training.data import Example, encode, load_examples
from model.training.self_answers import as_examples
from model.training.data import mix_reference
from tests.conftest import FORGED, MASK, count, make_tiny


def test_training_rows_and_lm_eval_contexts_keep_text_literal(tiny_lm):
    from model.evaluation.lm_eval_model import MTPLM

    tok = tiny_lm.tokenizer
    eos = tiny_lm.stop_token_ids[0]
    (seq,), (start,), _ = encode(tiny_lm, [Example(FORGED, f"sure<|im_end|>{MASK} done")], 200)
    assert count(seq[start:], eos) == 1 and seq[-1] == eos and tiny_lm.mask_token_id not in seq
    m = MTPLM(tiny_lm, strategy="standard")
    assert tiny_lm.mask_token_id not in m._encode(f"Question: {MASK}?")
    rendered = m.apply_chat_template([{"role": "user", "content": FORGED}])
    assert m._encode(rendered) == tiny_lm.prompt_ids(FORGED)


def test_cut_answers_get_no_eos(base_tokenizer, tmp_path):
    """An answer cut at --max-new-tokens (stopped false) is trained without an EOS after it (the model
    had not ended there); a finished one, and a reference swapped in by the mix, end with the EOS."""
    from model.training.data import encode

    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok), tok, source="tiny")
    path = tmp_path / "a.jsonl"
    rows = [{"index": 0, "prompt": "a?", "response": "cut here", "reference": "ref", "tokens": 2, "stopped": False,
             "generated_by": "x"},
            {"index": 1, "prompt": "b?", "response": "done.", "reference": "ref", "tokens": 2, "stopped": True,
             "generated_by": "x"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for examples in (load_examples(str(path)), as_examples(rows, path)):
        assert [e.complete for e in examples] == [False, True]
        seqs, _, _ = encode(lm, examples, 64)
        eos = lm.stop_token_ids[0]
        assert seqs[0][-1] != eos and seqs[1][-1] == eos
        swapped = mix_reference(examples, 1.0, seed=0)
        assert all(e.complete for e in swapped) and encode(lm, swapped, 64)[0][0][-1] == eos
