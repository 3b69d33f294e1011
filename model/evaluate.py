"""Command line: GSM8K accuracy against effective k for several decoding strategies (paper 4.5).

    python -m model.evaluate --model smollm2-135m --data gsm8k_test.jsonl --limit 20 \\
        --strategies standard,static:2,static:3,static:4,confadapt:0.95,confadapt:0.9,confadapt:0.8,confadapt:0.7 \\
        --max-new-tokens 192 --out runs/eval/smollm2.json

What each column means: :mod:`model.evaluation.accuracy`. It writes one JSON file (summary +
per-problem records, rewritten after every problem so that a stopped run keeps its results) and a
Plotly Pareto figure (accuracy vs effective k) next to it as ``.html`` and ``.png``. Bad arguments
exit with status 2 and one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .engine.loading import DEFAULT_SOURCE, load_checkpoint, trained_k_max
from .engine.sampling import add_sampling_arguments, sampling_from_args
from .engine.strategies import DEFAULT_K_MAX, SPEC_HELP, check_max_new_tokens, parse_strategies
from .errors import DataError, NonFiniteLogitsError
from .evaluation.accuracy import (DEFAULT_STRATEGIES, evaluate, format_table, merge_reports, read_report, rescore,
                                  write_figure)
from .evaluation.gsm8k import STEP_BY_STEP, load_problems
from .evaluation.sweep import from_report, write_sweep

OUT_DEFAULT = "runs/eval/eval.json"


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help="smollm2-135m, a local dir / .gguf / adapter, or a hub id")
    p.add_argument("--data", default=None, help="GSM8K-format JSONL (question, answer with '#### number')")
    p.add_argument("--rescore", default=None, nargs="+", metavar="REPORT.json",
                   help="re-extract the answers of a saved report with the current extractor (no model run); "
                        "writes --out (default: overwrite REPORT.json) and its figure. Several reports (shards "
                        "of one evaluation, see --offset) are merged into --out")
    p.add_argument("--limit", type=int, default=None, help="first N problems (default: all)")
    p.add_argument("--offset", type=int, default=0,
                   help="skip the first N problems (shards: --offset 0 --limit 100, --offset 100 --limit 100; "
                        "merge them with --rescore A.json B.json --out ALL.json)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated: {SPEC_HELP}")
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_sampling_arguments(p)
    p.add_argument("--step-by-step", action="store_true", help=f"append '{STEP_BY_STEP}' to each question")
    p.add_argument("--out", default=OUT_DEFAULT, help="JSON path; the figure goes next to it (.html, .png)")
    p.add_argument("--sweep", default=None, metavar="SWEEP.json",
                   help="also write the compact speed/quality sweep the app draws (e.g. beside an adapter: "
                        "ADAPTER_DIR/sweep.json)")
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
        names = ", ".join(args.rescore)
        try:
            if len(args.rescore) > 1 and args.out == OUT_DEFAULT:
                raise ValueError("several reports merge into one: name it with --out ALL.json")
            reports = [read_report(f) for f in args.rescore]
            report = rescore(reports[0]) if len(reports) == 1 else merge_reports(reports)
        except DataError as e:  # names its file
            print(f"error: cannot rescore {e}", file=sys.stderr)
            return 2
        except (OSError, ValueError, KeyError) as e:
            print(f"error: cannot rescore {names}: {e}", file=sys.stderr)
            return 2
        out = Path(args.rescore[0]) if args.out == OUT_DEFAULT else Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report["figure"] = write_figure(report, out)
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=False))
        print(format_table(report))
        if args.sweep:  # a stopped run's partial report still gives a sweep over the problems it finished
            print(f"wrote {write_sweep(from_report(report), args.sweep)}")
        return 0
    out = Path(args.out)
    try:
        if not args.data:
            raise ValueError("--data is required (a GSM8K-format JSONL file), unless --rescore is given.")
        check_max_new_tokens(args.max_new_tokens)
        sampling = sampling_from_args(args)
        default_k_max = trained_k_max(args.model, adapter=not args.no_adapter) or DEFAULT_K_MAX
        strategies = parse_strategies(args.strategies, default_k_max)  # K_MAX omitted: the model's own
        problems = load_problems(args.data, args.limit, args.offset)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be ≥ 1, got {args.threads}.")
        if out.suffix.lower() != ".json":
            raise ValueError(f"--out must name a .json file, got {out}.")
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, adapter=not args.no_adapter)
    except ValueError as e:  # CheckpointError and DataError included
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
                          step_by_step=args.step_by_step, progress=not args.no_progress, on_problem=save,
                          sampling=sampling)
    except (ValueError, NonFiniteLogitsError) as e:  # a too-long problem, a broken model: the partial report stays
        print(f"error: {e} (results so far: {out})", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1
    report["config"].update(data=str(args.data), wall_seconds=time.perf_counter() - t0,
                            torch_threads=torch.get_num_threads())
    fig_paths = write_figure(report, out)
    report["figure"] = fig_paths
    if args.sweep:
        print(f"wrote {write_sweep(from_report(report), args.sweep)}")
    out.write_text(json.dumps(report, indent=1, ensure_ascii=False, allow_nan=False))
    print(format_table(report))
    print(f"wrote {out}, {fig_paths['html']}" + (f", {fig_paths['png']}" if fig_paths["png"] else ""))
    if fig_paths["png_error"]:
        print(f"warning: {fig_paths['png_error']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
