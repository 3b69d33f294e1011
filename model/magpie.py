"""General instructions written by the model itself (Magpie), and the training mix.

    python -m model.magpie instructions --out runs/magpie/instructions.jsonl --count 4000 --threads 1
    python -m model.self_answers --data runs/magpie/instructions.jsonl --out runs/magpie/answers.jsonl
    python -m model.magpie mix --out runs/v5/train.jsonl runs/magpie/answers.jsonl=3 runs/gsm8k_answers.jsonl=1

``instructions`` samples user turns from the bare chat-template prefix, filters and deduplicates them and
keeps a held-out split beside the output (``NAME.heldout.jsonl``, never trained on); it is resumable.
``mix`` drops degenerate answers and mixes answer files by share (``PATH=SHARE``) into one shuffled file.
What each step does and why: :mod:`model.training.magpie`. Bad options or data exit with status 2 and
one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import torch

from .engine.loading import DEFAULT_SOURCE
from .errors import CheckpointError, DataError
from .training.magpie import heldout_path, mix, write_instructions
from .training.self_answers import load_generator


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (subcommands ``instructions`` and ``mix``)."""
    p = argparse.ArgumentParser(prog="python -m model.magpie", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("instructions", help="sample, filter and deduplicate instructions (resumable)")
    a = i.add_argument
    a("--base", default=DEFAULT_SOURCE, help="smollm2-135m, a local HF model directory, a .gguf file or a hub id")
    a("--out", required=True, help="training instructions JSONL (appended); the held-out split goes beside it")
    a("--count", type=int, required=True, help="instructions to keep, training and held-out together")
    a("--heldout-share", type=float, default=0.05, help="share of instructions held out (by a hash of the text)")
    a("--batch-size", type=int, default=64)
    a("--max-new-tokens", type=int, default=96, help="longest user turn; one cut there is dropped")
    a("--temperature", type=float, default=1.0)
    a("--top-p", type=float, default=0.95)
    a("--seed", type=int, default=0)
    a("--dedup-threshold", type=float, default=0.7, help="word 3-gram Jaccard similarity counted as a duplicate")
    a("--device", default="auto")
    a("--dtype", default="auto", help="auto: bfloat16 where native, else float32")
    a("--threads", type=int, default=None, help="torch CPU threads")
    a("--no-progress", action="store_true")
    m = sub.add_parser("mix", help="drop degenerate answers and mix answer files by share")
    m.add_argument("sources", nargs="+", metavar="PATH=SHARE", help="model.self_answers output and its share")
    m.add_argument("--out", required=True)
    m.add_argument("--total", type=int, default=None, help="rows in the output (default: as many as the shares "
                   "allow without repeating a row)")
    m.add_argument("--seed", type=int, default=0)
    return p


def _sources(specs: Sequence[str]) -> list[tuple[str, float]]:
    out = []
    for spec in specs:
        path, eq, share = spec.rpartition("=")
        try:
            out.append((path, float(share)) if eq else (spec, 1.0))
        except ValueError:
            raise ValueError(f"{spec!r}: write PATH=SHARE with a number, e.g. answers.jsonl=3.") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mix":
            report = mix(_sources(args.sources), args.out, total=args.total, seed=args.seed)
            print(json.dumps(report, indent=1))
            return 0
        if args.threads:
            torch.set_num_threads(args.threads)
        if not 0 <= args.heldout_share < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError("--heldout-share must be in [0, 1), --batch-size and --max-new-tokens ≥ 1.")
        lm = load_generator(args.base, device=args.device, dtype=args.dtype)
        stats = write_instructions(lm, args.out, args.count, heldout_share=args.heldout_share,
                                   batch_size=args.batch_size, seed=args.seed, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p,
                                   dedup_threshold=args.dedup_threshold, show_progress=not args.no_progress)
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{stats['kept']} instructions ({stats['heldout']} held out in {heldout_path(args.out)}); this run: "
          + json.dumps({k: v for k, v in stats.items() if k not in ("kept", "heldout")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
