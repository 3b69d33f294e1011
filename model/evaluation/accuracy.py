"""GSM8K evaluation: accuracy against effective k for several decoding strategies (paper 4.5).

:func:`evaluate` runs every strategy on every problem (``python -m model.evaluate`` is its command
line). For every strategy it reports

* ``accuracy`` (flexible extraction of the final number, :mod:`model.evaluation.gsm8k`) and its standard
  error ``sqrt(p (1 - p) / n)``;
* ``effective_k_mean`` / ``effective_k_std``: mean and standard deviation over all forward passes
  of the tokens kept per pass (the paper's acceleration measure);
* ``tokens_per_second``: generated tokens over the summed seconds of the strategy's own passes;
* ``nll_teacher``: mean negative log-likelihood per generated token (nats) under the base model
  with any MTP adapter off — the paper's "quality under the teacher";
* ``agreement_with_standard``: fraction of problems whose answer text equals standard decoding's
  exactly, and ``agreement_with_base``: the same against standard decoding of the base model
  with the adapter off (identical to the former when the model has no adapter);
* for lossless verification, the serving engines' figures: ``effective_k_mean`` is the mean
  acceptance length, ``draft_acceptance_rate`` and ``acceptance_by_position`` (:func:`draft_metrics`).

Strategies run one after another on each problem, so they share the machine's state evenly.
:func:`write_figure` draws the Plotly Pareto figure (accuracy vs effective k) as ``.html`` and ``.png``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil
from tqdm import tqdm

from ..engine.decoding import GenerationResult, run
from ..engine.loaded_model import LoadedModel
from ..engine.sampling import GREEDY, Sampling, for_request
from ..engine.scoring import teacher_nll
from ..engine.strategies import Strategy, check_max_new_tokens, resolve_strategy, standard
from ..errors import DataError
from .gsm8k import extract_answer, is_correct, make_prompt

DEFAULT_STRATEGIES = (
    "standard,static:2,static:3,static:4,confadapt:0.95,confadapt:0.9,confadapt:0.8,confadapt:0.7,verify")
CHROMIUM = "/usr/bin/chromium"
PNG_TIMEOUT_S = 90.0  # one export takes ~3 s; a browser that never answers must not hang an evaluation
_PNG_EXPORT = "import sys, plotly.io as pio; pio.read_json(sys.argv[1]).write_image(sys.argv[2])"


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
    position, the share of passes that proposed it in which it was accepted). The mean acceptance length
    is ``effective_k_mean``. Empty dict without drafts."""
    if not drafts:
        return {}
    proposed = sum(n for n, _ in drafts)
    accepted = sum(a for _, a in drafts)
    width = max(n for n, _ in drafts)
    by_pos = []
    for j in range(width):
        seen = [a for n, a in drafts if n > j]
        by_pos.append(sum(a > j for a in seen) / len(seen))
    return {"drafts_proposed": proposed, "drafts_accepted": accepted,
            "draft_acceptance_rate": accepted / proposed if proposed else None, "acceptance_by_position": by_pos}


def evaluate(
    lm: LoadedModel,
    problems: list[dict],
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 256,
    step_by_step: bool = False,
    progress: bool = True,
    on_problem: Callable[[dict], None] | None = None,
    sampling: Sampling | None = None,
) -> dict:
    """Run every strategy on every problem and score them (paper 4.5, Table/Figure "accuracy vs k").

    Args:
        lm: the model (an MTP adapter, if any, is used for decoding; the teacher is the base).
        problems: from :func:`load_problems`.
        strategies: decoding strategies; standard decoding is added first if missing (it is the
            reference for ``agreement_with_standard``).
        max_new_tokens: per answer.
        step_by_step: append "Let's think step by step." to each question.
        progress: show a tqdm bar on stderr.
        on_problem: called after each problem with the partial report so far (same shape as
            the return value, ``config["complete"]`` False) — the CLI saves it, so a long run
            that is stopped early still leaves its results.
        sampling: greedy when None; else every strategy samples problem ``i`` with the same settings and the
            seed advanced by ``i`` (:func:`~model.engine.sampling.for_request`), so their draws start alike;
            ``agreement_with_standard`` then compares different draws, not the same decoding.

    Returns:
        ``{"config", "strategies": [summary per strategy], "base_standard": summary or None,
        "problems": [per-problem records]}``. ``base_standard`` is present when the model has an
        MTP adapter: standard decoding with the adapter off.

    Raises:
        ValueError: bad max_new_tokens, no problems.
    """
    check_max_new_tokens(max_new_tokens)
    if not problems:
        raise ValueError("No problems to evaluate.")
    strategies = list(strategies)
    if standard() not in strategies:
        strategies.insert(0, standard())
    else:  # standard first: the others compare with it
        strategies.remove(standard())
        strategies.insert(0, standard())
    has_adapter = lm.adapter is not None
    base_lm = lm.without_adapter() if has_adapter else None

    per_strategy: dict[str, list[dict]] = {s.spec: [] for s in strategies}
    base_records: list[dict] = []
    problem_rows: list[dict] = []
    bar = tqdm(total=len(problems) * (len(strategies) + has_adapter), desc="evaluate", unit="gen",
               disable=not progress, file=sys.stderr)
    for i, prob in enumerate(problems):
        draw = for_request(sampling or GREEDY, i)
        prompt_ids = lm.prompt_ids(make_prompt(prob["question"], step_by_step))
        row: dict[str, Any] = {"index": prob["index"], "question": prob["question"], "gold": prob["gold"],
                               "prompt_tokens": len(prompt_ids), "results": {}}
        base_text: str | None = None
        if base_lm is not None:
            with lm.base_model():
                res = run(base_lm, prompt_ids, standard(), max_new_tokens, draw)
            base_text = res.text
            rec = _record(lm, prompt_ids, res, prob["gold"], None, base_text)
            rec["same_as_standard"] = rec["same_answer_as_standard"] = True
            base_records.append(rec)
            row["base_standard"] = rec
            bar.update()
        std_text = std_answer = None
        for s in strategies:
            res = run(lm, prompt_ids, s, max_new_tokens, draw)
            if s.name == "standard":
                std_text, std_answer = res.text, extract_answer(res.text)
            rec = _record(lm, prompt_ids, res, prob["gold"], (std_text, std_answer),
                          base_text if base_text is not None else std_text)
            per_strategy[s.spec].append(rec)
            row["results"][s.spec] = rec
            bar.update()
        problem_rows.append(row)
        if on_problem is not None:
            on_problem(_report(lm, strategies, per_strategy, base_records, problem_rows, max_new_tokens,
                               step_by_step, len(problems), sampling or GREEDY))
    bar.close()
    return _report(lm, strategies, per_strategy, base_records, problem_rows, max_new_tokens, step_by_step,
                   len(problems), sampling or GREEDY)


def _report(lm: LoadedModel, strategies: list[Strategy], per_strategy: dict[str, list[dict]],
            base_records: list[dict], problem_rows: list[dict], max_new_tokens: int, step_by_step: bool,
            n_requested: int, sampling: Sampling = GREEDY) -> dict:
    has_adapter = lm.adapter is not None
    return {
        "config": {
            "model": lm.source, "adapter": lm.adapter, "mtp_trained": lm.mtp_trained, "dtype": lm.dtype_name,
            "prompt_format": lm.prompt_format, "device": str(lm.device), "max_new_tokens": max_new_tokens,
            "step_by_step": step_by_step, "n_problems": len(problem_rows),
            "n_requested": n_requested, "complete": len(problem_rows) == n_requested, "strategies": [s.spec for s in strategies],
            "teacher": "base model, adapter off" if has_adapter else "the model itself (no adapter)",
            "warnings": list(lm.warnings), "sampling": sampling.to_dict(),
        },
        "strategies": [summarize(s, per_strategy[s.spec]) for s in strategies],
        "base_standard": summarize(standard(), base_records) if base_records else None,
        "problems": problem_rows,
    }


def _record(lm: LoadedModel, prompt_ids: list[int], res: GenerationResult, gold: str,
            std: tuple[str | None, str | None] | None, base_text: str | None) -> dict:
    extracted = extract_answer(res.text)
    nll_sum, nll_tokens = teacher_nll(lm, prompt_ids, res.token_ids)
    std_text, std_answer = std if std is not None else (res.text, extracted)
    return {
        "text": res.text, "extracted": extracted, "correct": is_correct(extracted, gold),
        "new_tokens": res.new_tokens, "forward_passes": res.forward_passes, "effective_k": res.effective_k,
        "kept_per_pass": [len(p.kept) for p in res.passes], "seconds": res.seconds,
        "drafts_per_pass": [list(p.counted_drafts) for p in res.passes if p.fed_drafts],
        "nll_sum": nll_sum, "nll_tokens": nll_tokens,
        "nll_teacher": nll_sum / nll_tokens if nll_tokens else None,
        "same_as_standard": res.text == std_text,
        "same_answer_as_standard": extracted == std_answer,
        "same_as_base": res.text == base_text,
    }


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
    recomputed. Modifies and returns ``report`` (a dict written by :func:`main`).

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


# --------------------------------------------------------------------------- figure
def pareto_figure(report: dict):
    """Plotly figure: accuracy (± standard error) against mean effective k, one marker per strategy.

    Standard decoding and each static k are single markers; ConfAdapt is one line over tau per
    k_max, each point labelled with its tau. Returns a ``plotly.graph_objects.Figure``.
    """
    import plotly.graph_objects as go

    rows = report["strategies"]
    fig = go.Figure()
    singles = [r for r in rows if r["name"] != "confadapt"]
    for r in singles:
        fig.add_trace(go.Scatter(
            x=[r["effective_k_mean"]], y=[r["accuracy"]], mode="markers+text", name=r["label"],
            text=[r["label"]], textposition="top center",
            error_y=dict(type="data", array=[r["accuracy_stderr"]], visible=True),
            marker=dict(size=11, symbol="square" if r["name"] == "standard" else "diamond"),
        ))
    for k_max in sorted({r["k_max"] for r in rows if r["name"] == "confadapt"}):
        ca = sorted((r for r in rows if r["name"] == "confadapt" and r["k_max"] == k_max), key=lambda r: -r["tau"])
        fig.add_trace(go.Scatter(
            x=[r["effective_k_mean"] for r in ca], y=[r["accuracy"] for r in ca], mode="lines+markers+text",
            name=f"ConfAdapt k_max={k_max} (tau)", text=[f"tau={r['tau']:g}" for r in ca],
            textposition="bottom right",
            error_y=dict(type="data", array=[r["accuracy_stderr"] for r in ca], visible=True),
            marker=dict(size=9),
        ))
    cfg = report["config"]
    fig.update_layout(
        title=f"GSM8K accuracy vs effective k — {cfg['model']} ({cfg['n_problems']} problems, "
              f"max {cfg['max_new_tokens']} new tokens)",
        xaxis_title="effective k (tokens per forward pass, mean over passes)",
        yaxis_title="accuracy (flexible extraction)", template="plotly_white", width=900, height=560,
    )
    fig.update_yaxes(rangemode="tozero", tickformat=".0%")
    return fig


def write_figure(report: dict, out_json: Path, png_timeout_s: float = PNG_TIMEOUT_S) -> dict:
    """Write ``<out>.html`` (self-contained) and ``<out>.png`` beside the JSON file.

    PNG export uses kaleido with Chromium (``BROWSER_PATH``, default /usr/bin/chromium when it
    exists), in a child process given ``png_timeout_s`` seconds: a browser that starts but never
    answers is killed with its process group instead of hanging the run. Returns
    ``{"html": path, "png": path or None, "png_error": message or None}``; a failed or timed-out
    PNG export is reported there, never raised (the HTML is always written).
    """
    fig = pareto_figure(report)
    html = out_json.with_suffix(".html")
    png = out_json.with_suffix(".png")
    fig.write_html(str(html), include_plotlyjs=True, full_html=True)
    env = dict(os.environ)
    if "BROWSER_PATH" not in env and Path(CHROMIUM).exists():
        env["BROWSER_PATH"] = CHROMIUM
    error = _export_png(fig.to_json(), png, env, png_timeout_s)
    if error is None:
        return {"html": str(html), "png": str(png), "png_error": None}
    return {"html": str(html), "png": None,
            "png_error": f"PNG export failed ({error}); kaleido needs Chrome/Chromium: set BROWSER_PATH. "
                         "The HTML figure was written."}


def _export_png(figure_json: str, png: Path, env: dict, timeout_s: float) -> str | None:
    """Run kaleido in a child process; return None on success, else a one-line reason.

    On timeout the child and every process under it are killed (the browser runs in a session of its own,
    so the child's process group would not reach it)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "figure.json"
        spec.write_text(figure_json)
        proc = subprocess.Popen([sys.executable, "-c", _PNG_EXPORT, str(spec), str(png)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                tree = psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            proc.kill()
            for child in tree:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(tree, timeout=5)
            proc.communicate()
            return f"no image after {timeout_s:.0f} s"
    if proc.returncode == 0 and png.exists():
        return None
    lines = [ln for ln in (err or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _drafts_cell(row: dict) -> str:
    if row.get("draft_acceptance_rate") is None:
        return ""
    return (f"  {row['draft_acceptance_rate']:.2f} ("
            + " / ".join(f"{x:.2f}" for x in row.get("acceptance_by_position", [])) + ")")


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
