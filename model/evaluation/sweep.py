"""The speed/quality trade-off of a checkpoint over tau: what the page draws beside every answer (paper 4.5).

ConfAdapt's threshold tau buys tokens per forward pass (effective k) with quality: the lower tau, the
more tokens a pass keeps and the more often the answer leaves the one standard decoding would give.
A **sweep** measures, per strategy on a set of prompts: effective k, the share of answers identical to
standard decoding's, the answers' mean negative log-likelihood per token under the teacher (the base
model, adapter off), and for lossless verification the acceptance by draft position.

The default adapter ships its sweep as ``assets/smollm2-135m-mtp/sweep.json``, written by::

    python -m model.evaluate --data assets/gsm8k_test_sample.jsonl --max-new-tokens 128 \\
        --strategies standard,confadapt:0.5:4,confadapt:0.6:4,confadapt:0.7:4,confadapt:0.8:4,confadapt:0.9:4,\\
confadapt:0.95:4,confadapt:0.99:4,verify:4,verify:4:full --out runs/eval/sweep.json \\
        --sweep assets/smollm2-135m-mtp/sweep.json

(:func:`from_report`); :func:`run_sweep` measures one directly on a few prompts (the page's button for a
checkpoint that has none).

The types: a :class:`Sweep` holds one :class:`SweepPoint` per strategy, its strategy spec parsed once into a
:class:`~model.engine.strategies.Strategy`; :meth:`Sweep.to_dict` / :meth:`Sweep.from_dict` are the
``sweep.json`` format. An :class:`AnswerPoint` is one finished answer of the page, drawn beside the sweep. They
live in :mod:`model.evaluation.sweep_types` and are re-exported here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

from ..engine.decoding import run
from ..engine.loaded_model import LoadedModel
from ..engine.scoring import teacher_nll
from ..engine.strategies import Strategy, standard
from .accuracy import draft_metrics
from .sweep_types import AnswerPoint, Sweep, SweepPoint  # noqa: F401 - re-exported (AnswerPoint)

__all__ = ["SWEEP_FILE", "AnswerPoint", "Sweep", "SweepPoint", "from_report", "run_sweep", "write_sweep", "load_sweep",
           "verify_acceptance"]

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
#: The keys of a point in ``sweep.json``, in the order they are written.
_POINT_KEYS = ("strategy", "name", "label", "tau", "k_max", "k", "effective_k", "agreement_with_standard",
               "nll_teacher", "accuracy", "draft_acceptance_rate", "acceptance_by_position")


# ----------------------------------------------------------------------------- making, writing, reading
def from_report(report: dict) -> Sweep:
    """The sweep of an evaluation report (:func:`model.evaluation.accuracy.evaluate`): one point per
    strategy (its ``effective_k`` is the report's ``effective_k_mean``), plus what it was measured on.

    Raises:
        KeyError: a report without ``config`` or ``strategies``, or a row without ``effective_k_mean``.
        ValueError: a row :meth:`SweepPoint.from_dict` refuses (a bad strategy spec or value).
    """
    cfg = report["config"]
    points = tuple(SweepPoint.from_dict(dict({k: row.get(k) for k in _POINT_KEYS}, effective_k=row["effective_k_mean"]))
                   for row in report["strategies"])
    return Sweep(cfg.get("model"), cfg.get("data"), cfg.get("n_problems"), cfg.get("max_new_tokens"), cfg.get("dtype"),
                 points)


def run_sweep(lm: LoadedModel, prompts: Sequence[str], strategies: Sequence[Strategy], *, max_new_tokens: int = 64,
              on_progress: Callable[[int, int], None] | None = None) -> Sweep:
    """Measure a sweep on ``prompts`` (user messages; no gold answers: ``accuracy`` is None).

    Standard decoding runs first on each prompt (the reference for agreement; a standard strategy in
    ``strategies`` is that one); ``on_progress(done, total)`` is called after every generation. The sweep's
    ``data`` is ``"prompts"``.
    """
    strategies = [s for s in strategies if s.name != "standard"]
    total, done = len(prompts) * (len(strategies) + 1), 0
    sums: dict[str, dict[str, Any]] = {s.spec: {"tokens": 0, "passes": 0, "same": 0, "nll": 0.0, "nll_tokens": 0,
                                                "drafts": []} for s in [standard(), *strategies]}
    for prompt in prompts:
        ids = lm.prompt_ids(prompt)
        ref = None
        for s in [standard(), *strategies]:
            res = run(lm, ids, s, max_new_tokens)
            ref = res if ref is None else ref
            nll, n = teacher_nll(lm, ids, res.token_ids)
            acc = sums[s.spec]
            acc["tokens"] += res.new_tokens
            acc["passes"] += res.forward_passes
            acc["same"] += int(res.token_ids == ref.token_ids)
            acc["nll"] += nll
            acc["nll_tokens"] += n
            acc["drafts"] += [list(p.counted_drafts) for p in res.passes if p.fed_drafts]
            done += 1
            if on_progress is not None:
                on_progress(done, total)
    points = []
    for s in [standard(), *strategies]:
        acc = sums[s.spec]
        drafts = draft_metrics(acc["drafts"])
        by_pos = drafts.get("acceptance_by_position")
        points.append(SweepPoint(
            s, acc["tokens"] / acc["passes"] if acc["passes"] else 0.0,
            acc["same"] / len(prompts) if prompts else 0.0,
            acc["nll"] / acc["nll_tokens"] if acc["nll_tokens"] else None, None,
            drafts.get("draft_acceptance_rate"), None if by_pos is None else tuple(by_pos)))
    return Sweep(lm.source, "prompts", len(prompts), max_new_tokens, lm.dtype_name, tuple(points))


def write_sweep(sweep: Sweep, path: str | Path) -> Path:
    """Write a sweep as strict JSON (:meth:`Sweep.to_dict`; the parent directory is created) and return the path.

    Raises:
        OSError: the file cannot be written.
        ValueError: a value JSON cannot hold (NaN, infinity).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(sweep.to_dict(), indent=1, allow_nan=False))
    return p


def load_sweep(directory: str | Path | None) -> Sweep | None:
    """The sweep shipped in a checkpoint directory (``sweep.json``), or None when there is none (or no
    directory). A file that is not a sweep (:meth:`Sweep.from_dict` refuses it) is logged and read as none."""
    if directory is None:
        return None
    path = Path(directory) / SWEEP_FILE
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return Sweep.from_dict(json.loads(text))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        log.warning("ignoring %s: not a sweep (%s)", path, e)
        return None


def verify_acceptance(sweep: Sweep | None, k_max: int) -> list[float | None] | None:
    """The acceptance by draft position a sweep measured for linear verification at ``k_max`` (the input of
    :func:`model.engine.width.choose_verify_layout`), or None (no sweep, no such point, or none measured)."""
    for p in sweep.named("verify") if sweep is not None else ():
        if p.linear_verify and p.k_max == k_max and p.acceptance_by_position:
            return list(p.acceptance_by_position)
    return None
