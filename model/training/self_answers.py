"""Self-distilled training text: the base model's own greedy answers to a set of prompts.

    python -m model.self_answers --base smollm2-135m --data openai/gsm8k:main \\
        --out runs/self_answers/gsm8k_train.jsonl --batch-size 32 --max-new-tokens 256 --threads 1

Decoding sees the model's own continuations, not a dataset's reference answers, so an MTP adapter
trained on them learns the text it will have to predict (and a hard-label student can become very
confident there: the greedy continuation is a deterministic function of the prefix). The answers
are the model's standard (greedy) decoding, the model's prompt format via
:meth:`~model.engine.loaded_model.LoadedModel.prompt_ids`, stop at any EOS, the mask token never
proposed, any MTP adapter off, in bfloat16 where the device runs it natively
(:func:`model.engine.precision.native_bf16`): a batch decodes through shared passes on our CPU kernels,
else through transformers ``generate`` (:func:`greedy_answers`).

The output JSONL has one row per prompt: ``index`` (in the input), ``prompt``, ``response`` (the
decoded answer), ``reference`` (the data's own answer, when it has one), ``tokens`` (answer tokens),
``stopped`` (ended with EOS, not at ``--max-new-tokens``) and ``generated_by`` (the base model). Rows are appended and flushed one
by one as answers end; a rerun skips the indices already in the file, so an interrupted run continues where it
stopped. :func:`model.training.data.load_examples` reads the file directly (``prompt``/``response``;
empty answers, kept in the file as done, are skipped).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..engine.adapter_format import DEFAULT_MASK_TOKEN
from ..engine.loaded_model import LoadedModel
from ..engine.loading import load_checkpoint, resolve_device
from ..engine.precision import native_bf16
from ..errors import DataError
from .data import Example, answer_is_complete


def greedy_answers(lm: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers of the model (adapter off) to a batch of tokenised prompts.

    On our CPU kernels the prompts decode together through :class:`~model.engine.batch.BatchRunner` (standard
    decoding, one shared forward pass per token for all of them): each answer is, token for token, the one
    standard decoding gives the prompt alone (rows of our kernels are exact), the text decoding will see, at
    several times the speed of ``generate`` on a CPU. Elsewhere one ``generate`` call: prompts left-padded
    (attention mask 0 on the padding; transformers derives the position ids from it), so each row's answer
    equals the unbatched greedy answer up to floating-point rounding of the padded shapes (exact in float32 /
    float64 on the tests' models).

    Returns:
        Per prompt, the new token ids up to and including the first stop token (none when the answer
        ran to ``max_new_tokens``).
    """
    if not prompts:
        return []
    if _on_kernels(lm):
        return _engine_answers(lm, prompts, max_new_tokens)
    pad = lm.tokenizer.pad_token_id
    if pad is None:
        pad = lm.stop_token_ids[0] if lm.stop_token_ids else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p):] = 1
    stops = set(lm.stop_token_ids)
    with torch.inference_mode(), lm.base_model() as model:
        out = model.generate(
            input_ids=ids.to(lm.device), attention_mask=attn.to(lm.device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=list(lm.stop_token_ids) or None, pad_token_id=pad,
            suppress_tokens=[lm.mask_token_id], temperature=None, top_p=None, top_k=None,
        )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:cut])
    return answers


def _engine_answers(lm: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Standard decoding of every prompt, their passes shared (:class:`~model.engine.batch.BatchRunner`)."""
    done = dict(stream_answers(lm, list(enumerate(prompts)), max_new_tokens, width=len(prompts)))
    return [done[i] for i in range(len(prompts))]


def stream_answers(lm: LoadedModel, prompts: Sequence[tuple[int, Sequence[int]]], max_new_tokens: int,
                   width: int = 32) -> Iterator[tuple[int, list[int]]]:
    """Continuous batching on our kernels: up to ``width`` prompts decode together (standard decoding, passes
    shared through :class:`~model.engine.batch.BatchRunner`), and a finished one's place goes to the next prompt
    at once, so a pass keeps ``width`` rows while prompts remain (answers of unequal lengths would otherwise
    leave the last passes of a batch nearly empty, each costing a whole read of the weights).

    Args:
        prompts: ``(key, prompt ids)`` pairs, decoded in order.

    Yields:
        ``(key, answer ids)`` as each answer ends (up to and including its stop token), not in input order.
    """
    from ..engine.batch import BatchRunner
    from ..engine.decoding import Decoder
    from ..engine.strategies import standard

    runner = BatchRunner(lm, max_rows=max(64, 4 * width), max_sessions=width)
    queue, live = list(prompts)[::-1], {}
    while queue or live:
        while queue and len(live) < width:
            key, ids = queue.pop()
            d = Decoder(lm, ids, standard(), max_new_tokens)
            live[d] = key
            runner.add(d)
        runner.step()
        for d in [d for d in live if d.done]:
            yield live.pop(d), d.result().token_ids


def _on_kernels(lm: LoadedModel) -> bool:
    """Whether ``lm`` (a plain base: :func:`load_generator`) decodes on our CPU kernels, where batches of answers
    share passes."""
    return lm.adapter is None and lm.backend().kind == "kernels"


def _read_done(path: Path) -> dict[int, dict]:
    """Rows already in ``path`` by index. A line cut by a killed run is dropped from the file (its
    row is generated again), so that the file stays valid JSONL for every reader."""
    done: dict[int, dict] = {}
    if not path.is_file():
        return done
    broken = False
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                done[int(row["index"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                broken = True
    if broken:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in done.values()), encoding="utf-8")
        tmp.replace(path)
    return done


def write_answers(lm: LoadedModel, examples: Sequence[Example], path: str | Path, *, limit: int | None = None,
                  batch_size: int = 32, max_new_tokens: int = 256, show_progress: bool = True) -> list[dict]:
    """Generate (or finish generating) the greedy answers to ``examples[:limit]`` into ``path``.

    Indices already in ``path`` are skipped; new rows are appended as each answer ends (on our kernels, ``batch_size`` answers decode together and a finished one's place goes to the next prompt). Within windows
    of 8 batches prompts are batched by token length (less padding); each row keeps its ``index``.

    Returns:
        All rows for ``examples[:limit]``, ordered by index.
    """
    from tqdm.auto import tqdm

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    todo_n = len(examples) if limit is None else min(limit, len(examples))
    done = _read_done(path)
    todo = [i for i in range(todo_n) if i not in done]
    encoded = {i: lm.prompt_ids(examples[i].prompt) for i in todo}
    # Less padding: prompts of similar length share a batch, sorted within windows of 8 batches only, so
    # that a stopped run has answered (nearly) the first prompts, not the shortest ones of the whole file.
    window = 8 * batch_size
    todo = [i for w in range(0, len(todo), window) for i in sorted(todo[w:w + window], key=lambda i: (len(encoded[i]), i))]
    bar = tqdm(total=todo_n, initial=todo_n - len(todo), desc="greedy answers", unit="answer",
               disable=not show_progress or not todo, dynamic_ncols=True)
    def answered() -> Iterator[tuple[int, list[int]]]:
        if _on_kernels(lm):
            yield from stream_answers(lm, [(i, encoded[i]) for i in todo], max_new_tokens, width=batch_size)
            return
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            yield from zip(chunk, greedy_answers(lm, [encoded[i] for i in chunk], max_new_tokens))

    with path.open("a", encoding="utf-8") as f:
        for i, ans in answered():
            stopped = bool(ans) and ans[-1] in lm.stop_token_ids
            body = ans[:-1] if stopped else ans
            text = lm.tokenizer.decode(body, skip_special_tokens=True).strip()
            row = {"index": i, "prompt": examples[i].prompt, "response": text,
                   "reference": examples[i].response, "tokens": len(body), "stopped": stopped,
                   "generated_by": lm.source}
            f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
            f.flush()
            done[i] = row
            bar.update(1)
    bar.close()
    return [done[i] for i in range(todo_n)]


def as_examples(rows: Sequence[dict], path: str | Path) -> list[Example]:
    """Training examples from answer rows; empty answers (an immediate EOS) are left out; an answer
    cut at ``--max-new-tokens`` is marked incomplete (no EOS after it in training).

    Raises:
        DataError: every answer is empty.
    """
    out = [Example(r["prompt"], r["response"], f"{path}:index {r['index']}", reference=r.get("reference"),
                   complete=answer_is_complete(r)) for r in rows if r["response"]]
    if not out:
        raise DataError(f"{path}: the base model answered every prompt with nothing; no training text.")
    return out


def load_generator(base: str, *, device: str = "auto", dtype: str = "auto", prompt_format: str | None = None,
                   mask_token: str | None = None) -> LoadedModel:
    """The plain base model for answer generation (no adapter); ``dtype="auto"`` is bfloat16 where the
    device runs it natively (:func:`model.engine.precision.native_bf16`), else float32."""
    dev = resolve_device(device)
    dt: Any = dtype
    if dtype == "auto":
        dt = torch.bfloat16 if native_bf16(dev) else torch.float32
    return load_checkpoint(base, device=dev, dtype=dt, prompt_format=prompt_format, adapter=False,
                           mask_token=mask_token or DEFAULT_MASK_TOKEN)
