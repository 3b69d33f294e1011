"""An evaluation report without the model (:mod:`model.evaluation.accuracy`): each strategy's summary of its
per-problem records (:func:`summarize`, :func:`draft_metrics`), saved reports read back (:func:`read_report`),
rescored with the current answer extractor (:func:`rescore`) and merged from shards (:func:`merge_reports`), and the
summary as a plain-text table (:func:`format_table`). The fields are described in :mod:`model.evaluation.accuracy`.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from ..engine.records import DraftTally, by_position_text
from ..engine.strategies import Strategy, resolve_strategy, standard
from ..errors import DataError
from .gsm8k import extract_answer, is_correct


def _stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n > 0 else 0.0


def summarize(strategy: Strategy, records: list[dict]) -> dict:
    """Aggregate the per-problem records of one strategy (see the module docstring for fields)."""
    n = len(records)
    kept = [k for r in records for k in r["kept_per_pass"]]
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    nll_tokens = sum(r["nll_tokens"] for r in records)
    acc = sum(r["correct"] for r in records) / n if n else 0.0
    out = {
        "strategy": strategy.spec, "label": strategy.label, "name": strategy.name, "k_max": strategy.k_max,
        "k": strategy.k, "tau": strategy.tau, "n": n,
        "accuracy": acc, "accuracy_stderr": _stderr(acc, n),
        "effective_k_mean": statistics.fmean(kept) if kept else 0.0,
        "effective_k_std": statistics.pstdev(kept) if len(kept) > 1 else 0.0,
        "forward_passes": len(kept), "new_tokens": tokens, "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "nll_teacher": sum(r["nll_sum"] for r in records) / nll_tokens if nll_tokens else None,
        "agreement_with_standard": sum(r["same_as_standard"] for r in records) / n if n else 0.0,
        "agreement_with_base": sum(r["same_as_base"] for r in records) / n if n else 0.0,
        "answer_agreement_with_standard": sum(r["same_answer_as_standard"] for r in records) / n if n else 0.0,
    }
    out.update(draft_metrics([d for r in records for d in r.get("drafts_per_pass", [])]))
    return out


def draft_metrics(drafts: Sequence[Sequence[int]]) -> dict:
    """Verification's acceptance figures, as vLLM and llama.cpp name them, from ``(proposed, accepted)``
    per pass that fed drafts (:attr:`~model.engine.decoding.PassRecord.counted_drafts`):
    ``draft_acceptance_rate`` (accepted / proposed drafts) and ``acceptance_by_position`` (per draft
    position, the share of passes that proposed it in which it was accepted), with the counts behind those
    shares (``drafts_accepted_by_position``, ``drafts_checked_by_position``). The mean acceptance length
    is ``effective_k_mean``. Empty dict without drafts."""
    if not drafts:
        return {}
    tally = DraftTally()
    for n, a in drafts:
        tally.add_counts(n, a)
    proposed, accepted = sum(tally.proposed), sum(tally.accepted)
    return {"drafts_proposed": proposed, "drafts_accepted": accepted,
            "draft_acceptance_rate": accepted / proposed if proposed else None,
            "acceptance_by_position": tally.by_position(),
            "drafts_accepted_by_position": tally.accepted, "drafts_checked_by_position": tally.proposed}


def by_position_cell(row: dict) -> str:
    """A report row's acceptance by draft position as :func:`~model.engine.records.by_position_text` writes it
    (counts where a position was checked fewer than ``FEW_CHECKS`` times); a report written before the counts were
    kept: its shares."""
    if "drafts_checked_by_position" in row:
        return by_position_text(row["drafts_accepted_by_position"], row["drafts_checked_by_position"])
    return " / ".join(f"{x:.2f}" for x in row.get("acceptance_by_position", []))


def read_report(path: str | Path) -> dict:
    """A report as :func:`evaluate` returns it and ``model.evaluate --out`` writes it (JSON).

    Raises:
        DataError: a file that cannot be read, or is not JSON (naming ``path:line:column``).
    """
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: not a report written by model.evaluate --out "
                        f"(not valid JSON: {e.msg}).") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a report written by model.evaluate --out (not UTF-8 text).") from None


def rescore(report: dict) -> dict:
    """Re-extract every saved answer with the current extractor and recompute the summaries.

    Generation-dependent fields (texts, passes, seconds, NLL, text agreement) are kept; the
    ``extracted``, ``correct`` and ``same_answer_as_standard`` fields and the accuracies are
    recomputed. Modifies and returns ``report`` (a dict written by :func:`model.evaluate.main`).

    Raises:
        ValueError: the dict is not an evaluation report.
    """
    if not isinstance(report, dict) or "problems" not in report or "strategies" not in report:
        raise ValueError("Not an evaluation report (needs 'problems' and 'strategies').")
    for row in report["problems"]:
        std = row["results"].get("standard")
        for rec in list(row["results"].values()) + ([row["base_standard"]] if row.get("base_standard") else []):
            rec["extracted"] = extract_answer(rec["text"])
            rec["correct"] = is_correct(rec["extracted"], row["gold"])
        for rec in row["results"].values():
            rec["same_answer_as_standard"] = std is not None and rec["extracted"] == std["extracted"]
    report["strategies"] = [
        summarize(resolve_strategy(r["strategy"]), [row["results"][r["strategy"]] for row in report["problems"]])
        for r in report["strategies"]
    ]
    if report.get("base_standard"):
        report["base_standard"] = summarize(standard(), [row["base_standard"] for row in report["problems"]])
    return report


MERGE_KEYS = ("model", "adapter", "dtype", "prompt_format", "max_new_tokens", "step_by_step", "strategies")


def merge_reports(reports: Sequence[dict]) -> dict:
    """One report from shards of one evaluation (e.g. ``--offset 0 --limit 100`` and ``--offset 100
    --limit 100`` run in two processes): their problems in file order, then :func:`rescore`.

    Args:
        reports: reports written by ``python -m model.evaluate`` with the same model, adapter, dtype,
            prompt format, token limit and strategies.

    Returns:
        A new report whose ``config`` is the first shard's with the problem counts, ``complete``
        (every shard complete), the shards' ``wall_seconds`` summed, and ``merged_from`` (shard count).

    Raises:
        ValueError: no reports, something that is not a report, shards that differ in a setting of
            :data:`MERGE_KEYS` (named), or a problem that two shards both hold (by index).
    """
    if not reports:
        raise ValueError("No reports to merge.")
    for r in reports:
        if not isinstance(r, dict) or "problems" not in r or "strategies" not in r or "config" not in r:
            raise ValueError("Not an evaluation report (needs 'config', 'problems' and 'strategies').")
    first = reports[0]["config"]
    for i, r in enumerate(reports[1:], start=2):
        for key in MERGE_KEYS:
            if r["config"].get(key) != first.get(key):
                raise ValueError(f"Report {i} differs from report 1 in {key}: {r['config'].get(key)!r} vs "
                                 f"{first.get(key)!r}; only shards of one evaluation merge.")
    rows = [row for r in reports for row in r["problems"]]
    seen: set[int] = set()
    for row in rows:
        if row["index"] in seen:
            raise ValueError(f"Problem {row['index']} is in two reports; shards must not overlap.")
        seen.add(row["index"])
    config = dict(first, n_problems=len(rows), n_requested=sum(r["config"].get("n_requested", 0) for r in reports),
                  complete=all(r["config"].get("complete", False) for r in reports), merged_from=len(reports))
    if all("wall_seconds" in r["config"] for r in reports):
        config["wall_seconds"] = sum(r["config"]["wall_seconds"] for r in reports)
    merged = {"config": config, "strategies": [dict(s) for s in reports[0]["strategies"]],
              "base_standard": reports[0].get("base_standard"),
              "problems": sorted(rows, key=lambda row: row["index"])}
    return rescore(merged)


def _drafts_cell(row: dict) -> str:
    if row.get("draft_acceptance_rate") is None:
        return ""
    return f"  {row['draft_acceptance_rate']:.2f} ({by_position_cell(row)})"


def format_table(report: dict) -> str:
    """The summary as a plain-text table (one row per strategy)."""
    head = (f"{'strategy':<26} {'acc':>6} {'±se':>6} {'k mean':>7} {'k std':>6} {'tok/s':>7} "
            f"{'NLL(T)':>7} {'=std':>5} {'=base':>6}  draft acceptance (by position)")
    lines = [head, "-" * len(head)]
    rows = list(report["strategies"])
    if report.get("base_standard"):
        rows = [dict(report["base_standard"], label="base (adapter off)")] + rows
    for r in rows:
        nll = f"{r['nll_teacher']:.3f}" if r["nll_teacher"] is not None else "-"
        lines.append(
            f"{r['label']:<26} {r['accuracy']:>6.3f} {r['accuracy_stderr']:>6.3f} {r['effective_k_mean']:>7.2f} "
            f"{r['effective_k_std']:>6.2f} {r['tokens_per_second']:>7.1f} {nll:>7} "
            f"{r['agreement_with_standard']:>5.2f} {r['agreement_with_base']:>6.2f}" + _drafts_cell(r))
    return "\n".join(lines)
