"""GSM8K evaluation: accuracy against effective k for several decoding strategies (paper 4.5).

    python -m model.evaluate --model smollm2-135m --data gsm8k_test.jsonl --limit 20 \\
        --strategies standard,static:2,static:3,static:4,confadapt:0.95,confadapt:0.9,confadapt:0.8,confadapt:0.7 \\
        --max-new-tokens 192 --out runs/eval/smollm2.json

For every strategy it reports

* ``accuracy`` (flexible extraction of the final number, :mod:`model.answers`) and its standard
  error ``sqrt(p (1 - p) / n)``;
* ``effective_k_mean`` / ``effective_k_std``: mean and standard deviation over all forward passes
  of the tokens kept per pass (the paper's acceleration measure);
* ``tokens_per_second``: generated tokens over the summed seconds of the strategy's own passes;
* ``nll_teacher``: mean negative log-likelihood per generated token (nats) under the base model
  with any MTP adapter off — the paper's "quality under the teacher";
* ``agreement_with_standard``: fraction of problems whose answer text equals standard decoding's
  exactly, and ``agreement_with_base``: the same against standard decoding of the base model
  with the adapter off (identical to the former when the model has no adapter).

Strategies run one after another on each problem, so they share the machine's state evenly.
It writes one JSON file (summary + per-problem records) and a Plotly Pareto figure (accuracy vs
effective k) next to it as ``.html`` and ``.png``. Bad arguments exit with status 2 and one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from .answers import extract_answer, extract_gold, is_correct
from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from .decoding import GenerationResult, NonFiniteLogitsError, run
from .strategies import SPEC_HELP, Strategy, check_max_new_tokens, parse_strategies, parse_strategy, standard

STEP_BY_STEP = "Let's think step by step."
DEFAULT_STRATEGIES = (
    "standard,static:2,static:3,static:4,confadapt:0.95,confadapt:0.9,confadapt:0.8,confadapt:0.7,verify")
CHROMIUM = "/usr/bin/chromium"
OUT_DEFAULT = "runs/eval/eval.json"


# --------------------------------------------------------------------------- data
def load_problems(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read GSM8K-format JSONL: one ``{"question": ..., "answer": "... #### 18"}`` per line.

    Args:
        path: the JSONL file.
        limit: keep only the first ``limit`` problems (None: all).

    Returns:
        ``[{"index", "question", "answer", "gold"}]`` with ``gold`` the normalised number.

    Raises:
        ValueError: missing file, bad JSON, missing fields, an answer without ``#### number``,
            no problems, or a bad limit.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit must be an integer ≥ 1, got {limit!r}.")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"No such data file: {p}.")
    problems: list[dict] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not JSON ({e.msg}).") from None
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not isinstance(
                    row.get("answer"), str):
                raise ValueError(f"{p}:{lineno}: needs string fields 'question' and 'answer' (GSM8K format).")
            try:
                gold = extract_gold(row["answer"])
            except ValueError as e:
                raise ValueError(f"{p}:{lineno}: {e}") from None
            problems.append({"index": len(problems), "question": row["question"], "answer": row["answer"],
                             "gold": gold})
            if limit is not None and len(problems) >= limit:
                break
    if not problems:
        raise ValueError(f"{p} holds no problems.")
    return problems


def make_prompt(question: str, step_by_step: bool = False) -> str:
    """The user message for one problem: the question, optionally followed by "Let's think step by step."

    The model's own prompt format (chat template or ``bos + text + "\\n\\n"``) is applied by
    :meth:`LoadedModel.prompt_ids`.
    """
    return f"{question.strip()}\n{STEP_BY_STEP}" if step_by_step else question.strip()


# --------------------------------------------------------------------------- scoring
@torch.inference_mode()
def teacher_logprob(lm: LoadedModel, context_ids: Sequence[int], continuation_ids: Sequence[int]
                    ) -> tuple[float, bool]:
    """Log-probability (nats) of ``continuation_ids`` after ``context_ids`` under the teacher, and
    whether every continuation token is the teacher's greedy choice.

    The teacher is the base model with any MTP adapter off (:meth:`LoadedModel.base_model`).
    One forward pass over ``[1, C + A]`` tokens; log-softmax in float32 over the vocabulary
    without the mask token (as the decoder's confidences), so for standard decoding the
    log-probability of each token is the log of its confidence.

    Returns:
        ``(sum_logprob, is_greedy)``; ``(0.0, True)`` for an empty continuation.
    """
    n = len(continuation_ids)
    if not n:
        return 0.0, True
    ids = torch.tensor([list(context_ids) + list(continuation_ids)], dtype=torch.long, device=lm.device)
    with lm.base_model() as model:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float()
    logits[:, lm.mask_token_id] = float("-inf")  # as in decoding: the mask token is never a candidate
    logp = torch.log_softmax(logits, dim=-1)
    target = ids[0, -n:]
    total = logp.gather(1, target[:, None]).sum().item()
    return float(total), bool((logp.argmax(dim=-1) == target).all())


def teacher_nll(lm: LoadedModel, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ``answer_ids`` after ``prompt_ids`` under the teacher
    (:func:`teacher_logprob`). Returns ``(sum_nll, A)``, ``(0.0, 0)`` for an empty answer."""
    return -teacher_logprob(lm, prompt_ids, answer_ids)[0] + 0.0, len(answer_ids)


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
    return out


def evaluate(
    lm: LoadedModel,
    problems: list[dict],
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 256,
    step_by_step: bool = False,
    progress: bool = True,
    on_problem: Callable[[dict], None] | None = None,
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
    base_lm = dataclasses.replace(lm, adapter=None) if has_adapter else None

    per_strategy: dict[str, list[dict]] = {s.spec: [] for s in strategies}
    base_records: list[dict] = []
    problem_rows: list[dict] = []
    bar = tqdm(total=len(problems) * (len(strategies) + has_adapter), desc="evaluate", unit="gen",
               disable=not progress, file=sys.stderr)
    for prob in problems:
        prompt_ids = lm.prompt_ids(make_prompt(prob["question"], step_by_step))
        row: dict[str, Any] = {"index": prob["index"], "question": prob["question"], "gold": prob["gold"],
                               "prompt_tokens": len(prompt_ids), "results": {}}
        base_text: str | None = None
        if base_lm is not None:
            with lm.base_model():
                res = run(base_lm, prompt_ids, standard(), max_new_tokens)
            base_text = res.text
            rec = _record(lm, prompt_ids, res, prob["gold"], None, base_text)
            rec["same_as_standard"] = rec["same_answer_as_standard"] = True
            base_records.append(rec)
            row["base_standard"] = rec
            bar.update()
        std_text = std_answer = None
        for s in strategies:
            res = run(lm, prompt_ids, s, max_new_tokens)
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
                               step_by_step, len(problems)))
    bar.close()
    return _report(lm, strategies, per_strategy, base_records, problem_rows, max_new_tokens, step_by_step,
                   len(problems))


def _report(lm: LoadedModel, strategies: list[Strategy], per_strategy: dict[str, list[dict]],
            base_records: list[dict], problem_rows: list[dict], max_new_tokens: int, step_by_step: bool,
            n_requested: int) -> dict:
    has_adapter = lm.adapter is not None
    return {
        "config": {
            "model": lm.source, "adapter": lm.adapter, "mtp_trained": lm.mtp_trained,
            "prompt_format": lm.prompt_format, "device": str(lm.device), "max_new_tokens": max_new_tokens,
            "step_by_step": step_by_step, "n_problems": len(problem_rows),
            "n_requested": n_requested, "complete": len(problem_rows) == n_requested, "strategies": [s.spec for s in strategies],
            "teacher": "base model, adapter off" if has_adapter else "the model itself (no adapter)",
            "warnings": list(lm.warnings),
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
        "nll_sum": nll_sum, "nll_tokens": nll_tokens,
        "nll_teacher": nll_sum / nll_tokens if nll_tokens else None,
        "same_as_standard": res.text == std_text,
        "same_answer_as_standard": extracted == std_answer,
        "same_as_base": res.text == base_text,
    }


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
        summarize(parse_strategy(r["strategy"]), [row["results"][r["strategy"]] for row in report["problems"]])
        for r in report["strategies"]
    ]
    if report.get("base_standard"):
        report["base_standard"] = summarize(standard(), [row["base_standard"] for row in report["problems"]])
    return report


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


def write_figure(report: dict, out_json: Path) -> dict:
    """Write ``<out>.html`` (self-contained) and ``<out>.png`` beside the JSON file.

    PNG export uses kaleido with Chromium (``BROWSER_PATH``, default /usr/bin/chromium when it
    exists). Returns ``{"html": path, "png": path or None, "png_error": message or None}``;
    a failed PNG export is reported there, never raised (the HTML is always written).
    """
    fig = pareto_figure(report)
    html = out_json.with_suffix(".html")
    png = out_json.with_suffix(".png")
    fig.write_html(str(html), include_plotlyjs=True, full_html=True)
    if "BROWSER_PATH" not in os.environ and Path(CHROMIUM).exists():
        os.environ["BROWSER_PATH"] = CHROMIUM
    try:
        fig.write_image(str(png))
        return {"html": str(html), "png": str(png), "png_error": None}
    except Exception as e:  # kaleido without a Chrome, or a broken browser
        msg = (f"PNG export failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
               "kaleido needs Chrome/Chromium: set BROWSER_PATH. The HTML figure was written.")
        return {"html": str(html), "png": None, "png_error": msg}


def format_table(report: dict) -> str:
    """The summary as a plain-text table (one row per strategy)."""
    head = (f"{'strategy':<26} {'acc':>6} {'±se':>6} {'k mean':>7} {'k std':>6} {'tok/s':>7} "
            f"{'NLL(T)':>7} {'=std':>5} {'=base':>6}")
    lines = [head, "-" * len(head)]
    rows = list(report["strategies"])
    if report.get("base_standard"):
        rows = [dict(report["base_standard"], label="base (adapter off)")] + rows
    for r in rows:
        nll = f"{r['nll_teacher']:.3f}" if r["nll_teacher"] is not None else "-"
        lines.append(
            f"{r['label']:<26} {r['accuracy']:>6.3f} {r['accuracy_stderr']:>6.3f} {r['effective_k_mean']:>7.2f} "
            f"{r['effective_k_std']:>6.2f} {r['tokens_per_second']:>7.1f} {nll:>7} "
            f"{r['agreement_with_standard']:>5.2f} {r['agreement_with_base']:>6.2f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help="smollm2-135m, a local dir / .gguf / adapter, or a hub id")
    p.add_argument("--data", default=None, help="GSM8K-format JSONL (question, answer with '#### number')")
    p.add_argument("--rescore", default=None, metavar="REPORT.json",
                   help="re-extract the answers of a saved report with the current extractor (no model run); "
                        "writes --out (default: overwrite REPORT.json) and its figure")
    p.add_argument("--limit", type=int, default=None, help="first N problems (default: all)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated: {SPEC_HELP}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--step-by-step", action="store_true", help=f"append '{STEP_BY_STEP}' to each question")
    p.add_argument("--out", default=OUT_DEFAULT, help="JSON path; the figure goes next to it (.html, .png)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-adapter", action="store_true", help="smollm2-135m without the MTP adapter in assets/")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    if args.rescore:
        try:
            report = rescore(json.loads(Path(args.rescore).read_text()))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot rescore {args.rescore}: {e}", file=sys.stderr)
            return 2
        out = Path(args.rescore) if args.out == OUT_DEFAULT else Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report["figure"] = write_figure(report, out)
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=False))
        print(format_table(report))
        return 0
    out = Path(args.out)
    try:
        if not args.data:
            raise ValueError("--data is required (a GSM8K-format JSONL file), unless --rescore is given.")
        check_max_new_tokens(args.max_new_tokens)
        strategies = parse_strategies(args.strategies)
        problems = load_problems(args.data, args.limit)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be ≥ 1, got {args.threads}.")
        if out.suffix.lower() != ".json":
            raise ValueError(f"--out must name a .json file, got {out}.")
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, adapter=not args.no_adapter)
        strategies = parse_strategies(args.strategies, lm.default_k_max)  # K_MAX omitted: the model's default
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in lm.warnings:
        print(f"note: {note}", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def save(rep: dict) -> None:
        rep["config"].update(data=str(args.data), wall_seconds=time.perf_counter() - t0,
                             torch_threads=torch.get_num_threads())
        tmp = out.with_suffix(".json.partial")
        tmp.write_text(json.dumps(rep, indent=1, ensure_ascii=False, allow_nan=False))
        tmp.replace(out)

    try:
        report = evaluate(lm, problems, strategies, max_new_tokens=args.max_new_tokens,
                          step_by_step=args.step_by_step, progress=not args.no_progress, on_problem=save)
    except (ValueError, NonFiniteLogitsError) as e:  # a too-long problem, a broken model: the partial report stays
        print(f"error: {e} (results so far: {out})", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    report["config"].update(data=str(args.data), wall_seconds=time.perf_counter() - t0,
                            torch_threads=torch.get_num_threads())
    fig_paths = write_figure(report, out)
    report["figure"] = fig_paths
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=False))
    print(format_table(report))
    print(f"wrote {out}, {fig_paths['html']}" + (f", {fig_paths['png']}" if fig_paths["png"] else ""))
    if fig_paths["png_error"]:
        print(f"warning: {fig_paths['png_error']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
