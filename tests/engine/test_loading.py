"""Loading a checkpoint (model/engine/loading.py): sources, mask token lookup/addition, clear errors,
the embedded default (the SmolLM2 GGUF)."""

from __future__ import annotations

import pytest
import torch

from model.engine.decoding import generate
from model.engine.loading import DEFAULT_MASK_TOKEN, _gguf_cache_dir, find_mask_token, load_checkpoint, smollm2_gguf_path
from model.engine.strategies import confadapt, standard
from model.errors import CheckpointError


def test_local_dir_with_mask_token(tiny_dir):
    lm = load_checkpoint(str(tiny_dir), device="cpu")
    assert lm.mtp_trained and not lm.warnings
    assert lm.mask_token_id == lm.tokenizer.convert_tokens_to_ids(DEFAULT_MASK_TOKEN)
    assert lm.stop_token_ids == (lm.tokenizer.eos_token_id,)
    assert lm.prompt_format == "chat"
    res = generate(lm, "Hello", confadapt(0.9, 4), 8)
    assert 1 <= res.new_tokens <= 8 and res.forward_passes <= res.new_tokens


def test_missing_mask_token_is_added_and_flagged(tiny_dir, base_tokenizer):
    lm = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    assert not lm.mtp_trained
    assert any("not MTP-trained" in w for w in lm.warnings)
    assert lm.mask_token_id == len(base_tokenizer)  # one new row after the existing vocabulary
    assert lm.vocab_size == len(lm.tokenizer)
    assert find_mask_token(lm.tokenizer, "<|my_mask|>") == lm.mask_token_id


def test_added_mask_row_is_mean_initialised_and_reproducible(tiny_dir):
    a = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    b = load_checkpoint(str(tiny_dir), device="cpu", mask_token="<|my_mask|>")
    ea, eb = a.model.get_input_embeddings().weight, b.model.get_input_embeddings().weight
    torch.testing.assert_close(ea[a.mask_token_id], eb[b.mask_token_id])
    mean = ea[:-1].mean(0)
    # drawn from N(mean, cov): much closer to the mean than a typical existing row is
    assert (ea[-1] - mean).norm() < (ea[:-1] - mean).norm(dim=-1).mean() * 2


@pytest.mark.parametrize(
    "source, message",
    [
        ("", "empty"),
        ("not a model source!", "Unknown model source"),
        ("/definitely/not/here", "No such local model"),
        ("./missing-dir", "No such local model"),
        ("missing.gguf", "No such local model"),
    ],
)
def test_bad_sources_raise_clear_errors(source, message):
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(source)


def test_a_file_that_is_not_a_model(tmp_path):
    (tmp_path / "README.md").write_text("# hello")
    with pytest.raises(CheckpointError, match="is a file, not a model"):
        load_checkpoint(str(tmp_path / "README.md"))


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(tmp_path))


def test_quantization_needs_cuda(tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(CheckpointError, match="needs a CUDA GPU"):
        load_checkpoint(str(tiny_dir), quantization="4bit")
    with pytest.raises(CheckpointError, match="Unknown quantization"):
        load_checkpoint(str(tiny_dir), quantization="3bit")


def test_bad_dtype(tiny_dir):
    with pytest.raises(CheckpointError, match="Unknown dtype"):
        load_checkpoint(str(tiny_dir), dtype="float7")


def test_first_gguf_loads_of_several_processes_take_turns(tmp_path):
    """Processes loading a GGUF file into an empty cache together parse it once: the cache lock is held by
    the first; once the copy exists no lock is taken at all."""
    from filelock import FileLock, Timeout

    from model.engine.loading import _gguf_cache_lock

    cache = tmp_path / "cache" / "model-123-abcdef"
    with _gguf_cache_lock(cache):
        with pytest.raises(Timeout):  # another process (its own lock object) waits
            FileLock(str(cache.with_name(cache.name + ".lock"))).acquire(timeout=0.2)
        cache.mkdir()
        (cache / "config.json").write_text("{}")
    FileLock(str(cache.with_name(cache.name + ".lock"))).acquire(timeout=0.2)  # released
    assert type(_gguf_cache_lock(cache)).__name__ == "nullcontext"  # the copy exists: no waiting
    assert type(_gguf_cache_lock(None)).__name__ == "nullcontext"


# ------------------------------------------- the embedded default (integration)
@pytest.mark.integration
def test_gguf_file_source_is_the_default_base(smollm2, tmp_path, monkeypatch):
    """A first load (empty cache: the GGUF is parsed and its dequantised copy written) gives the same
    model and forward path as every later load from the copy: plain weights, the fast path. The file is
    parsed once (transformers reads it for the config, the tokenizer and the weights, the memory check for
    its size: ~8 s a parse on 2 cores)."""
    import gguf

    parsed = []
    reader = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parsed.append(str(path))
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    monkeypatch.setenv("MTP_CACHE_DIR", str(tmp_path / "cache"))
    lm = load_checkpoint(str(smollm2_gguf_path()), device="cpu")
    assert parsed == [str(smollm2_gguf_path())]
    assert gguf.GGUFReader is counted  # the library is left as it was
    assert len([d for d in (tmp_path / "cache").iterdir() if d.is_dir()]) == 1  # one copy (and its lock file)
    assert lm.forward_path.startswith(("our kernels", "fast path")), lm.forward_path  # not the library path
    assert not getattr(lm.model, "is_quantized", False)
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert lm.model.config.num_hidden_layers == 30 and lm.model.config.hidden_size == 576
    assert lm.mask_token_id == 49152 == smollm2.mask_token_id
    assert lm.stop_token_ids == (2,)
    assert generate(lm, "What is 2+2?", standard(), 12).token_ids == generate(smollm2, "What is 2+2?", standard(), 12).token_ids
    # The copy holds full-precision weights whatever the first load asked for (auto: bf16 on a bf16 CPU): a
    # float32 load from it reads exactly the weights of a float32 parse, never bf16-rounded ones.
    from safetensors import safe_open

    copy_dir = next(d for d in (tmp_path / "cache").iterdir() if d.is_dir())
    with safe_open(str(copy_dir / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    f32 = load_checkpoint(str(smollm2_gguf_path()), device="cpu", dtype="float32", adapter=False)
    assert parsed == [str(smollm2_gguf_path())]  # read from the copy
    assert all(torch.equal(a, b) for a, b in zip(f32.model.parameters(), smollm2.model.parameters()))


@pytest.mark.integration
def test_memory_check_reads_the_dequantised_copy_not_the_gguf(smollm2, monkeypatch):
    """Once the GGUF's dequantised copy exists (the smollm2 fixture wrote or found it), the memory check before
    a load counts the weights from the copy's safetensors header: the gguf library would parse the whole file,
    vocabulary included, on every load (~5 s on 2 cores)."""
    import model.engine.guards as guards
    from model.engine.loading import preflight, resolve_source

    def parsed(path):
        raise AssertionError(f"the GGUF file was parsed: {path}")

    monkeypatch.setattr(guards, "_gguf_params", parsed)
    preflight(resolve_source("smollm2-135m"), torch.device("cpu"), torch.float32, None)
    n = sum(p.numel() for p in smollm2.model.parameters())
    cache = _gguf_cache_dir(smollm2_gguf_path())
    need = guards.weights_bytes("hf_dir", str(cache), torch.float32, None)
    assert abs(need - 4 * n) <= 4 * smollm2.model.config.hidden_size  # the mask row aside: the same weights


@pytest.mark.integration
def test_default_model_facts(smollm2):
    assert smollm2.mask_token_id == 49152  # appended after the 49152-token vocabulary
    assert smollm2.stop_token_ids == (2,)  # <|im_end|>
    assert smollm2.prompt_format == "chat"
    assert not smollm2.mtp_trained  # adapter=False: the untrained mask token is flagged
    assert smollm2.warnings
