"""Command line: train an MTP model by online self-distillation (paper 3.3, 4.1-4.4).

    python -m model.self_answers --data openai/gsm8k:main --out runs/self_answers/gsm8k.jsonl   # optional
    python -m model.train --base smollm2-135m --data runs/self_answers/gsm8k.jsonl \\
        --output runs/mtp --adapter alora --max-steps 1000 --batch-size 8 --lora-rank 16
    accelerate launch --multi_gpu --num_processes 2 -m model.train ...   # DDP (gloo on a CPU-only machine)

Every flag is a field of :class:`model.training.config.TrainConfig` (``--help`` lists them with their
defaults); the run itself is :func:`model.training.trainer.train`. Bad options or data exit with
status 2 and one ``error:`` line, a non-finite loss with status 1 (the last checkpoint resumes).
"""

from __future__ import annotations

import sys
from typing import Sequence

from .errors import CheckpointError, DataError, NonFiniteLossError
from .training.config import config_from_args
from .training.trainer import train


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data, 1 for a non-finite loss)."""
    cfg = config_from_args(argv, description=__doc__.split("\n\n")[0])
    try:
        train(cfg)
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
