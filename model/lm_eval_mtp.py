"""Command line: lm-eval-harness with our MTP decoding registered as model ``mtp`` (paper 3.4 / 4.5).

    python -m model.lm_eval_mtp --model mtp \\
        --model_args pretrained=smollm2-135m,tau=0.9,k_max=4 \\
        --tasks gsm8k_mini --include_path tests/data --limit 8 --output_path runs/lm_eval

The arguments are lm-eval's own, passed on unchanged; importing :mod:`model.evaluation.lm_eval_model`
registers ``mtp`` (its model arguments are documented there).
"""

from __future__ import annotations

import sys

from .evaluation.lm_eval_model import INSTANCES, MODEL_ARGS_HELP

#: What ``--help`` prints before lm-eval's own usage: the model this wrapper registers and its arguments.
HELP = """python -m model.lm_eval_mtp: lm-eval-harness's command line with our MTP decoding registered as --model mtp.

  python -m model.lm_eval_mtp --model mtp --model_args pretrained=smollm2-135m,tau=0.9,k_max=4 \\
      --tasks gsm8k --limit 8 --output_path runs/lm_eval

mtp's --model_args (comma-separated key=value):
""" + MODEL_ARGS_HELP + """Effective k is printed on stderr at the end. Log-likelihood tasks score with the base model (one token per pass).

lm-eval's own arguments follow.
"""


def main(argv: list[str] | None = None) -> int:
    """``python -m model.lm_eval_mtp ARGS``: lm-eval's CLI (``ARGS`` unchanged) with ``mtp`` registered.

    Returns the exit status: 0 ok, 2 for bad model arguments or tasks (one ``error:`` line on
    stderr), else lm-eval's own. Prints each ``mtp`` model's decoding totals (effective k) on stderr.
    """
    from lm_eval.__main__ import cli_evaluate

    args = list(argv) if argv is not None else sys.argv[1:]
    if "-h" in args or "--help" in args:  # lm-eval's usage follows; first what this wrapper adds
        print(HELP)
    caller_argv = sys.argv  # lm-eval's CLI reads sys.argv; the caller's is put back after the run
    sys.argv = ["lm-eval"] + args
    first = len(INSTANCES)  # the models this run makes (a caller in the same process may have made others)
    try:
        try:
            cli_evaluate()
        except SystemExit as e:
            if e.code not in (0, None):
                return int(e.code) if isinstance(e.code, int) else 2
        except (ValueError, KeyError) as e:  # bad --model_args (CheckpointError is a ValueError), unknown task
            print(f"error: {e}", file=sys.stderr)
            return 2
        for inst in INSTANCES[first:]:
            s = inst.stats
            print(f"mtp {s['strategy']}: {s['requests']} requests, {s['new_tokens']} tokens in "
                  f"{s['forward_passes']} forward passes, effective k {s['effective_k']:.3f}, "
                  f"{s['tokens_per_second']:.1f} tokens/s", file=sys.stderr)
        return 0
    finally:
        sys.argv = caller_argv
        del INSTANCES[first:]  # their models are not kept alive after the run

if __name__ == "__main__":
    sys.exit(main())
