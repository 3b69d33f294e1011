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
import os as _os

# Our kernels run their own thread pool beside torch's OpenMP team. By default an OpenMP worker spins for a while
# after each parallel torch op (a softmax over the vocabulary, a dtype conversion of the logits), and on a machine
# with as many threads as cores it took the core our pool's worker needed: SmolLM2 bf16 at 2 threads on 2 cores
# decoded 60 tokens/s with spinning, 128 with passive waiting (94 at one thread). Set before torch loads libgomp
# (an explicit OMP_WAIT_POLICY wins; a program that imported torch first keeps its policy).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
