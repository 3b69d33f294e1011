"""lm-eval-harness model ``mtp``: ``generate_until`` with our MTP decoding (paper 3.4 / 4.5).

lm-eval 0.4.13 discovers models only from its own registry (no plugin entry points, and
``--include_path`` adds tasks, not models), so the model is registered with
``register_model("mtp")`` when this module is imported. Run the harness through ``python -m
model.lm_eval_mtp``, which imports this module and hands the command line to lm-eval's own CLI.
From Python: ``import model.evaluation.lm_eval_model`` and then ``lm_eval.simple_evaluate(model="mtp",
model_args=..., ...)`` or pass an :class:`MTPLM` instance. The plain ``lm_eval`` executable does
not know ``mtp``.

Model arguments (``--model_args``): :data:`MODEL_ARGS_HELP`. Effective k is logged after every
``generate_until`` call, kept in :attr:`MTPLM.stats`, and printed on stderr by this CLI wrapper at the end of
the run.

``loglikelihood`` and ``loglikelihood_rolling`` score with the base model (adapter off): one
token per forward pass is what next-token log-likelihoods mean, so MTP does not apply.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..engine.decoding import Decoder
from ..engine.loaded_model import LoadedModel
from ..engine.loading import DEFAULT_SOURCE, load_checkpoint, trained_k_max
from ..engine.sampling import GREEDY, Sampling, for_request, parse_sampling
from ..engine.scoring import teacher_logprob
from ..engine.strategies import DEFAULT_K_MAX, check_max_new_tokens, resolve_strategy
from ..engine.text import chat_prompt_ids, encode_literal
from .accuracy import draft_metrics

log = logging.getLogger(__name__)

#: ``--model_args`` of the ``mtp`` model, one per line (``python -m model.lm_eval_mtp --help`` prints it).
MODEL_ARGS_HELP = """\
  pretrained   a checkpoint: smollm2-135m (default), a local folder, a .gguf file or a hub id
  strategy     confadapt (default), static, verify, standard, or a spec such as confadapt:0.7:4
  tau          ConfAdapt's threshold (default 0.9)
  k_max        tokens per forward pass at most (default: the adapter's, else 16)
  k            static k's block size (default 3)
  max_gen_toks most new tokens per request (default 256)
  device       auto (default: CUDA when present, else the CPU), cpu, cuda, cuda:N
  dtype        auto (default), bfloat16, float32, ...
  adapter      true (default) / false: the base model without its MTP adapter
  stats_file   a JSON path for the decoding totals (effective k, tokens/s)
  seed         the first sampled request's seed (request i uses seed + i; tasks that sample), default 0
"""

#: The instances created in this process (the CLI wrapper prints their totals at the end).
INSTANCES: list["MTPLM"] = []


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


class MTPLM(LM):
    """lm-eval model that generates with standard, static-k or ConfAdapt MTP decoding.

    Args:
        pretrained: a model source (str) or an already loaded :class:`LoadedModel`.
        strategy: a name (``"confadapt"`` default, ``"static"``, ``"verify"``, ``"standard"``) or a
            spec (:func:`~model.engine.strategies.resolve_strategy`).
        tau: ConfAdapt's threshold in [0, 1] (default 0.9).
        k_max: proposals per forward pass (ConfAdapt, verify); default: the adapter's trained
            k_max, else :data:`~model.engine.strategies.DEFAULT_K_MAX`.
        k: block size for static k (default 3).
        max_gen_toks: default cap on generated tokens (a task's ``max_gen_toks`` wins).
        device, dtype, adapter: passed to :func:`load_checkpoint` (``device=None`` -> auto).
        stats_file: where to write :attr:`stats` as JSON after each ``generate_until`` call.
        batch_size, max_batch_size: accepted for the harness's CLI; decoding is batch size 1.
        seed: the first sampled request's seed (request ``i`` uses ``seed + i``), when a task samples
            (``do_sample`` / ``temperature`` in its ``gen_kwargs``).

    Attributes:
        stats: ``{"requests", "new_tokens", "forward_passes", "effective_k" (= "mean_acceptance_length"),
            "seconds", "tokens_per_second", "strategy"}`` accumulated over all ``generate_until`` requests,
            and for lossless verification ``"draft_acceptance_rate"`` and ``"acceptance_by_position"``.

    Raises:
        ValueError: bad strategy parameters or max_gen_toks; CheckpointError for bad sources.
    """

    def __init__(
        self,
        pretrained: str | LoadedModel = DEFAULT_SOURCE,
        strategy: str = "confadapt",
        tau: float | None = None,
        k_max: int | None = None,
        k: int | None = None,
        max_gen_toks: int = 256,
        device: str | None = None,
        dtype: str = "auto",
        adapter: bool | str = True,
        stats_file: str | None = None,
        batch_size: Any = 1,
        max_batch_size: Any = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise ValueError(f"Unknown model_args for mtp: {', '.join(sorted(kwargs))}.")
        default_k_max = (pretrained.default_k_max if isinstance(pretrained, LoadedModel)
                         else trained_k_max(str(pretrained), adapter=_bool(adapter)) or DEFAULT_K_MAX)
        self.strategy = resolve_strategy(strategy, tau=tau, k_max=k_max, k=k, default_k_max=default_k_max)
        self.max_gen_toks = check_max_new_tokens(max_gen_toks)  # bad arguments fail before loading
        if isinstance(pretrained, LoadedModel):
            self.lm = pretrained
        else:
            if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
                device = "cpu"  # the harness passes --device verbatim
            self.lm = load_checkpoint(str(pretrained), device=device or "auto", dtype=dtype, adapter=_bool(adapter))
        self._device = self.lm.device
        self._rendered: dict[str, list[int]] = {}
        self.stats_file = stats_file
        self.seed = int(seed)
        self.stats: dict[str, Any] = {"strategy": self.strategy.spec, "requests": 0, "new_tokens": 0,
                                      "forward_passes": 0, "effective_k": 0.0, "mean_acceptance_length": 0.0,
                                      "seconds": 0.0, "tokens_per_second": 0.0}
        self._drafts: list[list[int]] = []
        for note in self.lm.warnings:
            log.warning(note)
        INSTANCES.append(self)

    # ------------------------------------------------------------------ harness hooks
    @property
    def tokenizer_name(self) -> str:
        """Tokenizer name, for the harness's request cache."""
        return str(getattr(self.lm.tokenizer, "name_or_path", self.lm.source)).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (used by ``--apply_chat_template``)."""
        return getattr(self.lm.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Format a chat history with the model's chat template. The harness wants text; the ids of
        that text, with each message's content tokenised literally (:func:`model.engine.text.chat_prompt_ids`),
        are remembered so that :meth:`_encode` never turns task text into special tokens."""
        tok = self.lm.tokenizer
        text = tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)
        self._rendered[text] = chat_prompt_ids(tok, list(chat_history), add_generation_prompt)
        return text

    def _encode(self, text: str) -> list[int]:
        """Ids of a context: a chat this model rendered (its remembered ids), else the text taken
        literally (task text is content, never markup), after the BOS for ``bos_newlines`` models."""
        if text in self._rendered:
            return list(self._rendered[text])
        return self.lm.literal_ids(text)

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generation with the configured MTP strategy, one request at a time.

        Each request's ``args`` is ``(context, gen_kwargs)``; ``gen_kwargs["until"]`` (str or
        list) cuts the text at the first stop string; ``max_gen_toks`` caps new tokens; ``do_sample``,
        ``temperature``, ``top_p`` and ``top_k`` sample as transformers would (:meth:`_sampling`; greedy
        otherwise). Updates :attr:`stats` (effective k =
        generated tokens / forward passes, prefill included).
        """
        from tqdm import tqdm

        out: list[str] = []
        for req in tqdm(requests, disable=disable_tqdm, desc="mtp generate_until"):
            context, gen_kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            sampling = self._sampling(gen_kwargs, self.stats["requests"])
            ids = self._encode(context) or [self._prefix_id()]
            dec = Decoder(self.lm, ids, self.strategy, max_new, sampling)
            text = ""
            t0 = time.perf_counter()
            for rec in dec:
                text += rec.text
                if until and any(u in text for u in until):
                    break
            res = dec.result()
            text = res.text
            for u in until:
                if u and u in text:
                    text = text.split(u, 1)[0]
            self._drafts += [list(p.counted_drafts) for p in res.passes if p.fed_drafts]
            self._account(res.new_tokens, res.forward_passes, time.perf_counter() - t0)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        log.info("mtp %s: %d requests, effective k %.3f (%d tokens / %d forward passes), %.1f tokens/s",
                 self.strategy.spec, self.stats["requests"], self.stats["effective_k"], self.stats["new_tokens"],
                 self.stats["forward_passes"], self.stats["tokens_per_second"])
        self._write_stats()
        return out

    def _sampling(self, gen_kwargs: dict, index: int) -> Sampling:
        """The request's sampling settings from the task's ``gen_kwargs``, as transformers reads them: sampling
        when ``do_sample`` is true (at ``temperature``, default 1) or, without ``do_sample``, when ``temperature``
        > 0; ``top_p`` and ``top_k`` apply then. Request ``index`` uses the seed ``seed + index`` (model arg).

        Raises:
            ValueError: a setting out of range (:func:`~model.engine.sampling.parse_sampling`).
        """
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        do_sample = gen_kwargs.get("do_sample")
        if do_sample is not None and not _bool(do_sample):
            return GREEDY
        if _bool(do_sample) and temperature == 0:
            temperature = 1.0
        if temperature <= 0:
            return GREEDY
        return for_request(parse_sampling(temperature, gen_kwargs.get("top_p"), gen_kwargs.get("top_k"),
                                          self.seed), index)

    def _account(self, tokens: int, passes: int, seconds: float) -> None:
        s = self.stats
        s["requests"] += 1
        s["new_tokens"] += tokens
        s["forward_passes"] += passes
        s["seconds"] += seconds
        s["effective_k"] = s["mean_acceptance_length"] = s["new_tokens"] / s["forward_passes"] if s["forward_passes"] else 0.0
        s["tokens_per_second"] = s["new_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        s.update(draft_metrics(self._drafts))

    def _write_stats(self) -> None:
        if self.stats_file:
            p = Path(self.stats_file)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(self.stats, indent=1, allow_nan=False))

    # ------------------------------------------------------------------ likelihoods
    def _prefix_id(self) -> int:
        """The token that stands for an empty context: BOS, else the first stop token.

        Raises:
            ValueError: the model has neither (an empty context cannot be scored).
        """
        tok = self.lm.tokenizer
        if tok.bos_token_id is not None:
            return tok.bos_token_id
        if self.lm.stop_token_ids:
            return self.lm.stop_token_ids[0]
        raise ValueError("This model has neither a BOS nor an EOS token: a request with an empty context "
                         "cannot be scored or generated.")

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), is_greedy)`` per request, under the base model (adapter off).

        The context and continuation are encoded separately (the continuation keeps its
        leading space); an empty context is replaced by the BOS (or EOS) token.
        """
        out = []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            ctx = self._encode(context) if context else [self._prefix_id()]
            cont = encode_literal(self.lm.tokenizer, continuation)
            res = teacher_logprob(self.lm, ctx, cont)
            self.cache_hook.add_partial("loglikelihood", req.args, res)
            out.append(res)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Full-text log-likelihood per request (rolling windows of the model's context length)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        max_len = self.lm.max_positions or 2048
        out = []
        for req in requests:
            ids = encode_literal(self.lm.tokenizer, req.args[0])
            total = 0.0
            for window in get_rolling_token_windows(ids, self._prefix_id(), max_len, 1):
                ctx, cont = make_disjoint_window(window)
                total += teacher_logprob(self.lm, list(ctx), list(cont))[0]
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out


register_model("mtp")(MTPLM)
