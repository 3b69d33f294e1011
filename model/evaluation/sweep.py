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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..engine.decoding import run
from ..engine.loaded_model import LoadedModel
from ..engine.scoring import teacher_nll
from ..engine.strategies import Strategy, standard
from .accuracy import draft_metrics

SWEEP_FILE = "sweep.json"
#: Taus of a sweep when none are given (the page's button).
DEFAULT_TAUS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
_POINT_KEYS = ("strategy", "name", "label", "tau", "k_max", "k", "effective_k", "agreement_with_standard",
               "nll_teacher", "accuracy", "draft_acceptance_rate", "acceptance_by_position")


def from_report(report: dict) -> dict:
    """The sweep of an evaluation report (:func:`model.evaluation.accuracy.evaluate`): one point per
    strategy, plus what it was measured on.

    Returns:
        ``{"model", "data", "n_prompts", "max_new_tokens", "dtype", "points": [{"strategy", "name", "label",
        "tau", "k_max", "k", "effective_k", "agreement_with_standard", "nll_teacher", "accuracy",
        "draft_acceptance_rate", "acceptance_by_position"}]}``.
    """
    cfg = report["config"]
    points = []
    for row in report["strategies"]:
        point = {k: row.get(k) for k in _POINT_KEYS}
        point["effective_k"] = row["effective_k_mean"]
        points.append(point)
    return {"model": cfg.get("model"), "data": cfg.get("data"), "n_prompts": cfg.get("n_problems"),
            "max_new_tokens": cfg.get("max_new_tokens"), "dtype": cfg.get("dtype"), "points": points}


def run_sweep(lm: LoadedModel, prompts: Sequence[str], strategies: Sequence[Strategy], *, max_new_tokens: int = 64,
              on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Measure a sweep on ``prompts`` (user messages; no gold answers: ``accuracy`` is None).

    Standard decoding runs first on each prompt (the reference for agreement); ``on_progress(done, total)``
    is called after every generation.
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
        point = {"strategy": s.spec, "name": s.name, "label": s.label, "tau": s.tau, "k_max": s.k_max, "k": s.k,
                 "effective_k": acc["tokens"] / acc["passes"] if acc["passes"] else 0.0,
                 "agreement_with_standard": acc["same"] / len(prompts) if prompts else 0.0,
                 "nll_teacher": acc["nll"] / acc["nll_tokens"] if acc["nll_tokens"] else None, "accuracy": None}
        point.update({k: v for k, v in draft_metrics(acc["drafts"]).items()
                      if k in ("draft_acceptance_rate", "acceptance_by_position")})
        points.append(point)
    return {"model": lm.source, "data": "prompts", "n_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "dtype": lm.dtype_name, "points": points}


def write_sweep(sweep: dict, path: str | Path) -> Path:
    """Write a sweep as strict JSON (the parent directory is created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(sweep, indent=1, allow_nan=False))
    return p


def load_sweep(directory: str | Path | None) -> dict | None:
    """The sweep shipped in a checkpoint directory (``sweep.json``), or None when there is none or it is
    unreadable."""
    if directory is None:
        return None
    try:
        data = json.loads((Path(directory) / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("points"), list) else None


def verify_acceptance(sweep: dict | None, k_max: int) -> list[float | None] | None:
    """The acceptance by draft position a sweep measured for linear verification at ``k_max`` (the input of
    :func:`model.engine.width.choose_verify_layout`), or None."""
    for p in (sweep or {}).get("points", []):
        if p.get("name") == "verify" and p.get("k_max") == k_max and p.get("acceptance_by_position"):
            if str(p.get("strategy", "")).count(":") < 2:  # the linear layout's
                return list(p["acceptance_by_position"])
    return None
