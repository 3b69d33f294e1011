"""Command line: the speed/quality trade-off of an MTP checkpoint on any prompts, as the page draws it.

    python -m model.sweep --data runs/magpie/instructions.heldout.jsonl --limit 40 --max-new-tokens 128 \\
        --strategies confadapt:0.5,confadapt:0.7,confadapt:0.9,confadapt:0.99,verify,verify:4:full \\
        --out assets/smollm2-135m-mtp/sweep.json

Each prompt is answered by standard decoding, then by each strategy (greedy): effective k, the share of answers
identical to standard decoding's, and the answers' mean negative log-likelihood per token under the model with
its adapter off (the teacher), with lossless acceptance by draft position (:func:`model.evaluation.sweep.run_sweep`).
``--data`` takes JSONL rows with ``prompt`` or ``question`` (answers, if any, are not read: no accuracy here; for
GSM8K accuracy use ``python -m model.evaluate``). Several ``--data`` files are read in turn (``--limit`` each).
Bad options or data exit with status 2 and one ``error:`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence

import torch

from .engine.loading import DEFAULT_SOURCE, load_checkpoint, trained_k_max
from .engine.strategies import DEFAULT_K_MAX, SPEC_HELP, check_max_new_tokens, parse_strategies
from .errors import CheckpointError, DataError
from .evaluation.sweep import run_sweep, write_sweep
from .training.data import load_examples


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.sweep", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default=DEFAULT_SOURCE, help="smollm2-135m, an adapter or model directory, a .gguf file or a hub id")
    a("--data", required=True, nargs="+", help="JSONL file(s) with prompt (or question) rows")
    a("--limit", type=int, default=None, help="first N prompts of each file")
    a("--strategies", default="confadapt:0.5,confadapt:0.7,confadapt:0.9,confadapt:0.99,verify",
      help=f"comma-separated ({SPEC_HELP}); k_max omitted: the model's own")
    a("--max-new-tokens", type=int, default=128)
    a("--out", default=None, help="write the sweep here (e.g. ADAPTER_DIR/sweep.json, which the app draws)")
    a("--dtype", default="auto")
    a("--device", default="auto")
    a("--threads", type=int, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data)."""
    args = build_parser().parse_args(argv)
    try:
        check_max_new_tokens(args.max_new_tokens)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be ≥ 1, got {args.limit}.")
        strategies = parse_strategies(args.strategies, trained_k_max(args.model) or DEFAULT_K_MAX)
        prompts = [ex.prompt for f in args.data for ex in load_examples(f, need_response=False, limit=args.limit)]
        if args.threads:
            torch.set_num_threads(args.threads)
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype)
    except (ValueError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    sweep = run_sweep(lm, prompts, strategies, max_new_tokens=args.max_new_tokens)
    each = f" (first {args.limit} each)" if args.limit else ""
    sweep = dataclasses.replace(sweep, data=" + ".join(args.data) + each)  # the prompts' files, for the record
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {lm.dtype_name}, {time.perf_counter() - t0:.0f} s")
    print(f"{'strategy':<24} {'eff. k':>7} {'identical':>10} {'NLL':>7}  acceptance by draft position")
    for p in sweep.points:
        acc = " / ".join(f"{a:.2f}" for a in p.acceptance_by_position or () if a is not None)
        nll = "-" if p.nll_teacher is None else f"{p.nll_teacher:.3f}"
        print(f"{p.spec:<24} {p.effective_k:>7.2f} {100 * (p.agreement_with_standard or 0):>9.0f}% {nll:>7}  {acc}")
    if args.out:
        print(f"wrote {write_sweep(sweep, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
