"""MTP Lens: multi-token prediction via self-distillation (Kirchenbauer et al., arXiv 2602.06019).

Three parts, imports going one way (training and evaluation use the engine; the engine uses neither):

* :mod:`model.engine` — the inference engine: loading a checkpoint into a
  :class:`~model.engine.loaded_model.LoadedModel`, the strategies, the decoder (one
  :class:`~model.engine.decoding.PassRecord` per forward pass), the fast forward pass and its KV cache;
* :mod:`model.training` — online self-distillation: layout, objective, data, the trainer;
* :mod:`model.evaluation` — GSM8K accuracy against effective k, speed benchmarks, the lm-eval model.

The command-line tools are ``python -m model.generate`` (engine), ``model.train``,
``model.self_answers``, ``model.heldout`` (training), ``model.evaluate``, ``model.bench`` and
``model.lm_eval_mtp`` (evaluation). Every error class is in :mod:`model.errors`.
"""

import logging as _logging

# bitsandbytes (imported by transformers/peft) warns at import about optional CPU kernels we do not use.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)

from .engine.decoding import Decoder, DraftCheck, GenerationResult, PassRecord, generate, run  # noqa: E402
from .engine.loaded_model import LoadedModel  # noqa: E402
from .engine.loading import DEFAULT_SOURCE, load_checkpoint  # noqa: E402
from .engine.strategies import (  # noqa: E402
    Strategy,
    confadapt,
    parse_strategies,
    resolve_strategy,
    standard,
    static_k,
    verify,
)
from .errors import CheckpointError, ContextBudgetError, NonFiniteLogitsError  # noqa: E402

__all__ = [
    "DEFAULT_SOURCE", "CheckpointError", "LoadedModel", "load_checkpoint", "ContextBudgetError", "Decoder",
    "DraftCheck", "GenerationResult", "NonFiniteLogitsError", "PassRecord", "generate", "run", "Strategy", "confadapt",
    "parse_strategies", "resolve_strategy", "standard", "static_k", "verify",
]
