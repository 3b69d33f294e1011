"""Held-out figures of MTP checkpoints on the base model's own answers (what decoding will see).

    python -m model.self_answers --data TEST.jsonl --limit 200 --out runs/self_answers/test200.jsonl
    python -m model.heldout --answers runs/self_answers/test200.jsonl --models assets/smollm2-135m-mtp runs/a/final \\
        --agreement 100 --decode 20 --max-new-tokens 128 --taus 0.9,0.7 --k-max 4 --threads 1 --out runs/heldout.json

Two measurements, both on prompts the adapter never trained on:

* **agreement set** (``--agreement N``, cheap: no decoding): the first N answer rows laid out as
  training sequences with blocks of ``k`` (default 4) on every ``spacing``-th (default 4) answer
  position, scored with the training objective without gradient. Per mask position: ``agreement``
  (the student's token equals the teacher's argmax given the student's own earlier block tokens,
  as in training), ``match`` (it equals the base model's greedy token, i.e. the answer text) and the
  student's confidence. Per block: the tokens ConfAdapt would keep at each ``tau`` if decoding
  stood at that anchor (``sim_k``: 1 + the leading masks with confidence >= tau), and how many of
  those are also right (``sim_k_right``). Standard errors: binomial over positions, and clustered
  by sequence (positions within one answer are correlated; the honest one to rank by).
* **decoding** (``--decode N``): ConfAdapt decoding (``--taus``, ``--k-max``) of the first N
  prompts for ``--max-new-tokens``: effective k (tokens per forward pass, pooled) and the share of
  answers identical to the base model's greedy answer in the file.

``--models`` takes adapter directories (or exports of ``model.train --export-every``), or ``base``
for the untrained mask token. Results go to ``--out`` (JSON, rewritten after each model).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from .decoding import Decoder
from .strategies import confadapt
from .layout import place_regions
from .train_data import DataError, Example, encode, load_examples


def _setup(lm: LoadedModel) -> Any:
    from .train import Setup

    kind = lm.adapter or "full"  # no adapter: the model is its own teacher (untrained mask token)
    return Setup(lm=lm, student=lm.model, teacher=None, teacher_context=None, kind=kind)


def _se(p: float, n: int) -> float | None:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else None


def _cluster_se(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Standard error of a ratio of sums, clustered by row (the delta method over rows); None for < 2 rows."""
    n = len(num)
    tot_d = sum(den)
    if n < 2 or tot_d == 0:
        return None
    r = sum(num) / tot_d
    resid = [(a - r * b) for a, b in zip(num, den)]
    mean_d = tot_d / n
    var = sum(x * x for x in resid) / (n - 1) / n
    return math.sqrt(var) / mean_d


@torch.no_grad()
def score_agreement(lm: LoadedModel, seqs: Sequence[Sequence[int]], starts: Sequence[int], *, k: int = 4,
                    spacing: int = 4, taus: Sequence[float] = (0.9, 0.7), batch_size: int = 8) -> dict:
    """The agreement-set figures of ``lm`` (module docstring) over all of ``seqs``.

    Returns:
        ``{"agreement", "match", "confidence", "positions", "blocks", "sequences", "*_se" and
        "*_se_cluster" for agreement / match, "sim_k": {tau: mean}, "sim_k_right": {tau: mean},
        "by_block": {j: {"agreement", "match"}}, "per_sequence": [[agree, match, positions, blocks,
        sim_k sum per tau...]]}`` (sums per sequence, for paired differences between models).
    """
    from .train import batch_objective

    setup = _setup(lm)
    eos = int(lm.stop_token_ids[0]) if lm.stop_token_ids else -1
    rows: list[dict] = []  # per sequence sums
    by_block = {j: [0, 0, 0] for j in range(1, k)}  # agree, match, n
    was_training = lm.model.training
    lm.model.eval()
    for i in range(0, len(seqs), batch_size):
        bs, bst = list(seqs[i:i + batch_size]), list(starts[i:i + batch_size])
        regions = place_regions(bs, bst, k=k, offset=0, spacing=spacing, num_regions=10_000,
                                eos_token_id=list(lm.stop_token_ids))
        out = batch_objective(setup, lm.model, lm.model, bs, bst, k=k, offset=0, spacing=spacing, num_regions=10_000)
        if out is None:
            continue
        per = {b: {"agree": 0.0, "match": 0.0, "conf": 0.0, "n": 0, "blocks": 0,
                   **{f"sim{t}": 0.0 for t in taus}, **{f"right{t}": 0.0 for t in taus}} for b in range(len(bs))}
        tokens = out.student_tokens.view(len(regions), k).tolist()
        labels = out.labels.view(len(regions), k).tolist()
        conf = out.student_confidence.float().view(len(regions), k).tolist()
        for reg, tok, lab, cf in zip(regions, tokens, labels, conf):
            seq = bs[reg.batch]
            gt = [int(seq[reg.anchor + 1 + j]) if reg.anchor + 1 + j < len(seq) and
                  (reg.eos is None or reg.anchor + 1 + j <= reg.eos) else eos for j in range(k)]
            row = per[reg.batch]
            row["blocks"] += 1
            for j in range(1, k):
                a, m = float(tok[j] == lab[j]), float(tok[j] == gt[j])
                row["agree"] += a
                row["match"] += m
                row["conf"] += cf[j]
                row["n"] += 1
                by_block[j][0] += a
                by_block[j][1] += m
                by_block[j][2] += 1
            for t in taus:
                n_keep = right = 1
                ok = tok[0] == gt[0]
                for j in range(1, k):
                    if cf[j] < t:
                        break
                    n_keep += 1
                    ok = ok and tok[j] == gt[j]
                    right += int(ok)
                row[f"sim{t}"] += n_keep
                row[f"right{t}"] += right
        rows.extend(per[b] for b in range(len(bs)) if per[b]["blocks"])
    lm.model.train(was_training)
    n = sum(r["n"] for r in rows)
    blocks = sum(r["blocks"] for r in rows)
    res: dict[str, Any] = {"sequences": len(rows), "positions": n, "blocks": blocks, "k": k, "spacing": spacing}
    for key in ("agreement", "match"):
        col = "agree" if key == "agreement" else "match"
        p = sum(r[col] for r in rows) / max(n, 1)
        res[key] = p
        res[f"{key}_se"] = _se(p, n)
        res[f"{key}_se_cluster"] = _cluster_se([r[col] for r in rows], [r["n"] for r in rows])
    res["confidence"] = sum(r["conf"] for r in rows) / max(n, 1)
    res["sim_k"] = {str(t): sum(r[f"sim{t}"] for r in rows) / max(blocks, 1) for t in taus}
    res["sim_k_se_cluster"] = {str(t): _cluster_se([r[f"sim{t}"] for r in rows], [r["blocks"] for r in rows])
                               for t in taus}
    res["sim_k_right"] = {str(t): sum(r[f"right{t}"] for r in rows) / max(blocks, 1) for t in taus}
    res["by_block"] = {str(j): {"agreement": v[0] / max(v[2], 1), "match": v[1] / max(v[2], 1)}
                       for j, v in by_block.items()}
    # per sequence sums, for paired comparisons of two models on the same set
    res["per_sequence"] = [[r["agree"], r["match"], r["n"], r["blocks"], *[r[f"sim{t}"] for t in taus]] for r in rows]
    return res


@torch.no_grad()
def decode_effective_k(lm: LoadedModel, prompts: Sequence[str], references: Sequence[str] | None, *,
                       taus: Sequence[float] = (0.9, 0.7), k_max: int = 4, max_new_tokens: int = 128) -> dict:
    """ConfAdapt decoding of each prompt at each tau: pooled effective k (new tokens / forward passes),
    the mean and standard error of per-answer effective k, and the share of answers equal to
    ``references`` (the base model's greedy answers; an answer cut at ``max_new_tokens`` must be a
    prefix of its reference) when given."""
    out: dict[str, Any] = {}
    for t in taus:
        toks = passes = same = 0
        per: list[float] = []
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            dec = Decoder(lm, lm.prompt_ids(prompt), confadapt(t, k_max), max_new_tokens)
            for _ in dec:
                pass
            r = dec.result()
            toks += r.new_tokens
            passes += r.forward_passes
            per.append(r.new_tokens / max(r.forward_passes, 1))
            if references is not None:  # compared as text: token ids need not survive a decode/encode round trip
                body = [tok for tok in r.token_ids if tok not in lm.stop_token_ids]
                text = lm.tokenizer.decode(body, skip_special_tokens=True).strip()
                ended = len(body) < len(r.token_ids)
                same += int(text == references[i].strip() if ended else references[i].strip().startswith(text))
        m = sum(per) / len(per)
        sd = math.sqrt(sum((x - m) ** 2 for x in per) / max(len(per) - 1, 1))
        out[str(t)] = {"effective_k": toks / max(passes, 1), "effective_k_per_answer": m,
                       "effective_k_se": sd / math.sqrt(len(per)), "tokens": toks, "passes": passes,
                       "same_as_base": same / len(prompts) if references is not None else None,
                       "seconds": round(time.perf_counter() - t0, 1)}
    return out


def load_model(spec: str, dtype: str) -> LoadedModel:
    """``base`` (the default source without adapter), or an adapter / model directory."""
    if spec == "base":
        return load_checkpoint(DEFAULT_SOURCE, adapter=False, dtype=dtype)
    if spec == DEFAULT_SOURCE:
        return load_checkpoint(DEFAULT_SOURCE, dtype=dtype)
    return load_checkpoint(spec, dtype=dtype)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(prog="python -m model.heldout", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--answers", required=True, help="JSONL of prompt/response rows: the base model's own answers (model.self_answers)")
    a("--models", nargs="+", required=True, help="adapter or model directories; 'base' = untrained mask token")
    a("--agreement", type=int, default=100, help="answer rows in the agreement set (0: skip)")
    a("--decode", type=int, default=0, help="prompts to decode with ConfAdapt (0: skip)")
    a("--seq-len", type=int, default=288, help="prompt + answer tokens per agreement sequence")
    a("--k", type=int, default=4, help="block size of the agreement set")
    a("--spacing", type=int, default=4, help="anchor every SPACING answer tokens")
    a("--taus", default="0.9,0.7")
    a("--k-max", type=int, default=4, help="k_max of the decoding")
    a("--max-new-tokens", type=int, default=128)
    a("--dtype", default="auto", help="model dtype (auto: the engine's default)")
    a("--threads", type=int, default=None)
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
                res["agreement_set"] = score_agreement(lm, seqs, starts, k=args.k, spacing=args.spacing, taus=taus)
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
    except (DataError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
