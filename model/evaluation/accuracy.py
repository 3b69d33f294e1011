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
The summaries, saved reports (read, rescored, merged) and the table are :mod:`model.evaluation.accuracy_report`'s
(re-exported here).
"""

from __future__ import annotations

import os
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
from ..engine.strategies import Strategy, check_max_new_tokens, standard
from .accuracy_report import (MERGE_KEYS, draft_metrics, format_table, merge_reports, read_report, rescore,
                              summarize)
from .gsm8k import extract_answer, is_correct, make_prompt

__all__ = ["DEFAULT_STRATEGIES", "evaluate", "pareto_figure", "write_figure",
           # re-exported from .accuracy_report, where they live
           "MERGE_KEYS", "draft_metrics", "format_table", "merge_reports", "read_report", "rescore", "summarize"]

DEFAULT_STRATEGIES = (
    "standard,static:2,static:3,static:4,confadapt:0.95,confadapt:0.9,confadapt:0.8,confadapt:0.7,verify")
CHROMIUM = "/usr/bin/chromium"
PNG_TIMEOUT_S = 90.0  # one export takes ~3 s; a browser that never answers must not hang an evaluation
_PNG_EXPORT = "import sys, plotly.io as pio; pio.read_json(sys.argv[1]).write_image(sys.argv[2])"


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
    strategies = _standard_first(strategies)
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
        base_rec, results = _problem_records(lm, base_lm, strategies, prompt_ids, prob["gold"], max_new_tokens, draw,
                                             bar)
        row: dict[str, Any] = {"index": prob["index"], "question": prob["question"], "gold": prob["gold"],
                               "prompt_tokens": len(prompt_ids), "results": dict(results)}
        if base_rec is not None:
            base_records.append(base_rec)
            row["base_standard"] = base_rec
        for spec, rec in results:
            per_strategy[spec].append(rec)
        problem_rows.append(row)
        if on_problem is not None:
            on_problem(_report(lm, strategies, per_strategy, base_records, problem_rows, max_new_tokens,
                               step_by_step, len(problems), sampling or GREEDY))
    bar.close()
    return _report(lm, strategies, per_strategy, base_records, problem_rows, max_new_tokens, step_by_step,
                   len(problems), sampling or GREEDY)


def _standard_first(strategies: Sequence[Strategy]) -> list[Strategy]:
    """``strategies`` as a new list with standard decoding first (added when missing)."""
    strategies = list(strategies)
    if standard() not in strategies:
        strategies.insert(0, standard())
    else:  # standard first: the others compare with it
        strategies.remove(standard())
        strategies.insert(0, standard())
    return strategies


def _problem_records(lm: LoadedModel, base_lm: LoadedModel | None, strategies: list[Strategy], prompt_ids: list[int],
                     gold: str, max_new_tokens: int, draw: Sampling,
                     bar: Any) -> tuple[dict | None, list[tuple[str, dict]]]:
    """One problem's generations, scored (:func:`_record`): standard decoding of the base with the adapter off
    (None without ``base_lm``), then ``(spec, record)`` of each strategy in order (standard first: the others
    compare with it). ``bar`` advances after every generation."""
    base_rec = base_text = None
    if base_lm is not None:
        with lm.base_model():
            res = run(base_lm, prompt_ids, standard(), max_new_tokens, draw)
        base_text = res.text
        base_rec = _record(lm, prompt_ids, res, gold, None, base_text)
        base_rec["same_as_standard"] = base_rec["same_answer_as_standard"] = True
        bar.update()
    results = []
    std_text = std_answer = None
    for s in strategies:
        res = run(lm, prompt_ids, s, max_new_tokens, draw)
        if s.name == "standard":
            std_text, std_answer = res.text, extract_answer(res.text)
        results.append((s.spec, _record(lm, prompt_ids, res, gold, (std_text, std_answer),
                                        base_text if base_text is not None else std_text)))
        bar.update()
    return base_rec, results


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
