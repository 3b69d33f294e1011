"""Wall-clock benchmark: HF ``generate`` greedy vs our standard loop, static k and ConfAdapt.

    python -m model.bench --model smollm2-135m --prompts 2 --repeats 3 --max-new-tokens 32 \\
        --strategies standard,static:2,static:3,confadapt:0.9

All methods run in one process on the same prompts. Each repeat runs every prompt with every
method, the order of methods rotating from one repeat to the next (so no method always runs
first or last); each generation is timed on its own, wall-clock, device synchronised, Python
overhead included. A method's speed in one repeat is its generated tokens over its seconds
summed over the prompts; the table shows the median over repeats and its ratio to HF
``generate`` (the paper reports wall-clock speed-ups the same way, section 4.5). One untimed
warm-up generation per method comes first.

On CUDA it also prints the bytes of weights read per second (forward passes per second times the
model's weight bytes: a batch-1 forward pass reads every weight once) against the device's memory
bandwidth, measured with a large device-to-device copy. Bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from .decoding import hf_generate, run
from .evaluate import load_problems, make_prompt
from .strategies import SPEC_HELP, check_max_new_tokens, parse_strategies

HF = "hf_generate"
DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
FALLBACK_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a short paragraph about why the sky is blue.",
    "List three uses of a paper clip.",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters, each shared tensor (tied embeddings) counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Measured device memory bandwidth in bytes/s: (read + write) bytes of a large copy / seconds (median)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def run_one(lm: LoadedModel, method: str, strategy: Any, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One timed generation. Returns ``{"tokens", "forward_passes", "seconds", "token_ids"}``.

    ``seconds`` is wall-clock for the whole generation (device synchronised before and after).
    For HF ``generate`` the number of forward passes equals the number of new tokens.
    """
    dev = lm.device
    _sync(dev)
    t0 = time.perf_counter()
    if method == HF:
        ids = hf_generate(lm, prompt_ids, max_new_tokens)
        passes = len(ids)
    else:
        res = run(lm, prompt_ids, strategy, max_new_tokens)
        ids, passes = res.token_ids, res.forward_passes
    _sync(dev)
    return {"tokens": len(ids), "forward_passes": passes, "seconds": time.perf_counter() - t0, "token_ids": ids}


def bench(
    lm: LoadedModel,
    prompts: Sequence[str],
    strategy_specs: str | Sequence[str] = "standard,static:2,static:3,confadapt:0.9",
    *,
    repeats: int = 3,
    max_new_tokens: int = 32,
    warmup: bool = True,
) -> dict:
    """Time HF ``generate`` and each strategy on the same prompts, alternating (see module docstring).

    Args:
        lm: the model.
        prompts: user messages (formatted with the model's prompt format).
        strategy_specs: our strategies (``standard``, ``static:K``, ``confadapt:TAU[:K_MAX]``).
        repeats: timed rounds; the median over them is reported.
        max_new_tokens: per generation.
        warmup: one untimed generation per method first.

    Returns:
        ``{"config", "methods": [{"method", "tokens_per_second" (median), "runs" (per-repeat
        tokens/s), "ratio_to_hf", "effective_k", "forward_passes_per_second", "tokens",
        "weight_bytes_per_second" (CUDA only)}], "standard_matches_hf", "memory_bandwidth"}``.

    Raises:
        ValueError: no prompts, repeats < 1, bad max_new_tokens or strategy.
    """
    check_max_new_tokens(max_new_tokens)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer ≥ 1, got {repeats!r}.")
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    strategies = parse_strategies(strategy_specs, lm.default_k_max)
    methods: list[tuple[str, Any]] = [(HF, None)] + [(s.spec, s) for s in strategies]
    prompt_ids = [lm.prompt_ids(p) for p in prompts]
    if warmup:
        for name, s in methods:
            run_one(lm, name, s, prompt_ids[0], min(max_new_tokens, 8))
    per: dict[str, list[dict]] = {name: [] for name, _ in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name, _ in methods}
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        totals = {name: {"tokens": 0, "forward_passes": 0, "seconds": 0.0} for name, _ in methods}
        for i, ids in enumerate(prompt_ids):
            for name, s in order:
                res = run_one(lm, name, s, ids, max_new_tokens)
                for key in ("tokens", "forward_passes", "seconds"):
                    totals[name][key] += res[key]
                if r == 0:
                    outputs[name].append(res["token_ids"])
        for name, _ in methods:
            per[name].append(totals[name])

    wbytes = weight_bytes(lm.model)
    on_cuda = lm.device.type == "cuda"
    bandwidth = copy_bandwidth(lm.device) if on_cuda else None
    rows = []
    for name, s in methods:
        runs = per[name]
        tps = [t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0 for t in runs]
        pps = [t["forward_passes"] / t["seconds"] if t["seconds"] > 0 else 0.0 for t in runs]
        row = {
            "method": name, "label": "HF generate (greedy)" if s is None else s.label,
            "tokens_per_second": statistics.median(tps), "runs": tps,
            "forward_passes_per_second": statistics.median(pps),
            "tokens": runs[0]["tokens"], "forward_passes": runs[0]["forward_passes"],
            "effective_k": runs[0]["tokens"] / runs[0]["forward_passes"] if runs[0]["forward_passes"] else 0.0,
        }
        if on_cuda:
            row["weight_bytes_per_second"] = row["forward_passes_per_second"] * wbytes
            row["fraction_of_bandwidth"] = row["weight_bytes_per_second"] / bandwidth if bandwidth else None
        rows.append(row)
    hf_tps = rows[0]["tokens_per_second"]
    for row in rows:
        row["ratio_to_hf"] = row["tokens_per_second"] / hf_tps if hf_tps > 0 else None
    std_match = (outputs["standard"] == outputs[HF]) if "standard" in outputs else None
    return {
        "config": {"model": lm.source, "device": str(lm.device), "dtype": str(next(lm.model.parameters()).dtype),
                   "prompts": len(prompts), "repeats": repeats, "max_new_tokens": max_new_tokens,
                   "torch_threads": torch.get_num_threads(), "weight_bytes": wbytes,
                   "mtp_trained": lm.mtp_trained, "adapter": lm.adapter},
        "methods": rows,
        "standard_matches_hf": std_match,
        "memory_bandwidth": bandwidth,
    }


def format_table(report: dict) -> str:
    """The report as a plain-text table (one row per method)."""
    cuda = report["memory_bandwidth"] is not None
    head = f"{'method':<28} {'tokens/s':>9} {'x HF':>6} {'eff. k':>7} {'passes/s':>9} {'new tokens':>10}"
    if cuda:
        head += f" {'weights GB/s':>13} {'of bandwidth':>13}"
    lines = [head, "-" * len(head)]
    for r in report["methods"]:
        line = (f"{r['label']:<28} {r['tokens_per_second']:>9.1f} {r['ratio_to_hf']:>6.2f} "
                f"{r['effective_k']:>7.2f} {r['forward_passes_per_second']:>9.1f} {r['tokens']:>10d}")
        if cuda:
            line += f" {r['weight_bytes_per_second'] / 1e9:>13.1f} {r['fraction_of_bandwidth']:>13.1%}"
        lines.append(line)
    c = report["config"]
    lines.append(f"median of {c['repeats']} repeats x {c['prompts']} prompts x {c['max_new_tokens']} new tokens; "
                 f"{c['device']} {c['dtype']}, {c['torch_threads']} torch threads; weights {c['weight_bytes'] / 1e6:.0f} MB")
    if cuda:
        lines.append(f"device memory bandwidth (measured copy): {report['memory_bandwidth'] / 1e9:.0f} GB/s")
    lines.append("new tokens: generated in one repeat over all prompts; a method that hits a stop token early "
                 "spends a larger share of its time on the prefill")
    if report["standard_matches_hf"] is not None:
        lines.append(f"standard loop output == HF generate output: {report['standard_matches_hf']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE)
    p.add_argument("--strategies", default="standard,static:2,static:3,confadapt:0.9,verify",
                   help=f"comma-separated: {SPEC_HELP} (K_MAX omitted: the adapter's trained k_max)")
    p.add_argument("--prompts", type=int, default=2, help="number of prompts (GSM8K test questions)")
    p.add_argument("--data", default=None, help=f"GSM8K-format JSONL for prompts (default {DEFAULT_DATA} if present)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-adapter", action="store_true")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        check_max_new_tokens(args.max_new_tokens)
        parse_strategies(args.strategies)
        if args.prompts < 1:
            raise ValueError(f"--prompts must be ≥ 1, got {args.prompts}.")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be ≥ 1, got {args.repeats}.")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be ≥ 1, got {args.threads}.")
        data = args.data or (str(DEFAULT_DATA) if DEFAULT_DATA.is_file() else None)
        if data:
            prompts = [make_prompt(p["question"]) for p in load_problems(data, args.prompts)]
        else:
            prompts = (FALLBACK_PROMPTS * args.prompts)[: args.prompts]
        lm = load_checkpoint(args.model, device=args.device, dtype=args.dtype, adapter=not args.no_adapter)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for note in lm.warnings:
        print(f"note: {note}", file=sys.stderr)
    report = bench(lm, prompts, args.strategies, repeats=args.repeats, max_new_tokens=args.max_new_tokens)
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
