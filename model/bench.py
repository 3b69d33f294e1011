"""Command line: decoding speed against HF ``generate``, and the cost of a forward pass by width.

    python -m model.bench --threads 1            # the embedded default, 3 GSM8K test prompts x 64 new tokens
    python -m model.bench --strategies standard,confadapt:0.9:4,verify:4 --data test.jsonl --prompts 5
    python -m model.bench --path library         # the same with the fast path off (transformers + peft)
    python -m model.bench --concurrency 1,2,4,8,16 --strategies standard,confadapt:0.9:4,verify:4:full \
        --arrivals together,staggered --json runs/concurrency.json
                                                 # N requests in shared passes (our CPU kernels), arriving
                                                 # together, then one more after each shared pass

What is measured and how: :mod:`model.evaluation.speed`. ``--data`` takes any GSM8K-format JSONL.
``--temperature T`` (with ``--top-p``, ``--top-k``, ``--seed``: 0 unless given) measures every method sampling
(HF ``generate`` with its own sampling); the report then gives each strategy's drafts accepted by position.
Bad arguments exit with status 2 and one ``error:`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from .engine.loading import DEFAULT_SOURCE, load_checkpoint, trained_k_max
from .engine.sampling import add_sampling_arguments, sampling_from_args
from .engine.strategies import DEFAULT_K_MAX, check_max_new_tokens, parse_strategies
from .evaluation.gsm8k import make_prompt
from .evaluation.speed import DEFAULT_DATA, DEFAULT_STRATEGIES, DEFAULT_WIDTHS, bench, format_table
from .training.data import load_examples


def _widths(text: str, flag: str = "--widths") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}.") from None


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help=f"checkpoint: a path, hub id or {DEFAULT_SOURCE} (default)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated strategy specs, e.g. standard,confadapt:0.9:4,verify:auto "
                        f"(default: {DEFAULT_STRATEGIES}); at least one: for the width curve alone, "
                        f"--strategies standard --prompts 1 --repeats 1 --max-new-tokens 8 keeps decoding short")
    p.add_argument("--prompts", type=int, default=3, help="number of prompts (the first of --data; default: 3)")
    p.add_argument("--data", default=None,
                   help="JSONL with question (GSM8K) or prompt rows, e.g. assets/general_prompts_heldout.jsonl "
                        "(default: assets/gsm8k_test_sample.jsonl)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and strategy (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer (default: 64)")
    add_sampling_arguments(p)
    p.add_argument("--widths", default=",".join(map(str, DEFAULT_WIDTHS)),
                   help=f"tokens per pass for the width curve ('' to skip it; default: "
                        f"{','.join(map(str, DEFAULT_WIDTHS))})")
    p.add_argument("--width-repeats", type=int, default=15, help="passes timed per width (default: 15)")
    p.add_argument("--width-context", type=int, default=0,
                   help="cache at least this many tokens before the width curve's passes (its prompt repeated; "
                        "e.g. 1000; default: the prompt once, ~69 tokens; at most the model's positions less the "
                        "widest pass and one repetition): shows what attention over a long conversation adds to a "
                        "wide pass. Not used with --concurrency")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the 1 GiB bandwidth measurement")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip the llama.cpp baseline (run only when llama-cpp-python is installed)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float32, float16 or float64")
    p.add_argument("--path", choices=["auto", "library"], default="auto",
                   help="auto (default): the fast path where supported; library: transformers + peft only")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-adapter", action="store_true", help="time the base model without its MTP adapter")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated request counts: serve N requests at once in shared forward passes "
                        "(model.engine.batch) instead of the single-request benchmark")
    p.add_argument("--arrivals", default="together",
                   help="with --concurrency, comma-separated arrival modes: 'together' (all N requests there "
                        "before the first shared pass) and/or 'staggered' (request i arrives after i shared "
                        "passes, its prefill joining pass i beside the others' decoding rows); default: together")
    p.add_argument("--concurrency-repeats", default="auto",
                   help="with --concurrency, rounds per level and arrival mode, strategies interleaved, median "
                        "reported; 'auto' (default): ceil(largest level / N) rounds at level N")
    p.add_argument("--max-rows", type=int, default=256,
                   help="with --concurrency, most rows in one shared pass (wider passes wait for the next; "
                        "default: 256)")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        check_max_new_tokens(args.max_new_tokens)
        sampling = sampling_from_args(args)
        if not sampling.greedy and sampling.seed is None:  # a measurement is repeatable: seed 0 unless told
            sampling = dataclasses.replace(sampling, seed=0)
        default_k_max = trained_k_max(args.model, adapter=not args.no_adapter) or DEFAULT_K_MAX
        strategies = parse_strategies(args.strategies, default_k_max)
        widths = _widths(args.widths)
        if any(not 1 <= w <= 64 for w in widths):
            raise ValueError(f"--widths must be from 1 to 64, got {args.widths!r}.")
        for name in ("prompts", "repeats", "width_repeats", "threads", "max_rows"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}.")
        if args.width_context < 0:
            raise ValueError(f"--width-context must be ≥ 0, got {args.width_context}.")
        levels = _widths(args.concurrency, "--concurrency") if args.concurrency else None
        if levels is not None and (not levels or any(n < 1 for n in levels)):
            raise ValueError(f"--concurrency must be positive integers, got {args.concurrency!r}.")
        rounds = args.concurrency_repeats
        if rounds != "auto":
            if not rounds.isdigit() or int(rounds) < 1:
                raise ValueError(f"--concurrency-repeats must be 'auto' or an integer >= 1, got {rounds!r}.")
            rounds = int(rounds)
        arrivals = [a.strip() for a in args.arrivals.split(",") if a.strip()]
        if not arrivals or any(a not in ("together", "staggered") for a in arrivals):
            raise ValueError(f"--arrivals must be together and/or staggered, got {args.arrivals!r}.")
        data = args.data or str(DEFAULT_DATA)
        if args.prompts < 1:
            raise ValueError(f"--prompts must be ≥ 1, got {args.prompts}.")
        prompts = [make_prompt(ex.prompt) for ex in load_examples(data, need_response=False, limit=args.prompts)]
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, adapter=not args.no_adapter)
    except ValueError as e:  # CheckpointError and DataError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.path == "library":
        lm = dataclasses.replace(lm, fast=False)
    for note in lm.warnings:
        print(f"note: {note}", file=sys.stderr)
    if levels is not None:
        from .evaluation.concurrency import (concurrency_bench, concurrency_report, dumps_strict,
                                             format_concurrency, format_ratios)

        try:
            rows = concurrency_bench(lm, prompts, strategies, levels, max_new_tokens=args.max_new_tokens,
                                     max_rows=args.max_rows, arrivals=arrivals, repeats=rounds, sampling=sampling)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(format_concurrency(rows))
        print()
        print(format_ratios(rows))
        print()
        print(format_ratios(rows, cpu=True))
        print(f"{lm.forward_path}; {torch.get_num_threads()} torch threads")
        if args.json:
            report = concurrency_report(
                rows, model=args.model, adapter=not args.no_adapter, dtype=str(lm.dtype).removeprefix("torch."),
                forward_path=lm.forward_path, threads=torch.get_num_threads(), prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, max_rows=args.max_rows, levels=list(levels),
                arrivals=arrivals, repeats=rounds, strategies=[s.spec for s in strategies], sampling=sampling.to_dict())
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(dumps_strict(report))
        return 0
    try:
        report = bench(lm, prompts, strategies, repeats=args.repeats, max_new_tokens=args.max_new_tokens,
                       widths=widths, width_repeats=args.width_repeats, width_context=args.width_context,
                       measure_bandwidth=not args.no_bandwidth, llama_cpp=not args.no_llama_cpp, sampling=sampling)
    except ValueError as e:  # a width context longer than the model's positions
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
