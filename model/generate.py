"""Command line: one generation with a chosen decoding strategy (paper 3.4 / 4.5).

    python -m model.generate --model smollm2-135m --prompt "..." --strategy confadapt \\
        --threshold 0.9 --k-max 16 --max-new-tokens 128 [--json]

Without ``--json`` the answer streams to stdout, blocks separated by ``|`` when ``--show-blocks``
is given, followed by a summary line on stderr (with the dtype and the forward path that ran). With
``--json`` it prints one JSON object: ``text``, ``new_tokens``, ``forward_passes``, ``effective_k``,
``seconds``, ``passes``, ``dtype``, ``forward_path``.
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint import DEFAULT_SOURCE, CheckpointError, load_checkpoint
from .decoding import Decoder, NonFiniteLogitsError
from .strategies import (
    DEFAULT_K_MAX,
    DEFAULT_STATIC_K,
    DEFAULT_TAU,
    SPEC_HELP,
    STRATEGY_NAMES,
    Strategy,
    check_max_new_tokens,
    make_strategy,
    parse_strategy,
)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help="smollm2-135m, a local dir / .gguf, or a hub id")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--strategy", default="confadapt",
                   help=f"{', '.join(STRATEGY_NAMES)} (with --threshold / --k-max / --k), or a spec: {SPEC_HELP}")
    p.add_argument("--threshold", "--tau", dest="tau", type=float, default=DEFAULT_TAU, help="ConfAdapt threshold tau")
    p.add_argument("--k-max", type=int, default=None,
                   help="proposals per forward pass (default: the adapter's trained k_max, else 16)")
    p.add_argument("--k", type=int, default=DEFAULT_STATIC_K, help="block size for --strategy static")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 where the device computes it natively, else float32), float32, bfloat16, ...")
    p.add_argument("--quantization", choices=["none", "4bit", "8bit"], default="none")
    p.add_argument("--no-adapter", action="store_true", help="smollm2-135m without the MTP adapter in assets/")
    p.add_argument("--show-blocks", action="store_true", help="separate accepted blocks with |")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def cli_strategy(args: argparse.Namespace, default_k_max: int | None) -> Strategy:
    """The strategy of ``--strategy``: a name with the --threshold / --k-max / --k options, or a spec such
    as ``confadapt:0.9`` whose missing k_max is ``--k-max``, else ``default_k_max``.

    Raises:
        ValueError: an unknown name, a malformed spec or an out-of-range option.
    """
    name = args.strategy.strip().lower()
    if ":" in name:
        return parse_strategy(name, args.k_max if args.k_max is not None else (default_k_max or DEFAULT_K_MAX))
    if name not in STRATEGY_NAMES:
        raise ValueError(f"Unknown strategy {args.strategy!r}: use {', '.join(STRATEGY_NAMES)} or a spec "
                         f"({SPEC_HELP}).")
    k_max = args.k_max if args.k_max is not None else (None if name == "static" else default_k_max)
    return make_strategy(name, tau=args.tau, k_max=k_max, k=args.k)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        cli_strategy(args, None)  # bad arguments fail before loading
        check_max_new_tokens(args.max_new_tokens)
        if not args.prompt.strip():
            raise ValueError("The prompt is empty: pass --prompt with some text.")
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                             adapter=not args.no_adapter)
        strategy = cli_strategy(args, lm.default_k_max)
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
        obj = res.to_dict()
        obj["dtype"], obj["forward_path"] = lm.dtype_name, lm.forward_path
        print(json.dumps(obj, ensure_ascii=False, allow_nan=False))
    else:
        print()
        print(f"[{strategy.label}] {res.new_tokens} tokens in {res.forward_passes} forward passes, "
              f"effective k {res.effective_k:.2f}, {res.seconds:.2f} s, {res.tokens_per_second:.1f} tokens/s "
              f"({lm.dtype_name}; {lm.forward_path})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
