"""Self-distilled training text: the base model's own greedy answers to a set of questions.

Training MTP on the base model's own outputs (paper 3.3 trains on teacher-scored student
blocks; the prefixes come from data) makes the training prefixes look like what the model writes
at inference, which is where ConfAdapt has to be confident.

    python -m model.selfdistill --model smollm2-135m --data ../shared/data/gsm8k/train.jsonl \\
        --out runs/gsm8k_train_selfdistill.jsonl --limit 2000 --max-new-tokens 256 --batch-size 16

Reads JSONL rows with ``question`` (or ``prompt``), writes rows ``{"question", "answer"}`` where
``answer`` is the greedy continuation of the base model (any MTP adapter disabled), stopped at
the first stop token. Batched transformers ``generate`` with left padding; resumable: rows already
in ``--out`` are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint


def read_questions(path: str | Path, limit: int | None = None) -> list[str]:
    """Questions from a JSONL file (field ``question`` or ``prompt``).

    Raises:
        ValueError: naming the file, line and reason for a bad row or an empty file.
    """
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            q = row.get("question", row.get("prompt")) if isinstance(row, dict) else None
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"{path}:{n}: no 'question' or 'prompt' text")
            out.append(q)
            if limit and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


@torch.inference_mode()
def greedy_answers(lm: LoadedModel, questions: list[str], max_new_tokens: int = 256, batch_size: int = 16) -> list[str]:
    """Greedy answers of the base model (adapter off), one per question, special tokens skipped.

    Batches of ``batch_size`` prompts, left-padded; ``max_new_tokens`` tokens at most each.
    """
    tok = lm.tokenizer
    answers: list[str] = []
    with lm.base_model() as model:
        for i in range(0, len(questions), batch_size):
            prompts = [lm.prompt_ids(q) for q in questions[i : i + batch_size]]
            width = max(map(len, prompts))
            pad = tok.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=lm.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=lm.device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(lm.stop_token_ids), pad_token_id=pad,
                                 suppress_tokens=[lm.mask_token_id], temperature=None, top_p=None, top_k=None)
            answers += tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return [a.strip() for a in answers]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit status 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m model.selfdistill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_SOURCE)
    p.add_argument("--data", required=True, help="JSONL with question (or prompt) fields")
    p.add_argument("--out", required=True, help="output JSONL (appended to; existing rows are kept)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    try:
        questions = read_questions(args.data, args.limit)
        lm = load_checkpoint(args.model, adapter=False)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for line in out.open(encoding="utf-8") if line.strip()) if out.exists() else 0
    todo = questions[done:]
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(questions), initial=done, unit="answer") as bar:
        for i in range(0, len(todo), args.batch_size):
            chunk = todo[i : i + args.batch_size]
            for q, a in zip(chunk, greedy_answers(lm, chunk, args.max_new_tokens, args.batch_size)):
                f.write(json.dumps({"question": q, "answer": a}, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(chunk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
