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
  stood at that anchor (``sim_k``: the leading run of the block's confidences >= tau, the first
  position's included, at least 1: :meth:`~model.engine.strategies.ConfAdapt.accept`), and how many of
  those are also right (``sim_k_right``). Standard errors: binomial over positions, and clustered
  by sequence (positions within one answer are correlated; the honest one to rank by). And the
  **calibration** of each block position's confidence (``calibration``, :func:`format_calibration`):
  how often its proposal is the answer's token, by confidence bucket, with position 0 (the real row:
  the base model's own next token) beside the masks. ConfAdapt trusts that confidence, so this says
  what tau means for a checkpoint, and how often each position reaches it.
* **decoding** (``--decode N``): ConfAdapt decoding (``--taus``, ``--k-max``) of the first N
  prompts for ``--max-new-tokens``: effective k (tokens per forward pass, pooled) and the share of
  answers identical to the base model's greedy answer in the file.

``--models`` takes adapter directories (or exports of ``model.train --export-every``), or ``base``
for the untrained mask token. Results go to ``--out`` (JSON, rewritten after each model).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Any, Sequence

import torch

from ..engine.decoding import run
from ..engine.loaded_model import LoadedModel
from ..engine.loading import DEFAULT_SOURCE, load_checkpoint
from ..engine.strategies import ConfAdapt, confadapt
from .layout import place_regions
from .objective import Setup, batch_objective


#: Confidence buckets of the calibration table: [0, 0.3), [0.3, 0.5), ..., [0.99, 1].
CALIBRATION_EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


def setup_for(lm: LoadedModel) -> Setup:
    """The student/teacher pair of a loaded model as training sees it: an adapter's teacher is the base
    with the adapter off; a model without adapter is its own teacher (an untrained mask token)."""
    return Setup(lm=lm, student=lm.model, teacher=None, kind=lm.adapter or "full")


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
def score_agreement(setup: Setup, model: Any, seqs: Sequence[Sequence[int]], starts: Sequence[int], *, k: int = 4,
                    spacing: int = 4, num_regions: int = 10_000, taus: Sequence[float] = (0.9, 0.7),
                    batch_size: int = 8) -> dict:
    """The agreement-set figures (module docstring) over all of ``seqs``: the training objective without
    gradient at grid offset 0, ``num_regions`` blocks of ``k`` at most per row, every ``spacing`` tokens.

    Args:
        setup: the student/teacher pair (:func:`setup_for`, or the trainer's).
        model: the module to call (the trainer's unwrapped student, or ``setup.lm.model``).

    Returns:
        ``{"agreement", "match", "confidence", "positions", "blocks", "sequences", "*_se" and
        "*_se_cluster" for agreement / match, "sim_k": {tau: mean}, "sim_k_right": {tau: mean},
        "by_block": {j: {"agreement", "match"}}, "per_sequence": [[agree, match, positions, blocks,
        sim_k sum per tau...]]}`` (sums per sequence, for paired differences between models).
    """
    lm = setup.lm
    eos = int(lm.stop_token_ids[0]) if lm.stop_token_ids else -1
    rows: list[dict] = []  # per sequence sums
    by_block = {j: [0, 0, 0] for j in range(1, k)}  # agree, match, n
    calib = _Calibration(k, taus)
    was_training = model.training
    model.eval()
    for i in range(0, len(seqs), batch_size):
        bs, bst = list(seqs[i:i + batch_size]), list(starts[i:i + batch_size])
        regions = place_regions(bs, bst, k=k, offset=0, spacing=spacing, num_regions=num_regions,
                                eos_token_id=list(lm.stop_token_ids))
        out = batch_objective(setup, model, model, bs, bst, k=k, offset=0, spacing=spacing, num_regions=num_regions)
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
            calib.add(tok, gt, cf)
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
                n_keep = ConfAdapt(tau=t, k_max=k).accept(cf)[0]  # decoding's own rule (paper 4.5)
                right, ok = 1, tok[0] == gt[0]
                for j in range(1, n_keep):
                    ok = ok and tok[j] == gt[j]
                    right += int(ok)
                row[f"sim{t}"] += n_keep
                row[f"right{t}"] += right
        rows.extend(per[b] for b in range(len(bs)) if per[b]["blocks"])
    model.train(was_training)
    return _agreement_figures(rows, by_block, calib, k=k, spacing=spacing, taus=taus)


def _agreement_figures(rows: list[dict], by_block: dict[int, list], calib: _Calibration, *, k: int, spacing: int,
                       taus: Sequence[float]) -> dict:
    """:func:`score_agreement`'s result from its counts: ``rows`` (sums per sequence), ``by_block`` (per mask
    position ``[agree, match, n]``) and the calibration counts."""
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
    res["calibration"] = calib.to_dict(blocks)
    # per sequence sums, for paired comparisons of two models on the same set
    res["per_sequence"] = [[r["agree"], r["match"], r["n"], r["blocks"], *[r[f"sim{t}"] for t in taus]] for r in rows]
    return res


class _Calibration:
    """Counts for :func:`score_agreement`'s ``calibration``: per block position (0 = the real row), positions
    and matches with the answer's token by confidence bucket (:data:`CALIBRATION_EDGES`), and per tau how many
    blocks' position reaches it and how many of those match."""

    def __init__(self, k: int, taus: Sequence[float]):
        self.k, self.taus, self.nb = k, list(taus), len(CALIBRATION_EDGES) - 1
        self.cells = [[[0, 0] for _ in range(self.nb)] for _ in range(k)]  # [position][bucket] -> [n, matches]
        self.confident = {t: [[0, 0] for _ in range(k)] for t in self.taus}  # [position] -> [conf >= t, matches]

    def add(self, tokens: Sequence[int], answer: Sequence[int], conf: Sequence[float]) -> None:
        """One block: the student's ``k`` tokens, the answer's, the student's confidences."""
        for j in range(self.k):
            right = int(tokens[j] == answer[j])
            cell = self.cells[j][min(bisect.bisect_right(CALIBRATION_EDGES, conf[j]) - 1, self.nb - 1)]
            cell[0] += 1
            cell[1] += right
            for t in self.taus:
                if conf[j] >= t:
                    self.confident[t][j][0] += 1
                    self.confident[t][j][1] += right

    def to_dict(self, blocks: int) -> dict:
        """``{"edges", "by_position": {j: {"positions", "match"}}, "confident": {tau: {j: {"share", "match"}}}}``
        (a rate is None where nothing was counted)."""
        def rate(c: list[int]) -> float | None:
            return c[1] / c[0] if c[0] else None

        return {
            "edges": list(CALIBRATION_EDGES),
            "by_position": {str(j): {"positions": [c[0] for c in row], "match": [rate(c) for c in row]}
                            for j, row in enumerate(self.cells)},
            "confident": {str(t): {str(j): {"share": c[0] / max(blocks, 1), "match": rate(c)}
                                   for j, c in enumerate(by)} for t, by in self.confident.items()},
        }


def format_calibration(cal: dict) -> str:
    """A text table of :func:`score_agreement`'s ``calibration``: one line per block position (0: the real row,
    the base model's own next token; 1..k-1: the masks), each bucket as ``match rate/positions``, then per tau the
    share of blocks whose position reaches it and how often those proposals are right."""

    def rate(m: float | None) -> str:
        return "-" if m is None else f"{m:.2f}"

    def name(j: str) -> str:
        return "real" if j == "0" else f"mask {j}"

    edges = cal["edges"]
    lines = ["position  " + "  ".join(f"[{a:.2f},{b:.2f})".rjust(11) for a, b in zip(edges, edges[1:]))]
    for j, row in cal["by_position"].items():
        cells = [f"{rate(m)}/{n}".rjust(11) for m, n in zip(row["match"], row["positions"])]
        lines.append(f"{name(j):<9} " + "  ".join(cells))
    for t, by in cal["confident"].items():
        parts = [f"{name(j)} {v['share']:.2f} ({rate(v['match'])})" for j, v in by.items()]
        lines.append(f"confidence >= {t}: share of blocks (right when so): " + ", ".join(parts))
    return "\n".join(lines)


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
            r = run(lm, lm.prompt_ids(prompt), confadapt(t, k_max), max_new_tokens)
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
