"""Many sequences, one forward pass: a ragged batch of decoders on our CPU kernels.

A pass over the weights costs about the same for a few rows as for one, so the next rows of several
generations can share it: each :class:`~model.engine.decoding.Decoder` keeps its own strategy (standard,
static k, ConfAdapt, verify with any layout), prompt, KV cache, position and ``max_new_tokens``; a step of
:class:`BatchRunner` concatenates every active decoder's next :class:`~model.engine.decoding.PassLayout`, runs
them as one pass (:meth:`model.engine.loaded_model.LoadedModel.forward_batch` on our kernels: each row attends to its
own sequence's cache and its own pass's rows, tree masks included), then hands each decoder its logits to
accept, trim and commit as it would alone. Because every row of our kernels has the bits of a one-row pass,
each generation's records (kept tokens, proposals, confidences) are identical to running it alone.

Joining and leaving happen between passes. A new decoder's prefill joins the next shared pass whole (its
prompt rows beside the others' few rows: one pass slower for everyone instead of a pass of its own for it);
``max_rows`` caps the rows of a pass, and decoders beyond it (or beyond ``max_sessions``) wait in order, a
prompt longer than the cap runs in a pass of its own. :meth:`BatchRunner.stop` takes a decoder out before the
next pass and touches no other; a decoder whose pass fails (non-finite logits) ends alone with its error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import NonFiniteLogitsError
from .decoding import Decoder, PassRecord, sync

#: Default cap on the rows of one shared pass (the kernels stay row-exact at any count; the cost grows).
MAX_ROWS = 64
#: Default cap on decoders sharing a pass.
MAX_SESSIONS = 16


@dataclass
class StepResult:
    """What one shared pass did.

    Attributes:
        records: each decoder that ran its pass -> its :class:`PassRecord`: ``seconds`` is the whole shared pass
            (what each member waited for), ``shared_sequences`` / ``shared_rows`` say what it carried.
        errors: each decoder whose pass failed -> the exception (it is done; the others went on).
        rows: rows of the shared forward pass (all decoders' together).
        seconds: wall-clock seconds of the shared pass.
    """

    records: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    rows: int = 0
    seconds: float = 0.0


class BatchRunner:
    """Run the next passes of several decoders as one forward pass (module docstring).

    Args:
        lm: the :class:`~model.engine.loaded_model.LoadedModel` every decoder uses; its forward pass must run on
            our kernels (``lm.backend().shares_passes``).
        max_rows: most rows in one shared pass (a single decoder's pass may exceed it, alone).
        max_sessions: most decoders in one shared pass.

    Raises:
        ValueError: the model does not run on our kernels, or a cap below 1.
    """

    def __init__(self, lm, max_rows: int = MAX_ROWS, max_sessions: int = MAX_SESSIONS):
        engine = lm.backend()
        if not engine.shares_passes:
            raise ValueError(f"batched passes need our CPU kernels; this model runs on {lm.forward_path}")
        if max_rows < 1 or max_sessions < 1:
            raise ValueError("max_rows and max_sessions must be at least 1")
        self.lm, self.engine = lm, engine
        self.max_rows, self.max_sessions = max_rows, max_sessions
        self.decoders: list[Decoder] = []  # active and waiting, in arrival order
        self.errors: dict[Decoder, Exception] = {}

    def add(self, decoder: Decoder) -> None:
        """Let ``decoder`` join from the next pass (it waits while the caps are full).

        Raises:
            ValueError: a decoder of another model, or one whose cache is not this engine's.
        """
        if decoder.lm.model is not self.lm.model or getattr(decoder.cache, "engine", None) is not self.engine:
            raise ValueError("the decoder belongs to another model (or was made before the kernels were built)")
        if decoder not in self.decoders and not decoder.done:
            self.decoders.append(decoder)

    def stop(self, decoder: Decoder) -> None:
        """Take ``decoder`` out before the next pass (marked done; no other decoder is touched)."""
        if decoder in self.decoders:
            self.decoders.remove(decoder)
        decoder.done = True

    @property
    def pending(self) -> int:
        """Decoders still to finish."""
        return sum(1 for d in self.decoders if not d.done)

    def _pick(self) -> list[tuple[Decoder, object]]:
        """The decoders of the next pass and their layouts: in arrival order while the caps allow."""
        chosen, rows = [], 0
        for d in self.decoders:
            if d.done:
                continue
            layout = d.next_layout()
            n = len(layout.tokens)
            if chosen and (rows + n > self.max_rows or len(chosen) >= self.max_sessions):
                continue  # waits for a later pass; smaller layouts behind it may still fit
            chosen.append((d, layout))
            rows += n
            if len(chosen) >= self.max_sessions:
                break
        return chosen

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One shared forward pass of the decoders the caps admit; finished decoders leave.

        Returns:
            A :class:`StepResult` (empty when no decoder is left).
        """
        chosen = self._pick()
        result = StepResult()
        if not chosen:
            self.decoders = [d for d in self.decoders if not d.done]
            return result
        with self.lm.engine_step(chosen[0][0].cache):
            inputs = [d.pass_input(layout) for d, layout in chosen]
            sync(self.lm.device)
            t0 = time.perf_counter()
            outs = self.lm.forward_batch(inputs)
            for (d, layout), logits in zip(chosen, outs):
                try:
                    result.records[d] = d.finish_pass(layout, logits, t0)
                except NonFiniteLogitsError as e:
                    d.done = True
                    result.errors[d] = self.errors[d] = e
        result.rows = sum(len(layout.tokens) for _, layout in chosen)
        result.seconds = time.perf_counter() - t0
        emitted = sum(len(r.kept) for r in result.records.values())
        for d, layout in chosen:  # what verify:auto weighs its next pass's rows against
            d.other_rows = result.rows - len(layout.tokens)
            d.other_tokens = float(emitted - (len(result.records[d].kept) if d in result.records else 0))
        for rec in result.records.values():  # every member waited for the whole shared pass
            rec.seconds, rec.shared_sequences, rec.shared_rows = result.seconds, len(chosen), result.rows
        self.decoders = [d for d in self.decoders if not d.done]
        return result

    def __iter__(self) -> Iterator[StepResult]:
        """Steps until every decoder is done."""
        while self.pending:
            yield self.step()

    def run(self) -> list[StepResult]:
        """Run every decoder to its end; returns the steps."""
        return list(self)
