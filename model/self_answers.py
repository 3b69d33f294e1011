"""Self-distilled training text: the base model's own greedy answers to a set of prompts.

    python -m model.self_answers --base smollm2-135m --data openai/gsm8k:main \\
        --out runs/self_answers/gsm8k_train.jsonl --batch-size 32 --max-new-tokens 256 --threads 1

Decoding sees the model's own continuations, not a dataset's reference answers, so an MTP adapter
trained on them learns the text it will have to predict. How the answers are generated and what each
output row holds: :mod:`model.training.self_answers`. The output is appended batch by batch; a rerun
continues where an interrupted one stopped. Bad options or data exit with status 2 and one ``error:``
line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from .engine.loading import DEFAULT_SOURCE
from .errors import CheckpointError, DataError
from .training.data import load_examples
from .training.self_answers import load_generator, write_answers


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.self_answers", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--base", default=DEFAULT_SOURCE, help="smollm2-135m, a local HF model directory, a .gguf file or a hub id")
    a("--data", required=True, help="JSONL with question/prompt rows (answers optional), or a datasets id")
    a("--data-split", default="train", help="split for a datasets id")
    a("--out", required=True, help="output JSONL (appended; a rerun continues)")
    a("--limit", type=int, default=None, help="answer only the first N prompts")
    a("--batch-size", type=int, default=32)
    a("--max-new-tokens", type=int, default=256)
    a("--prompt-format", default=None, help="default: chat if the tokenizer has a template")
    a("--device", default="auto")
    a("--dtype", default="auto", help="auto: bfloat16 where native (CUDA, CPUs with AVX512-BF16/AMX), else float32")
    a("--threads", type=int, default=None, help="torch CPU threads")
    a("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.batch_size < 1 or args.max_new_tokens < 1:
            raise ValueError("--batch-size and --max-new-tokens must be ≥ 1.")
        examples = load_examples(args.data, need_response=False, split=args.data_split, limit=args.limit)
        lm = load_generator(args.base, device=args.device, dtype=args.dtype, prompt_format=args.prompt_format)
        rows = write_answers(lm, examples, args.out, limit=args.limit, batch_size=args.batch_size,
                             max_new_tokens=args.max_new_tokens, show_progress=not args.no_progress)
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_stop = sum(r["stopped"] for r in rows)
    print(f"{len(rows)} answers in {args.out} ({n_stop} ended with EOS, "
          f"{sum(1 for r in rows if not r['response'])} empty)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
