"""Fixtures and helpers shared by the app's tests: the registry holding the real default model, a
registry of tiny random models, running a turn to its end, a free loopback port."""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from app.registry import ModelRegistry
from app.turn import run_turn
from model.errors import RequestError
from model.engine.loading import wrap_model
from model.errors import CheckpointError
from tests.conftest import make_tiny

N_NEW = 12
PROMPT = "What is 7 times 8? Answer with the number."
FP32 = ("smollm2-135m", "none", "float32")


@pytest.fixture(scope="session")
def registry():
    """A registry holding the default model (SmolLM2 + adapter), loaded once for the session (integration)."""
    reg = ModelRegistry()
    try:
        reg.get("smollm2-135m")
    except RequestError as e:
        pytest.skip(f"default model unavailable: {e}")
    return reg


@pytest.fixture(scope="session")
def lm(registry):
    return registry.get("smollm2-135m")


@pytest.fixture
def tiny_registry(base_tokenizer):
    """A registry whose every source is a fresh tiny random Llama (max 2048 positions), except ``missing``
    (refused as the engine refuses a path that does not exist) and ``nan`` (NaN weights)."""
    def loader(source, quantization=None, dtype=None):
        if source == "missing":
            raise CheckpointError("No such local model: missing.")
        tok = copy.deepcopy(base_tokenizer)
        model = make_tiny(tok)
        if source == "nan":
            with torch.no_grad():
                model.model.norm.weight.fill_(float("nan"))
        return wrap_model(model, tok, source=source)
    return ModelRegistry(loader=loader)


def finish(turn, should_stop=lambda: None):
    """Run a turn to its end; returns (states, last state)."""
    states = list(run_turn(turn, should_stop))
    return states, states[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
