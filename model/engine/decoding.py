"""MTP decoding, one forward pass at a time (paper 3.4 and 4.5).

A forward pass feeds, at ordinary consecutive positions with plain causal attention,

    pending real tokens  +  drafts  +  (k_max - 1) mask tokens

* **pending**: the tokens emitted but not yet in the KV cache (the prompt on the first pass);
* **drafts** (only :class:`~model.engine.strategies.Verify`): the previous pass's mask proposals, fed as
  real tokens so that this pass's logits check them;
* **masks**: the mask token, whose logits propose the tokens after the last real one.

:meth:`Decoder.run_pass` runs one forward pass through four phases, each a function below:

1. **propose** (:func:`propose`): greedy token and confidence (top-1 probability, float32, the
   mask token excluded) at the last pending token, at each draft and at each mask;
2. **accept** (the strategy's :meth:`~model.engine.strategies.Strategy.accept_pass`, rules in
   :mod:`model.engine.acceptance`): block strategies keep a leading run of the block ``[greedy at the
   last real token, mask proposals...]`` (:meth:`Strategy.accept`), cut where a proposal cannot
   continue an open UTF-8 character (:func:`cut_broken_utf8`); verification keeps the drafts equal
   to the model's greedy choice, then the model's own next token (:func:`accept_drafts`);
3. **trim** (:func:`trim`, :func:`cut_at_stop_string`): up to and including the first stop token (or
   the token that completes a stop string), never past ``max_new_tokens``;
4. **commit** (:func:`commit`): crop the KV cache back to the real tokens that stay valid (never a
   mask, never a rejected draft; what stays is the strategy's :meth:`~model.engine.strategies.Strategy.cached_after`);
   the decoder then records the pass in a :class:`PassRecord`.

Invariant after every pass: the cache holds exactly ``cached_ids`` and ``cached_ids + pending ==
prompt + generated``. The app, the evaluation and the benchmark consume pass records only. The phases live in
:mod:`model.engine.phases`, the records in :mod:`model.engine.records` (both also importable from here).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import torch

from ..errors import NonFiniteLogitsError
from .loaded_model import LoadedModel
from .acceptance import Acceptance, accept_drafts, cut_broken_utf8
from .phases import (PassLayout, check_context_budget, check_finite, commit, cut_at_stop_string, lay_out, propose, sync,
                     trim)
from .records import DraftCheck, DraftTally, GenerationResult, PassRecord, acceptance_by_position  # noqa: F401
from .sampling import GREEDY, Sampling, TokenSampler, model_distribution
from .strategies import Strategy, check_max_new_tokens
from .text import open_utf8_bytes, text_bytes

__all__ = ["Decoder", "run", "generate", "hf_generate", "PREFILL_CHUNK", "PassRecord", "GenerationResult",
           "acceptance_by_position", "PassLayout", "Acceptance", "lay_out", "propose",
           "accept_drafts", "trim", "commit", "cut_at_stop_string", "cut_broken_utf8", "check_context_budget",
           "check_finite", "sync"]


#: Prompt tokens per chunk of a chunked prefill (:meth:`Decoder.prefill_chunk`): SmolLM2-135M in bf16 on one CPU
#: thread computes one in ~0.3 s, so Stop waits at most about that long.
PREFILL_CHUNK = 256


class Decoder:
    """Iterator over the forward passes of one generation (batch size 1).

    Usage::

        dec = Decoder(lm, lm.prompt_ids("What is 2+2?"), confadapt(0.9, 16), max_new_tokens=128)
        for record in dec:   # one PassRecord per forward pass
            print(record.text, end="")
        dec.result()         # GenerationResult

    Args:
        lm: the loaded model.
        prompt_ids: the prompt, ``prompt_len`` token ids (``lm.prompt_ids(...)``).
        strategy: from :mod:`model.engine.strategies`.
        max_new_tokens: exact upper bound on generated tokens.
        sampling: temperature, top-k, top-p, seed (:mod:`model.engine.sampling`); None or temperature 0:
            greedy decoding.
        prefix: ``(cache, ids)``: a KV cache of this model holding ``ids`` (an earlier generation's
            :attr:`cached_ids`, e.g. the previous turn of a chat); its longest common prefix with the prompt is
            reused instead of computed again (prefix caching, as serving engines do). The cache becomes this
            decoder's (cropped).
        width: for ``verify:auto``, the :class:`~model.engine.width.AutoWidth` that chooses each pass's k_max and
            layout (default: :func:`~model.engine.width.auto_width` of the model, measured on first use).

    Raises (at construction):
        ValueError: empty prompt, bad max_new_tokens.
        ContextBudgetError: prompt + max_new_tokens + look-ahead beyond the model's positions.
    """

    def __init__(self, lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128,
                 sampling: Sampling | None = None, prefix: tuple[Any, Sequence[int]] | None = None,
                 width: Any = None):
        if len(prompt_ids) == 0:
            raise ValueError("The prompt is empty: nothing to condition on.")
        self.lm = lm
        self.strategy = strategy
        self.sampling = sampling or GREEDY
        self.sampler = None if self.sampling.greedy else TokenSampler(self.sampling.seed)
        self.draft_probs: torch.Tensor | None = None
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.prompt_ids = [int(t) for t in prompt_ids]
        check_context_budget(lm, len(self.prompt_ids), self.max_new_tokens, strategy)
        self.cache = lm.new_cache()
        self.cached_ids: list[int] = []
        self.pending: list[int] = list(self.prompt_ids)
        self.drafts: list[int] = []
        self.generated: list[int] = []
        self.passes: list[PassRecord] = []
        #: this generation's drafts proposed and accepted by position so far (verify:auto chooses its layout by them)
        self.drafts_seen = DraftTally()
        self.done = False
        self._text = ""
        self._stop = set(lm.stop_token_ids)
        self._prefill_seconds = 0.0  # prompt chunks fed before the first pass (prefill_chunk), and their tokens
        self._prefilled = 0
        self._reused = 0
        if prefix is not None:
            self._reuse(*prefix)
        #: verify:auto: the width policy (:class:`~model.engine.width.AutoWidth`; measured for the model when not
        #: given), and the rows other sequences put in this decoder's last shared pass and the tokens they emitted
        #: there (set by a batch runner).
        self.width = width
        self.other_rows = 0
        self.other_tokens = 0.0

    def _reuse(self, cache: Any, cache_ids: Sequence[int]) -> None:
        """Start from a KV cache that holds ``cache_ids`` (a previous generation's :attr:`cached_ids` on the same
        model): it is cropped to the longest common prefix of ``cache_ids`` and the prompt (at most all but the
        prompt's last token, which the first pass feeds) and the rest of the prompt stays pending. A cache of
        another kind or length, or with nothing in common, is not used."""
        fresh = self.cache
        if type(cache) is not type(fresh) or getattr(cache, "engine", None) is not getattr(fresh, "engine", None):
            return
        held = cache.get_seq_length()
        if held != len(cache_ids):
            return
        n, limit = 0, min(len(cache_ids), len(self.prompt_ids) - 1)
        while n < limit and int(cache_ids[n]) == self.prompt_ids[n]:
            n += 1
        if n == 0:
            return
        if held > n:
            cache.crop(-(held - n))
        self.cache, self.cached_ids, self.pending = cache, self.prompt_ids[:n], self.prompt_ids[n:]
        self._reused = n

    @property
    def reused(self) -> int:
        """Prompt tokens whose KV entries came from a previous generation's cache (``prefix``), not computed."""
        return self._reused

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to feed before the first pass (its last token always goes with that pass)."""
        return 0 if self.passes else max(0, len(self.pending) - 1)

    @torch.inference_mode()
    def prefill_chunk(self, max_tokens: int = PREFILL_CHUNK) -> int:
        """Feed up to ``max_tokens`` of the prompt into the KV cache without proposing (chunked prefill): a caller
        that polls between chunks (Stop) waits at most one chunk. The chunks' seconds and tokens count in the
        first pass's record (it is the prefill).

        Returns:
            The prompt tokens still to feed before the first pass (:attr:`prefill_left`).
        """
        n = min(int(max_tokens), self.prefill_left)
        if n <= 0:
            return 0
        lm, chunk = self.lm, self.pending[:n]
        sync(lm.device)
        t0 = time.perf_counter()
        lm.forward(torch.tensor([chunk], dtype=torch.long, device=lm.device), self.cache, num_masks=0,
                   logits_to_keep=1)  # no torch work on logits here: the kernels' forward_batch is serial itself
        sync(lm.device)
        self._prefill_seconds += time.perf_counter() - t0
        self._prefilled += n
        self.cached_ids.extend(chunk)
        self.pending = self.pending[n:]
        return self.prefill_left

    def __iter__(self) -> Iterator[PassRecord]:
        while not self.done:
            yield self.run_pass()

    @torch.inference_mode()
    def run_pass(self) -> PassRecord:
        """Run one forward pass (propose, accept, trim, commit) and return its record.

        Raises:
            StopIteration: the generation is done.
            NonFiniteLogitsError: the pass produced NaN / infinite logits (the decoder stops).
        """
        if self.done:
            raise StopIteration
        lm = self.lm
        with lm.engine_step(self.cache):
            layout = self.next_layout()
            sync(lm.device)
            t0 = time.perf_counter()
            logits = lm.forward_batch([self.pass_input(layout)])[0]
            return self.finish_pass(layout, logits, t0)

    def pass_input(self, layout: PassLayout) -> Any:
        """This sequence's :class:`~model.engine.backend.PassInput` for ``layout`` (its KV cache): what
        :meth:`run_pass` and a batch runner feed :meth:`~model.engine.loaded_model.LoadedModel.forward_batch`."""
        return self.lm.pass_input(torch.tensor(layout.tokens, dtype=torch.long), self.cache, layout.num_masks,
                                  layout.logits_to_keep, layout.positions, layout.visible)

    def next_layout(self) -> PassLayout:
        """What the next forward pass feeds (:class:`PassLayout`): the pending tokens, the drafts and the mask
        blocks. A batch runner (:mod:`model.engine.batch`) feeds it with other sequences' rows, then calls
        :meth:`finish_pass` with this sequence's logits."""
        strategy = self.strategy
        if getattr(strategy, "auto", False):
            strategy = self._auto_layout(strategy)
        return lay_out(self.pending, self.drafts[:strategy.num_masks], strategy, self.lm.mask_token_id)

    def _auto_layout(self, strategy: Any) -> Strategy:
        """``verify:auto``: this pass's fixed layout, from the width policy, the rows beside it and the acceptance
        this generation has seen so far (lossless whatever it is)."""
        if self.width is None:
            from .width import auto_width

            self.width = auto_width(self.lm)
        seen = self.drafts_seen
        acc = self.width.acceptance_for(seen.by_position(), seen.passes_with_drafts)
        k, blocks = self.width.choose(strategy.k_max, self.other_rows, acc, self.other_tokens)
        return strategy.at(k, blocks)

    @torch.inference_mode()
    def finish_pass(self, layout: PassLayout, logits: torch.Tensor, t0: float) -> PassRecord:
        """Accept, trim and commit one pass from its logits (``[layout.logits_to_keep, V]``), the KV cache
        already extended by the pass; ``t0``: ``time.perf_counter()`` when the pass started. Returns its record.

        Raises:
            NonFiniteLogitsError: the pass produced NaN / infinite logits (the decoder stops).
        """
        lm, s, drafts = self.lm, self.strategy, self.drafts[:layout.drafts]  # verify:auto may feed fewer
        draft_probs = None if self.draft_probs is None else self.draft_probs[:layout.drafts]
        try:
            if self.sampler is None:
                greedy, conf = propose(logits, lm.mask_token_id, lm.backend_of(self.cache))
            else:
                logits = check_finite(logits.float())
                probs = self.sampling.probabilities(logits, lm.mask_token_id)
                model_probs = model_distribution(logits, lm.mask_token_id)
        except NonFiniteLogitsError:
            self.done = True
            raise
        if self.sampler is None:
            acc = s.accept_pass(lm, self.generated, layout, greedy, conf, drafts)
        else:
            greedy, conf, acc = s.accept_pass_sampled(lm, self.generated, layout, probs, model_probs, drafts,
                                                      draft_probs, self.sampler)
        kept, reason, stopped = trim(acc.kept, acc.reason, self.max_new_tokens - len(self.generated), self._stop)
        cut = cut_at_stop_string(lm, self.generated, kept)
        if cut is not None:
            kept, reason, stopped = kept[:cut], "stop string", True
        in_cache = s.cached_after(kept)
        commit(self.cache, len(layout.tokens), len(self.pending), in_cache)
        sync(lm.device)
        seconds = time.perf_counter() - t0
        if not self.passes:  # the prefill's chunks (prefill_chunk) belong to the first pass
            seconds += self._prefill_seconds

        self.cached_ids.extend(self.pending + in_cache)
        self.generated.extend(kept)
        self.pending = s.pending_after(kept)
        self.done = stopped or len(self.generated) >= self.max_new_tokens
        self.drafts = [] if self.done else acc.next_drafts
        self.draft_probs = None if self.done else acc.next_draft_probs
        rec = self._record(layout, drafts, greedy, conf, acc, kept, reason, stopped, seconds)
        self.passes.append(rec)
        self.drafts_seen.add(rec)
        return rec

    def _record(self, layout: PassLayout, drafts: Sequence[int], greedy: Sequence[int], conf: Sequence[float],
                acc: Acceptance, kept: list[int], reason: str, stopped: bool, seconds: float) -> PassRecord:
        """The pass's :class:`PassRecord`. ``proposals`` are the model's token after the last fed draft and
        the proposals of the block that follows it (the whole block for block strategies); ``verification`` is the
        strategy's :meth:`~model.engine.strategies.Strategy.draft_check`."""
        decode = self.lm.decode_ids
        d, m = layout.drafts, layout.masks_per_block
        blocks = [list(greedy[d + 1 + i * m : d + 1 + (i + 1) * m]) for i in range(len(layout.blocks))]
        block_conf = [list(conf[d + 1 + i * m : d + 1 + (i + 1) * m]) for i in range(len(layout.blocks))]
        last = layout.blocks.index(d) if d in layout.blocks else None
        proposals = [greedy[d]] + (blocks[last] if last is not None else [])
        confidences = [conf[d]] + (block_conf[last] if last is not None else [])
        return PassRecord(
            index=len(self.passes), shared_rows=len(layout.tokens),
            fed_real=layout.pending + (self._prefilled if not self.passes else 0),
            fed_masks=layout.num_masks, proposals=proposals,
            proposal_texts=[decode([t]) for t in proposals], confidences=confidences, kept=kept,
            text=self._text_delta(), accepted=len(acc.kept), seconds=seconds, stopped=stopped, block_end=reason,
            fed_drafts=d, verification=self.strategy.draft_check(layout, drafts, greedy, conf, acc, blocks, block_conf,
                                                                 self.drafts, decode),
        )

    def _text_delta(self) -> str:
        """The text added since the last pass; an incomplete last character is held back (and dropped
        at the end of the answer: never shown as U+FFFD)."""
        text = self.lm.tokenizer.decode(self.generated, skip_special_tokens=True)
        if open_utf8_bytes(text_bytes(self.lm.token_bytes, self.generated[-4:])) and text.endswith("\ufffd"):
            text = text[:-1]
        delta = text[len(self._text):] if text.startswith(self._text) else text
        self._text = text
        return delta

    def result(self) -> GenerationResult:
        """Totals so far (complete once iteration has ended)."""
        sampling = self.sampling.to_dict()
        if self.sampler is not None:
            sampling["seed"] = self.sampler.seed
        return GenerationResult(text=self._text, token_ids=list(self.generated), passes=list(self.passes),
                                strategy=self.strategy.spec, sampling=sampling)


def run(lm: LoadedModel, prompt_ids: Sequence[int], strategy: Strategy, max_new_tokens: int = 128,
        sampling: Sampling | None = None) -> GenerationResult:
    """Decode to the end from prompt ids and return the totals (greedy unless ``sampling`` says otherwise).

    Raises:
        ValueError, ContextBudgetError: as :class:`Decoder`.
        NonFiniteLogitsError: a pass produced NaN / infinite logits.
    """
    dec = Decoder(lm, prompt_ids, strategy, max_new_tokens, sampling)
    for _ in dec:
        pass
    return dec.result()


def generate(
    lm: LoadedModel, prompt: str | Sequence[dict], strategy: Strategy, max_new_tokens: int = 128,
    sampling: Sampling | None = None,
) -> GenerationResult:
    """Run one generation from a user message or a messages-format chat history.

    Raises:
        ValueError: empty prompt, bad max_new_tokens; ContextBudgetError, NonFiniteLogitsError.
    """
    return run(lm, lm.prompt_ids(prompt), strategy, max_new_tokens, sampling)


def hf_generate(lm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int,
                sampling: Sampling | None = None) -> list[int]:
    """Reference: transformers ``generate`` greedy (``do_sample=False``), new ids only; with ``sampling`` at a
    temperature above 0, transformers' own sampling with the same temperature, top-k and top-p (seeded with
    ``torch.manual_seed`` when a seed is given): a baseline for speed, not the same draws as ours.

    Uses the same stop tokens (none: runs to ``max_new_tokens``); the mask token is suppressed as in
    our loop.
    """
    sampling = sampling or GREEDY
    if sampling.greedy:
        how: dict = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        how = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    stop = list(lm.stop_token_ids) or None
    pad = lm.tokenizer.pad_token_id
    if pad is None:
        pad = stop[0] if stop else 0
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=stop,
            pad_token_id=pad, suppress_tokens=[lm.mask_token_id], **how,
        )
    return out[0, ids.shape[1]:].tolist()
