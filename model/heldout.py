"""Held-out figures of MTP checkpoints on the base model's own answers (what decoding will see).

    python -m model.self_answers --data TEST.jsonl --limit 200 --out runs/self_answers/test200.jsonl
    python -m model.heldout --answers runs/self_answers/test200.jsonl --models assets/smollm2-135m-mtp runs/a/final \\
        --agreement 100 --decode 20 --max-new-tokens 128 --taus 0.9,0.7 --k-max 4 --threads 1 --out runs/heldout.json

The agreement set (cheap, no decoding: teacher agreement at every mask position, the tokens
ConfAdapt would keep per block, with standard errors clustered by answer, and how well each position's
confidence is calibrated: the table it prints) and real ConfAdapt decoding
are described in :mod:`model.training.heldout`.

``--models`` takes adapter directories (or exports of ``model.train --export-every``), or ``base``
for the untrained mask token. Results go to ``--out`` (JSON, rewritten after each model).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .errors import CheckpointError, DataError
from .training.data import Example, encode, load_examples
from .training.heldout import decode_effective_k, format_calibration, load_model, score_agreement, setup_for


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m model.heldout",
        description=__doc__.split("\n\n")[0] + " Prints teacher agreement, the tokens ConfAdapt would keep per block, "
        "and how well each block position's confidence is calibrated (match rate by confidence bucket).")
    a = p.add_argument
    a("--answers", required=True, help="JSONL of prompt/response rows: the base model's own answers (model.self_answers)")
    a("--models", nargs="+", required=True, help="adapter or model directories; 'base' = untrained mask token")
    a("--agreement", type=int, default=100, help="answer rows in the agreement set (0: skip)")
    a("--decode", type=int, default=0, help="prompts to decode with ConfAdapt (0: skip)")
    a("--seq-len", type=int, default=288, help="prompt + answer tokens per agreement sequence")
    a("--k", type=int, default=4, help="block size of the agreement set")
    a("--spacing", type=int, default=4, help="anchor every SPACING answer tokens")
    a("--taus", default="0.9,0.7", help="comma-separated ConfAdapt thresholds to simulate and decode at")
    a("--k-max", type=int, default=4, help="k_max of the decoding")
    a("--max-new-tokens", type=int, default=128)
    a("--dtype", default="auto", help="model dtype (auto: the engine's default)")
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a("--out", required=True, help="JSON file (rewritten after each model)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for bad options or data)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    taus = [float(t) for t in args.taus.split(",") if t.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "models"}, "models": {}}
    if out.is_file():  # rerun: keep the models already scored
        try:
            report["models"] = json.loads(out.read_text()).get("models", {})
        except (OSError, json.JSONDecodeError):
            pass
    try:
        n_rows = max(args.agreement, args.decode)
        rows: list[Example] = load_examples(args.answers, need_response=True, limit=n_rows) if n_rows else []
        for spec in args.models:
            if spec in report["models"]:
                print(f"{spec}: already in {out}, skipped", file=sys.stderr)
                continue
            lm = load_model(spec, args.dtype)
            res: dict[str, Any] = {"adapter": lm.adapter}
            trained = Path(spec) / "trained.json"
            if trained.is_file():
                res["trained"] = json.loads(trained.read_text())
            if args.agreement:
                seqs, starts, _ = encode(lm, rows[: args.agreement], args.seq_len)
                t0 = time.perf_counter()
                res["agreement_set"] = score_agreement(setup_for(lm), lm.model, seqs, starts, k=args.k,
                                                       spacing=args.spacing, taus=taus)
                res["agreement_set"]["seconds"] = round(time.perf_counter() - t0, 1)
            if args.decode:
                sel = rows[: args.decode]
                res["decode"] = decode_effective_k(lm, [r.prompt for r in sel], [r.response for r in sel], taus=taus,
                                                   k_max=args.k_max, max_new_tokens=args.max_new_tokens)
            report["models"][spec] = res
            out.write_text(json.dumps(report, indent=1, allow_nan=False))
            a = res.get("agreement_set", {})
            d = res.get("decode", {})
            print(f"{spec}: agreement {a.get('agreement', float('nan')):.3f} ± {a.get('agreement_se_cluster') or float('nan'):.3f} "
                  f"match {a.get('match', float('nan')):.3f} sim_k {a.get('sim_k')} "
                  f"decode k {({t: round(v['effective_k'], 3) for t, v in d.items()})}", file=sys.stderr)
            if a.get("calibration"):
                print(f"{spec}: how often each block position's proposal is the answer's token, by its confidence "
                      f"(match rate/positions):\n{format_calibration(a['calibration'])}", file=sys.stderr)
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
