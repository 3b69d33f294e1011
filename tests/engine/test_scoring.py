"""An answer's log-likelihood under the teacher (model/engine/scoring.py)."""

from __future__ import annotations

import math

import pytest

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
