"""Command line: one generation with a chosen decoding strategy (paper 3.4 / 4.5).

    python -m model.generate --model smollm2-135m --prompt "..." --strategy confadapt \\
        --threshold 0.9 --k-max 16 --max-new-tokens 128 [--json]

Without ``--json`` the answer streams to stdout, blocks separated by ``|`` when ``--show-blocks``
is given, followed by a summary line on stderr. With ``--json`` it prints one JSON object:
``text``, ``new_tokens``, ``forward_passes``, ``effective_k``, ``seconds``, ``passes``.
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import DEFAULT_SOURCE, CheckpointError, load_checkpoint
from .decoding import Decoder, NonFiniteLogitsError
from .strategies import DEFAULT_STATIC_K, DEFAULT_TAU, STRATEGY_NAMES, check_max_new_tokens, make_strategy


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help="smollm2-135m, a local dir / .gguf, or a hub id")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--strategy", default="confadapt", choices=STRATEGY_NAMES)
    p.add_argument("--threshold", "--tau", dest="tau", type=float, default=DEFAULT_TAU, help="ConfAdapt threshold tau")
    p.add_argument("--k-max", type=int, default=None,
                   help="proposals per forward pass (default: the adapter's trained k_max, else 16)")
    p.add_argument("--k", type=int, default=DEFAULT_STATIC_K, help="block size for --strategy static")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", choices=["none", "4bit", "8bit"], default="none")
    p.add_argument("--no-adapter", action="store_true", help="smollm2-135m without the MTP adapter in assets/")
    p.add_argument("--show-blocks", action="store_true", help="separate accepted blocks with |")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        make_strategy(args.strategy, tau=args.tau, k_max=args.k_max, k=args.k)  # bad arguments fail before loading
        check_max_new_tokens(args.max_new_tokens)
        if not args.prompt.strip():
            raise ValueError("The prompt is empty: pass --prompt with some text.")
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                             adapter=not args.no_adapter)
        k_max = args.k_max if args.k_max is not None else (None if args.strategy == "static" else lm.default_k_max)
        strategy = make_strategy(args.strategy, tau=args.tau, k_max=k_max, k=args.k)
        dec = Decoder(lm, lm.prompt_ids(args.prompt), strategy, args.max_new_tokens)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in lm.warnings:
        print(f"note: {note}", file=sys.stderr)
    try:
        for rec in dec:
            if not args.json:
                sys.stdout.write(rec.text + ("|" if args.show_blocks and rec.text else ""))
                sys.stdout.flush()
    except NonFiniteLogitsError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    res = dec.result()
    if args.json:
        print(json.dumps(res.to_dict(), ensure_ascii=False, allow_nan=False))
    else:
        print()
        print(f"[{strategy.label}] {res.new_tokens} tokens in {res.forward_passes} forward passes, "
              f"effective k {res.effective_k:.2f}, {res.seconds:.2f} s, {res.tokens_per_second:.1f} tokens/s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
