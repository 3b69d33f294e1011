"""MTP engine: checkpoint loading, decoding strategies, training, evaluation (arXiv 2602.06019)."""

import logging as _logging

# bitsandbytes (imported by transformers/peft) warns at import about optional CPU kernels we do not use.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)

from .checkpoint import DEFAULT_SOURCE, CheckpointError, LoadedModel, load_checkpoint
from .decoding import (
    Decoder,
    GenerationResult,
    PassRecord,
    Strategy,
    confadapt,
    generate,
    make_strategy,
    parse_strategy,
    standard,
    static_k,
)

__all__ = [
    "DEFAULT_SOURCE", "CheckpointError", "LoadedModel", "load_checkpoint", "Decoder", "GenerationResult",
    "PassRecord", "Strategy", "confadapt", "generate", "make_strategy", "parse_strategy", "standard", "static_k",
]
