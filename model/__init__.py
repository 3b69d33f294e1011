"""MTP engine: checkpoint loading, decoding strategies, training, evaluation (arXiv 2602.06019)."""

import logging as _logging

# bitsandbytes (imported by transformers/peft) warns at import about optional CPU kernels we do not use.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)

from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from .decoding import (
    ContextBudgetError,
    Decoder,
    GenerationResult,
    NonFiniteLogitsError,
    PassRecord,
    generate,
    run,
)
from .strategies import (
    Strategy,
    confadapt,
    make_strategy,
    parse_strategies,
    parse_strategy,
    standard,
    static_k,
    verify,
)

__all__ = [
    "DEFAULT_SOURCE", "CheckpointError", "LoadedModel", "load_checkpoint", "ContextBudgetError", "Decoder",
    "GenerationResult", "NonFiniteLogitsError", "PassRecord", "generate", "run", "Strategy", "confadapt",
    "make_strategy", "parse_strategies", "parse_strategy", "standard", "static_k", "verify",
]
