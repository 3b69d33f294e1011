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
``stopped`` (ended with EOS, not at ``--max-new-tokens``) and ``generated_by`` (the base model). Rows are appended and flushed batch by
batch; a rerun skips the indices already in the file, so an interrupted run continues where it
stopped. :func:`model.training.data.load_examples` reads the file directly (``prompt``/``response``;
empty answers, kept in the file as done, are skipped).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

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
    from ..engine.kernel_forward import KernelForward

    base = lm.without_adapter() if lm.adapter else lm
    with base.base_model():
        if isinstance(base.fast_engine(), KernelForward):
            return _engine_answers(base, prompts, max_new_tokens)
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
    from ..engine.batch import BatchRunner
    from ..engine.decoding import Decoder
    from ..engine.strategies import standard

    decoders = [Decoder(lm, p, standard(), max_new_tokens) for p in prompts]
    runner = BatchRunner(lm, max_rows=max(64, 4 * len(prompts)), max_sessions=len(prompts))
    for d in decoders:
        runner.add(d)
    runner.run()
    return [d.result().token_ids for d in decoders]


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

    Indices already in ``path`` are skipped; new rows are appended one batch at a time. Within windows
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
    with path.open("a", encoding="utf-8") as f:
        for s in range(0, len(todo), batch_size):
            chunk = todo[s:s + batch_size]
            answers = greedy_answers(lm, [encoded[i] for i in chunk], max_new_tokens)
            for i, ans in zip(chunk, answers):
                stopped = bool(ans) and ans[-1] in lm.stop_token_ids
                body = ans[:-1] if stopped else ans
                text = lm.tokenizer.decode(body, skip_special_tokens=True).strip()
                row = {"index": i, "prompt": examples[i].prompt, "response": text,
                       "reference": examples[i].response, "tokens": len(body), "stopped": stopped,
                       "generated_by": lm.source}
                f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
                done[i] = row
            f.flush()
            bar.update(len(chunk))
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
