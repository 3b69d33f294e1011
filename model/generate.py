"""Command line: one generation with a chosen decoding strategy (paper 3.4 / 4.5).

    python -m model.generate --model smollm2-135m --prompt "..." --strategy confadapt \\
        --tau 0.9 --k-max 4 --max-new-tokens 128 [--json]
    python -m model.generate --prompt "..." --strategy verify --temperature 0.7 --top-p 0.95 --seed 1 \\
        --num-samples 4 --json

Without ``--json`` the answer streams to stdout, blocks separated by ``|`` when ``--show-blocks``
is given, followed by a summary line on stderr (with the dtype and the forward path that ran). With
``--json`` it prints one JSON object: ``text``, ``new_tokens``, ``forward_passes``, ``effective_k``,
``seconds``, ``passes``, ``sampling`` (the settings and the seed used), ``ids``, ``dtype``, ``forward_path``.
Greedy by default; ``--temperature`` > 0 samples (every strategy; lossless verify keeps standard sampling's
distribution). ``--num-samples N`` draws N answers to the same prompt in one process (seed, seed + 1, ...):
streamed one after another, or with ``--json`` a list of those objects.
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import sys

from .engine.decoding import Decoder
from .engine.loading import DEFAULT_SOURCE, load_checkpoint, trained_k_max
from .engine.sampling import add_sampling_arguments, for_request, sampling_from_args
from .engine.strategies import (
    DEFAULT_K_MAX,
    DEFAULT_STATIC_K,
    DEFAULT_TAU,
    SPEC_HELP,
    STRATEGY_NAMES,
    Strategy,
    check_max_new_tokens,
    resolve_strategy,
)
from .errors import NonFiniteLogitsError


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE, help="smollm2-135m, a local dir / .gguf, or a hub id")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--strategy", default="confadapt",
                   help=f"{', '.join(STRATEGY_NAMES)} (with --tau / --k-max / --k), or a spec: {SPEC_HELP}")
    p.add_argument("--tau", type=float, default=None, help=f"ConfAdapt's threshold tau (default {DEFAULT_TAU})")
    p.add_argument("--threshold", dest="tau", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--k-max", type=int, default=None,
                   help=f"proposals per forward pass (default: the adapter's trained k_max, else {DEFAULT_K_MAX})")
    p.add_argument("--k", type=int, default=None, help=f"block size for --strategy static (default {DEFAULT_STATIC_K})")
    p.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    add_sampling_arguments(p)
    p.add_argument("--num-samples", type=int, default=1, help="answers to draw for the prompt (with --temperature > 0)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 where the device computes it natively, else float32), float32, bfloat16, ...")
    p.add_argument("--quantization", choices=["none", "4bit", "8bit"], default="none")
    p.add_argument("--no-adapter", action="store_true", help="smollm2-135m without the MTP adapter in assets/")
    p.add_argument("--show-blocks", action="store_true", help="separate accepted blocks with |")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def check_unused_settings(args: argparse.Namespace, strategy: Strategy) -> None:
    """Refuse a setting the chosen strategy does not use (it would be ignored without a word): ``--k`` is static
    k's block size, ``--tau`` ConfAdapt's threshold, ``--k-max`` means nothing to standard decoding.

    Raises:
        ValueError: naming the setting, the strategy and what the setting is for."""
    checks = (("--k", args.k, strategy.name != "static", "static k's block size"),
              ("--tau", args.tau, strategy.name != "confadapt", "ConfAdapt's threshold"),
              ("--k-max", args.k_max, strategy.name == "standard", "proposals per forward pass"))
    for flag, value, unused, what in checks:
        if value is not None and unused:
            raise ValueError(f"{flag} does nothing with --strategy {args.strategy} (it is {what}); leave it out.")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 non-finite logits, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        strategy = resolve_strategy(args.strategy, tau=args.tau, k_max=args.k_max, k=args.k,
                                    default_k_max=trained_k_max(args.model, adapter=not args.no_adapter) or DEFAULT_K_MAX)
        check_unused_settings(args, strategy)
        check_max_new_tokens(args.max_new_tokens)
        sampling = sampling_from_args(args)
        if not 1 <= args.num_samples <= 10_000:
            raise ValueError(f"--num-samples must be from 1 to 10000, got {args.num_samples}.")
        if args.num_samples > 1 and sampling.greedy:
            raise ValueError("--num-samples > 1 draws several answers: set --temperature above 0 (greedy decoding "
                             "gives the same answer every time).")
        if not args.prompt.strip():
            raise ValueError("The prompt is empty: pass --prompt with some text.")
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                             adapter=not args.no_adapter)
        prompt = lm.prompt_ids(args.prompt)
        Decoder(lm, prompt, strategy, args.max_new_tokens)  # the context budget, checked before any pass
    except ValueError as e:  # CheckpointError, ContextBudgetError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in lm.warnings:
        print(f"note: {note}", file=sys.stderr)
    results = []
    for i in range(args.num_samples):
        dec = Decoder(lm, prompt, strategy, args.max_new_tokens, for_request(sampling, i))
        if args.num_samples > 1 and not args.json:
            print(f"--- sample {i + 1} of {args.num_samples} (seed {dec.sampler.seed}) ---", file=sys.stderr)
        try:
            for rec in dec:
                if not args.json:
                    sys.stdout.write(rec.text + ("|" if args.show_blocks and rec.text else ""))
                    sys.stdout.flush()
        except NonFiniteLogitsError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            return 1
        res = dec.result()
        results.append(res)
        path = lm.forward_path if lm.dtype_name in lm.forward_path else f"{lm.dtype_name}; {lm.forward_path}"
        if not args.json:
            print()
            print(f"[{strategy.label}, {sampling.label}] {res.new_tokens} tokens in {res.forward_passes} forward "
                  f"passes, effective k {res.effective_k:.2f}, {res.seconds:.2f} s, {res.tokens_per_second:.1f} "
                  f"tokens/s ({path})", file=sys.stderr)
    if args.json:
        objs = []
        for res in results:
            obj = res.to_dict()
            obj["ids"], obj["dtype"], obj["forward_path"] = res.token_ids, lm.dtype_name, lm.forward_path
            objs.append(obj)
        print(json.dumps(objs if args.num_samples > 1 else objs[0], ensure_ascii=False, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
