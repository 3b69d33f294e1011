"""Training data for MTP self-distillation: prompt/response rows -> ground-truth token sequences.

Accepted inputs (``--data``):

* a JSONL file whose rows have ``question`` + ``answer`` (GSM8K) or ``prompt`` + ``response``;
  rows with only ``question`` / ``prompt`` are accepted when the responses are to be generated
  by the base model itself (``--self-distill-answers``);
* a Hugging Face ``datasets`` id (``owner/name``, optionally ``owner/name:config``) with the
  same columns (needs the Hub or a local datasets cache).

Bad rows stop the run before any training step with ``file:line: reason``.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..engine.text import encode_literal
from ..errors import DataError
from ..jsonl import read_jsonl_rows

FIELD_PAIRS = (("question", "answer"), ("prompt", "response"))
SELF_ANSWERS = "self_answers.jsonl"  # where --self-distill-answers writes the answers, in the run directory


@dataclass(frozen=True)
class Example:
    """One training example: a user prompt and the response to learn (None: to be generated);
    ``reference``: the data's own answer when ``response`` is a generated one (``model.self_answers``
    rows), so that a run can mix the two (``--reference-share``); ``complete``: False for a generated
    answer cut at its token limit (no EOS is appended to it: the model had not ended there)."""

    prompt: str
    response: str | None
    where: str = ""
    reference: str | None = None
    complete: bool = True


def answer_is_complete(row: dict) -> bool:
    """False for a generated answer row (``model.self_answers``: ``generated_by`` set) cut at its token
    limit (``stopped`` false): the model had not ended there, so no EOS follows it in training."""
    return not (row.get("generated_by") and row.get("stopped") is False)


def _row_example(row: Any, where: str, need_response: bool) -> Example | None:
    """The row's example; None for a generated answer that is empty (the model answered with an
    immediate EOS: ``model.self_answers`` keeps such rows, marked ``generated_by``, to know they are done)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    for pkey, rkey in FIELD_PAIRS:
        if pkey in row:
            prompt = row[pkey]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{where}: field {pkey!r} must be a non-empty string.")
            resp = row.get(rkey)
            if resp is None:
                if need_response:
                    raise DataError(f"{where}: missing field {rkey!r} (rows need {pkey}/{rkey}; rows with only "
                                    f"{pkey!r} need --self-distill-answers).")
                return Example(prompt, None, where)
            if row.get("generated_by") and resp == "":
                return None
            if not isinstance(resp, str) or not resp.strip():
                raise DataError(f"{where}: field {rkey!r} must be a non-empty string.")
            ref = row.get("reference")
            return Example(prompt, resp, where, reference=ref if isinstance(ref, str) and ref.strip() else None,
                           complete=answer_is_complete(row))
    raise DataError(f"{where}: missing field 'question' or 'prompt' (rows need question/answer or "
                    f"prompt/response); found keys {sorted(row)[:8]}.")


def read_jsonl(path: str | Path, *, need_response: bool = True, limit: int | None = None) -> list[Example]:
    """Read and validate a JSONL file of examples.

    Raises:
        DataError: missing or empty file, a line that is not UTF-8 or not JSON (``file:line:column``),
            a row without the fields (``file:line``).
    """
    out: list[Example] = []
    for where, row in read_jsonl_rows(path):
        ex = _row_example(row, where, need_response)
        if ex is not None:
            out.append(ex)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no examples (the file is empty).")
    return out


def load_examples(spec: str, *, need_response: bool = True, split: str = "train",
                  limit: int | None = None) -> list[Example]:
    """Examples from a JSONL path or a ``datasets`` id (``owner/name[:config]``).

    Raises:
        DataError: as :func:`read_jsonl`; a dataset that cannot be loaded or lacks the columns.
    """
    if os.path.exists(spec) or spec.endswith((".jsonl", ".json")):
        return read_jsonl(spec, need_response=need_response, limit=limit)
    import datasets

    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        raise DataError(f"{spec}: not a file and not a loadable dataset ({type(e).__name__}: {e}).") from None
    out = []
    for i, row in enumerate(ds):
        ex = _row_example(dict(row), f"{spec}[{split}]:{i}", need_response)
        if ex is not None:
            out.append(ex)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{spec}: no examples in split {split!r}.")
    return out


def encode(lm: Any, examples: Sequence[Example], seq_len: int) -> tuple[list[list[int]], list[int], list[str]]:
    """Ground-truth sequences: ``lm.prompt_ids(prompt)`` + response tokens + EOS (none after an
    incomplete generated answer), cut at ``seq_len``.

    Prompt and response are tokenised literally: text that spells a special token stays text. Every
    sequence kept has at least one response token, so it holds an MTP region at any grid offset
    (:func:`model.training.layout.place_regions` wraps the offset within a short response).

    Returns:
        ``(sequences, response_starts, dropped)``: ``dropped`` says, for each row whose prompt leaves no
        room for a response token within ``seq_len``, ``"file:line: why"``.

    Raises:
        DataError: an example without a response; every example dropped.
    """
    tok = lm.tokenizer
    end = list(lm.stop_token_ids[:1])  # the model's EOS; a model without one ends its rows without it
    seqs, starts, dropped = [], [], []
    for ex in examples:
        if ex.response is None:
            raise DataError(f"{ex.where}: no response to train on (generate them with --self-distill-answers).")
        p = lm.prompt_ids(ex.prompt)
        r = encode_literal(tok, ex.response) + (end if ex.complete else [])  # response text is content, never markup
        seq = (p + r)[:seq_len]
        if len(p) >= len(seq):
            dropped.append(f"{ex.where}: the prompt is {len(p)} tokens, no room for an answer token within "
                           f"--seq-len {seq_len}")
            continue
        seqs.append(seq)
        starts.append(len(p))
    if not seqs:
        first = f" (e.g. {dropped[0]})" if dropped else ""
        raise DataError(f"All {len(dropped)} examples were dropped: every prompt fills --seq-len {seq_len}{first}. "
                        "Raise --seq-len.")
    return seqs, starts, dropped


# ------------------------------------------------------------------------------ a run's sequences
@dataclass
class TrainData:
    """Tokenised training sequences: ``seqs[i]`` (prompt + response + EOS, cut at ``--seq-len``), the
    index ``starts[i]`` of its first response token, and the rows skipped (``"file:line: why"``)."""

    seqs: list[list[int]]
    starts: list[int]
    skipped: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


def mix_reference(examples: Sequence[Example], share: float, seed: int) -> list[Example]:
    """Swap a seeded ``share`` of the examples that carry a ``reference`` answer (rows written by
    :mod:`model.self_answers`) to train on that reference instead of the generated response."""
    if share <= 0:
        return list(examples)
    rng = random.Random(f"reference-{seed}")
    return [dataclasses.replace(ex, response=ex.reference, complete=True) if ex.reference and rng.random() < share
            else ex for ex in examples]


def prepare_data(cfg: Any, lm: Any, examples: Sequence[Example], accelerator: Any) -> TrainData:
    """Training sequences from the examples: the base model's own greedy answers first when
    ``--self-distill-answers N`` (generated batched by :mod:`model.self_answers` into
    ``OUTPUT/self_answers.jsonl``, on the main process; reused on a rerun), then the reference mix,
    then tokenisation (:func:`model.training.data.encode`)."""
    main = accelerator.is_main_process
    if cfg.self_distill_answers > 0:
        from .self_answers import as_examples, write_answers

        path = Path(cfg.output) / SELF_ANSWERS
        if main:
            unwrapped = accelerator.unwrap_model(lm.model)
            was_training = unwrapped.training
            unwrapped.eval()
            with accelerator.autocast():
                write_answers(lm, examples, path, limit=cfg.self_distill_answers, batch_size=cfg.answer_batch_size,
                              max_new_tokens=cfg.answer_max_new_tokens)
            unwrapped.train(was_training)
        accelerator.wait_for_everyone()
        rows = write_answers(lm, examples, path, limit=cfg.self_distill_answers, show_progress=False)
        examples = as_examples(rows, path)
    examples = mix_reference(examples, cfg.reference_share, cfg.seed)
    seqs, starts, dropped = encode(lm, examples, cfg.seq_len)
    if dropped and main:
        shown = "".join(f"\n  {d}" for d in dropped[:5]) + (f"\n  ... and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        print(f"note: {len(dropped)} of {len(examples)} examples skipped, their prompt fills --seq-len "
              f"{cfg.seq_len}:{shown}", file=sys.stderr)
    return TrainData(seqs, starts, dropped)


def batch_indices(step: int, micro: int, rank: int, cfg: Any, world: int, n: int) -> list[int]:
    """Example indices of one micro-batch on one process: a seeded permutation per epoch, consumed in
    order (global position ``step * per_step + (micro * world + rank) * batch_size``)."""
    per_step = cfg.batch_size * cfg.grad_accum * world
    start = step * per_step + (micro * world + rank) * cfg.batch_size
    out = []
    for g in range(start, start + cfg.batch_size):
        epoch, i = divmod(g, n)
        perm = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        out.append(int(perm[i]))
    return out
