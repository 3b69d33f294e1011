"""The request (app/requests.py, app/registry.py): validation with the value named in the user's words, the
app's limits, history forms, invisible input, registry keys, and a hub id without the Hub failing at once."""

from __future__ import annotations

import threading

import pytest

from app.registry import ModelRegistry
from app.requests import APP_MAX_K_MAX, APP_MAX_NEW_TOKENS, TurnRequest, parse_history
from app.turn import prepare_turn
from model.errors import RequestError
from tests.app.conftest import finish


# ------------------------------------------------------------------ validation
@pytest.mark.integration
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(message=""), "The message is empty"),
        (dict(message="   \n "), "The message is empty"),
        (dict(message="x" * 20_000), "The message is 20,000 characters long"),
        (dict(tau=1.5), "tau must be in [0, 1], got 1.5"),
        (dict(tau=-1), "tau must be in [0, 1], got -1"),
        (dict(tau="abc"), "tau must be a number in [0, 1], got 'abc'"),
        (dict(k_max=0), "k_max must be from 1 to 32, got 0"),
        (dict(k_max=33), "k_max must be from 1 to 32, got 33"),
        (dict(k_max=2.5), "k_max must be a whole number, got 2.5"),
        (dict(k_max="", strategy="lossless"), "k_max must be a whole number, got ''"),
        (dict(strategy="static k", k=33), "k must be from 1 to 32, got 33"),
        (dict(strategy="standard"), "The right pane needs an MTP strategy"),
        (dict(strategy="beam"), "Unknown strategy 'beam'"),
        (dict(max_new_tokens=0), "max new tokens must be from 1 to 1024, got 0"),
        (dict(max_new_tokens=100_000), "max new tokens must be from 1 to 1024, got 100000"),
        (dict(max_new_tokens=-3), "max new tokens must be from 1 to 1024, got -3"),
        (dict(history="hello"), "The history must be a list of messages, got str"),
        (dict(history=[{"role": "robot", "content": "x"}]), "History item 1: role must be user, assistant or system"),
        (dict(history=[{"role": "user", "content": 3}]), "History item 1: the content must be text"),
        (dict(message="hello " * 2_500), "this demo prefills at most 2,048 tokens"),
    ],
)
def test_bad_requests_are_refused_with_the_value_named(registry, kwargs, expected):
    args = dict(message="hi", history=[], strategy="ConfAdapt", tau=0.9, k_max=4, k=3, max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(RequestError) as err:
        prepare_turn(registry, TurnRequest(**args))
    assert expected in str(err.value)


def test_a_prompt_too_long_suggests_clear_only_when_there_is_a_conversation(registry):
    """A first message over the prefill limit is told to be shortened (Clear would not help: there is nothing to
    clear); a follow-up that makes the conversation too long is also offered Clear."""
    args = dict(strategy="ConfAdapt", tau=0.9, k_max=4, k=3, max_new_tokens=8)
    with pytest.raises(RequestError) as first:
        prepare_turn(registry, TurnRequest(message="hello " * 2_500, history=[], **args))
    assert "The message is" in str(first.value) and "Shorten it and send again" in str(first.value)
    assert "Clear" not in str(first.value)
    history = [{"role": "user", "content": "hello " * 1_500}, {"role": "assistant", "content": "Hi!"}]
    with pytest.raises(RequestError) as later:
        prepare_turn(registry, TurnRequest(message="hello " * 1_000, history=history, **args))
    assert "This conversation is" in str(later.value) and "press Clear to start a new chat" in str(later.value)


@pytest.mark.integration
def test_limits_are_the_apps_and_tau_zero_is_valid(registry, lm):
    assert (APP_MAX_K_MAX, APP_MAX_NEW_TOKENS) == (32, 1024)
    turn = prepare_turn(registry, TurnRequest("hi", [], "ConfAdapt", 0, 32, None, 1024))
    assert turn.strategy.tau == 0.0 and turn.strategy.k_max == 32 and turn.max_new_tokens == 1024
    # k_max defaults to the adapter's trained k_max
    assert prepare_turn(registry, TurnRequest("hi", [], "lossless", 0.9, None)).strategy.k_max == min(lm.default_k_max, 32)
    # the parameters a strategy does not use are not checked
    assert prepare_turn(registry, TurnRequest("hi", [], "static k", "junk", "junk", 2)).strategy.k == 2


def test_history_forms():
    plain = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!", "mtp": "Hey!"}]
    assert parse_history(plain) == plain
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    assert parse_history(parts) == [{"role": "user", "content": "Hello"}]
    assert parse_history([["Hello", "Hi!"]]) == plain[:1] + [{"role": "assistant", "content": "Hi!"}]
    assert parse_history(None) == [] and parse_history([]) == []


def test_registry_keys_name_the_precision():
    assert ModelRegistry.key("smollm2-135m") == ("smollm2-135m", "none", "auto")
    with pytest.raises(RequestError, match="Unknown precision 'float8'"):
        ModelRegistry.key("smollm2-135m", "none", "float8")


# ------------------------------------------------------------------ empty and invisible input
@pytest.mark.parametrize("text", ["\u200b\u200b\u200d", " \u200b \n\u200d\t", "\ufeff", "\u2060\u200e\u200f",
                                  "\u00ad", "\u202a\u202c", "\u200b\x00\x1b"])
def test_zero_width_messages_are_refused_like_whitespace(text):
    from app.requests import check_message, is_blank

    assert is_blank(text)
    with pytest.raises(RequestError, match="The message is empty: type a question first."):
        check_message(text)
    assert check_message("\u200bhi\u200d") == "\u200bhi\u200d"  # visible text keeps its invisible characters
    assert not is_blank("\u0661")  # an Arabic digit is text


def test_empty_controls_are_named_in_the_users_words():
    from app.requests import app_max_new_tokens, app_strategy

    with pytest.raises(RequestError, match="tau is empty"):
        app_strategy("ConfAdapt", None, 4)
    with pytest.raises(RequestError, match="^k is empty: enter a whole number from 1 to 32.$"):
        app_strategy("static k", 0.9, 4, None)
    for empty in (None, "", "  "):
        with pytest.raises(RequestError, match="^max new tokens is empty: enter a whole number from 1 to 1024.$"):
            app_max_new_tokens(empty)
    assert app_strategy("lossless", None, None, None, 4).k_max == 4  # unused controls may be empty


# ------------------------------------------------------------------ a hub id without the Hub
def test_a_hub_id_fails_at_once_when_hf_hub_offline_is_set():
    """HF_HUB_OFFLINE set (the tests set it) and the checkpoint not in the local cache: refused at once, naming
    the reason, without asking the network."""
    import socket

    from model.engine.loading import load_checkpoint
    from model.errors import CheckpointError

    tried = []
    real_connect = socket.socket.connect

    def connect(self, address):  # every connection attempt of this process, recorded
        tried.append(address)
        return real_connect(self, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        with pytest.raises(CheckpointError) as err:
            load_checkpoint("nobody-here/not-a-cached-model")
    assert tried == []  # refused without asking the network
    assert "HF_HUB_OFFLINE is set" in str(err.value) and "not in the local cache" in str(err.value)


@pytest.fixture
def silent_hub(monkeypatch):
    """A Hugging Face endpoint on loopback that accepts connections and never answers until released:
    (release event, endpoint, the connections it accepted). HF_HUB_OFFLINE is unset for the test."""
    import socket

    import huggingface_hub.constants as hf

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    release, held = threading.Event(), []

    def serve():
        server.settimeout(0.2)
        while not release.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass
        for conn in held:
            conn.close()  # no answer: the connection ends

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf, "ENDPOINT", endpoint)
    yield release, endpoint, held
    release.set()
    thread.join(timeout=5)
    server.close()


def test_a_hub_id_fails_after_the_probe_when_the_hub_does_not_answer(silent_hub, monkeypatch):
    """A Hub that does not answer: the load is refused after one probe of HUB_PROBE_SECONDS (it took 69.6 s of
    transformers' retries), naming the endpoint and the reason. Counted, not timed: the silent Hub saw the probe's
    connection and no other (no retries)."""
    from model.engine import loading, sources
    from model.errors import CheckpointError

    monkeypatch.setattr(sources, "HUB_PROBE_SECONDS", 1.0)
    with pytest.raises(CheckpointError) as err:
        loading.load_checkpoint("nobody-here/not-a-cached-model")
    silent_hub[0].set()
    assert len(silent_hub[2]) == 1  # the probe's connection only
    assert f"{silent_hub[1]} did not answer" in str(err.value) and "not in the local cache" in str(err.value)


def test_chats_keep_running_while_a_hub_load_waits(silent_hub, tiny_registry, monkeypatch):
    """While a hub id waits for the Hub, another session's turn runs to its end; then the load fails with the
    reason, as a message for the page."""
    from model.engine import loading, sources

    monkeypatch.setattr(sources, "HUB_PROBE_SECONDS", 60.0)
    release, endpoint, _ = silent_hub
    tiny_loader = tiny_registry._loader
    registry = ModelRegistry(loader=lambda source, **kw: tiny_loader(source, **kw) if source == "tiny"
                             else loading.load_checkpoint(source, **kw))
    failure: list[Exception] = []

    def load_hub():
        try:
            registry.get("nobody-here/not-a-cached-model")
        except RequestError as e:
            failure.append(e)

    loader = threading.Thread(target=load_hub)
    loader.start()
    last = finish(prepare_turn(registry, TurnRequest("hi", [], "ConfAdapt", 0.9, 4, 3, 6, ("tiny", "none"))))[1]
    assert last.phase == "done" and loader.is_alive() and not failure  # the turn ended; the load still waits
    release.set()  # the Hub ends the connection without an answer
    loader.join(timeout=30)
    assert not loader.is_alive() and f"{endpoint} did not answer" in str(failure[0])
