"""Our CPU kernels (model/engine/kernels, model/engine/kernel_forward.py): exact at every width, deterministic
across runs and thread counts, close to transformers, and chosen / refused as MTP_KERNELS says.

Exactness here is bit equality (``torch.equal``), never a tolerance: each row of a T-token pass against the
one-token pass of the same token after the same KV cache (:func:`model.engine.exactness.row_exactness`), for
T = 2 .. 32, linear and tree layouts, with and without the adapter, bf16 and float32, every kernel path this
CPU can run (a path it cannot run is skipped, saying which instructions are missing). The AMX path runs natively
where the CPU has AMX, else in its software emulation (``MTP_AMX_EMULATE``) on tiny models where the CPU has
AVX512-BF16: the same tile code, data movement and per-element order, so a layout or indexing fault shows here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model

from model.engine import kernels as K
from model.engine.decoding import hf_generate, run
from model.engine.exactness import row_exactness
from model.engine.loaded_model import _FastState
from model.engine.loading import wrap_model
from model.engine.strategies import confadapt, standard, verify
from tests.conftest import ROOT, make_tiny

RUNNABLE = [isa for isa in ("avx512bf16", "avx2") if not K.missing(isa)]
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
TREE_POS = [0, 1, 2, 1, 2, 2]
TREE_VIS = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                         [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)


AMX_NATIVE = not K.missing("amx")


def _isa_params(emulated_amx: bool = True):
    """Every kernel path; ``amx`` emulated where the CPU lacks AMX (when ``emulated_amx``: tiny models only, the
    emulation is ~100x slower)."""
    out = []
    for isa in ("amx", "avx512bf16", "avx2"):
        lack = K.missing(isa)
        if isa == "amx" and lack and emulated_amx:
            lack = K.missing("avx512bf16")
        out.append(pytest.param(isa, marks=pytest.mark.skipif(bool(lack), reason=f"this CPU lacks {', '.join(lack)}")))
    return out


def on_kernels(lm, isa: str, monkeypatch):
    """A view of ``lm`` whose forward pass runs on kernel path ``isa`` (AMX emulated where the CPU lacks it)."""
    monkeypatch.setenv(K.ENV, isa)
    if isa == "amx" and not AMX_NATIVE:
        monkeypatch.setenv(K.EMULATE_ENV, "1")
    view = dataclasses.replace(lm, _fast=_FastState())
    assert view.fast_engine() is not None and view.forward_path.startswith(f"our kernels ({isa})"), view.forward_path
    return view


def _tiny(base_tokenizer, arch="llama", dtype=torch.bfloat16, adapter=None, **config):
    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, arch=arch, dtype=dtype, **config), tok, source=f"tiny-{arch}")
    if adapter:
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                         alora_invocation_tokens=[lm.mask_token_id] if adapter == "alora" else None,
                         trainable_token_indices=[lm.mask_token_id])
        torch.manual_seed(1)
        lm.model, lm.adapter = get_peft_model(lm.model, cfg).eval(), adapter
    return lm


def assert_rows_exact_on_one_and_two_threads(lm, ids, widths) -> None:
    """Every row of passes of 1 real + w - 1 masks (each w in ``widths``) and of the 6-token tree after ``ids`` has
    the bits of a one-token pass, on one and on two threads."""
    m = lm.mask_token_id
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for t in widths:
                got = row_exactness(lm, ids, [101] + [m] * (t - 1), num_masks=t - 1)
                assert got.exact, (threads, t, got)
            got = row_exactness(lm, ids, [101] + [m] * 5, num_masks=5, positions=TREE_POS, visible=TREE_VIS)
            assert got.exact, (threads, got)
    finally:
        torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- dispatch
def test_choose_isa_and_refusals(monkeypatch):
    monkeypatch.delenv(K.EMULATE_ENV, raising=False)
    avx512 = frozenset(K.NEEDS["avx512bf16"])
    avx2 = frozenset(K.NEEDS["avx2"])
    amx = frozenset(K.NEEDS["amx"])
    assert K.candidates("auto", amx) == ["amx", "avx512bf16", "avx2"]
    assert K.choose_isa("auto", amx) == "amx"
    assert K.choose_isa("auto", avx512) == "avx512bf16"
    assert K.choose_isa("auto", avx2) == "avx2"
    assert K.choose_isa("auto", frozenset({"sse2"})) is None
    assert K.choose_isa("off", avx512) is None
    assert K.choose_isa("avx2", avx512) == "avx2"  # an AVX512 CPU runs the AVX2 path when asked
    with pytest.raises(K.KernelError, match="lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16"):
        K.choose_isa("avx512bf16", avx2)
    with pytest.raises(K.KernelError, match="lacks amx_tile, amx_bf16"):
        K.choose_isa("amx", avx512)
    monkeypatch.setenv(K.EMULATE_ENV, "1")  # emulated AMX needs what avx512bf16 needs; auto never picks it
    assert K.choose_isa("amx", avx512) == "amx"
    with pytest.raises(K.KernelError, match="lacks avx512f"):
        K.choose_isa("amx", avx2)
    assert K.choose_isa("auto", avx512) == "avx512bf16"


@pytest.mark.parametrize("isa", _isa_params())
def test_self_check_passes(monkeypatch, isa):
    """The check every path runs when loaded (bits of wide rows = one-row bits, 2 threads = 1, float64 within
    1e-5) passes on each path this CPU runs."""
    if isa == "amx" and not AMX_NATIVE:
        monkeypatch.setenv(K.EMULATE_ENV, "1")
    lib = K._load(K.emulating())
    if isa == "amx":  # the tile state is granted per process: a fresh test worker has not asked for it yet
        assert lib.mtp_amx_init() == 0
    assert lib.mtp_selftest(K.ISA_CODES[isa]) == 0


@pytest.mark.skipif(AMX_NATIVE or not K.runnable("avx512bf16"), reason="needs a CPU with AVX512-BF16 and no AMX")
def test_auto_passes_over_a_path_that_cannot_run(monkeypatch):
    """A CPU that claimed AMX (flags) but whose kernel refuses the tile state: auto says why and runs the next
    path; forced amx is one error naming the refusal."""
    monkeypatch.delenv(K.EMULATE_ENV, raising=False)
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset(K.NEEDS["amx"]))
    monkeypatch.setattr(K, "_STATUS", {})
    monkeypatch.setenv(K.ENV, "auto")
    st = K.status()
    assert st.isa == "avx512bf16" and "passed over amx: Linux refused the AMX tile state" in st.reason, st.reason
    monkeypatch.setenv(K.ENV, "amx")
    with pytest.raises(K.KernelError, match="MTP_KERNELS=amx: Linux refused the AMX tile state"):
        K.status()


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """No kernel status, library or build failure remembered from earlier tests in this process."""
    for name in ("_STATUS", "_LIBRARIES", "_BUILD_ERRORS"):
        monkeypatch.setattr(K, name, {})
    monkeypatch.delenv(K.EMULATE_ENV, raising=False)
    monkeypatch.setenv(K.ENV, "auto")


def test_a_kernel_folder_that_cannot_be_written_is_a_message_and_auto_runs_torch(tmp_path, monkeypatch, capsys,
                                                                                  fresh_kernel_state):
    """``MTP_KERNELS_DIR`` naming a file: building says which folder and what to do; auto runs the torch path."""
    if not K.candidates("auto"):
        pytest.skip("this CPU runs none of our paths")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MTP_KERNELS_DIR", str(tmp_path / "file" / "kernels"))
    with pytest.raises(K.KernelError, match="cannot write the kernel library into .*set MTP_KERNELS_DIR"):
        K.build(quiet=True)
    st = K.status()
    assert st.isa is None and "set MTP_KERNELS_DIR to a folder you can write" in st.reason, st.reason


def test_a_failing_compiler_is_named_with_its_exit_code_and_tried_once(tmp_path, monkeypatch, capsys,
                                                                        fresh_kernel_state):
    """A compiler that fails without a word (``CXX=false``): the reason names it and its exit code, and ``auto``,
    which tries every path of the CPU, compiles once."""
    if not K.candidates("auto"):
        pytest.skip("this CPU runs none of our paths")
    monkeypatch.setenv("MTP_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    K.library_path().write_bytes(b"")  # an empty file left by a build cut short: built again, once
    st = K.status()
    assert st.isa is None and "exited with code 1" in st.reason and "false" in st.reason, st.reason
    assert st.reason.count("exited with code 1") == 1  # said once, not once per path tried
    assert capsys.readouterr().err.count("compiling mtp_kernels.cpp") == 1
    assert [p.stat().st_size for p in tmp_path.iterdir()] == [0]  # no half-written library left beside it


def test_a_damaged_library_file_is_built_again(tmp_path, monkeypatch, fresh_kernel_state):
    """A library file that does not load (empty, or cut short) is replaced by a fresh build, not kept forever."""
    if not K.candidates("auto") or K.compiler() is None:
        pytest.skip("needs one of our paths and a compiler")
    monkeypatch.setenv("MTP_KERNELS_DIR", str(tmp_path))
    path = K.library_path()
    path.write_bytes(b"\x7fELF cut short")
    st = K.status()
    assert st.isa == K.candidates("auto")[0] and path.stat().st_size > 100_000, st.reason


def test_unknown_value_is_refused(monkeypatch):
    monkeypatch.setenv(K.ENV, "fast")
    with pytest.raises(K.KernelError, match="choose one of auto, amx, avx512bf16, avx2, off"):
        K.requested()


def test_forced_path_the_cpu_lacks_is_one_error_line(tmp_path):
    """The CLI refuses a forced path this CPU cannot run with one error: line naming the instructions, before
    it loads anything."""
    lacking = next((isa for isa in ("amx", "avx512bf16", "avx2") if K.missing(isa)), None)
    if lacking is None:
        pytest.skip("this CPU runs every path")
    env = {**os.environ, K.ENV: lacking, "HF_HUB_OFFLINE": "1"}
    env.pop(K.EMULATE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "model.generate", "--model", str(tmp_path / "none"), "--prompt", "x",
                           "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and f"MTP_KERNELS={lacking}: this CPU lacks" in lines[0], proc.stderr[-2000:]


def test_off_runs_the_torch_fast_path(base_tokenizer, monkeypatch):
    monkeypatch.setenv(K.ENV, "off")
    lm = _tiny(base_tokenizer)
    assert lm.forward_path.startswith("fast path") and "MTP_KERNELS=off" in lm.forward_path


@pytest.mark.parametrize("isa", _isa_params())
def test_the_path_says_how_bf16_is_computed(base_tokenizer, monkeypatch, isa):
    """The path's line (the page's model line, the CLIs') says that AVX2, which has no bf16 instructions, widens
    the bf16 weights to float32; the bf16 paths say bfloat16 alone."""
    lm = on_kernels(_tiny(base_tokenizer), isa, monkeypatch)
    widened = "bfloat16 weights widened to float32" in lm.forward_path
    assert widened == (isa == "avx2") and "bfloat16" in lm.forward_path, lm.forward_path


def test_float64_and_float16_keep_the_torch_path(base_tokenizer, monkeypatch):
    if not RUNNABLE:
        pytest.skip("no kernel path on this CPU")
    monkeypatch.setenv(K.ENV, "auto")
    lm = _tiny(base_tokenizer, dtype=torch.float64)
    assert lm.forward_path.startswith("fast path") and "our kernels not used" in lm.forward_path


# ------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch,adapter", [("llama", "alora"), ("qwen3", "lora"), ("llama", None)])
def test_every_row_equals_the_one_token_pass(base_tokenizer, monkeypatch, one_torch_thread, isa, dtype, arch,
                                             adapter):
    lm = on_kernels(_tiny(base_tokenizer, arch=arch, dtype=dtype, adapter=adapter), isa, monkeypatch)
    ids, m = lm.prompt_ids(PROMPT), lm.mask_token_id
    for t in (2, 4, 5, 7, 8, 13, 16, 32):  # row groups of 1-8 (5-6 rows at 4 column blocks, 7-8 at 3), two groups
        masks = t - 1
        got = row_exactness(lm, ids, [101] + [m] * masks, num_masks=masks)
        assert got.exact, (t, got)
        got = row_exactness(lm, ids, list(range(200, 200 + t)))
        assert got.exact, (t, got)
    got = row_exactness(lm, ids, [101] + [m] * 5, num_masks=5, positions=TREE_POS, visible=TREE_VIS)
    assert got.exact, got


@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 32), (6, 2, 12), (3, 3, 40), (4, 2, 64)])
def test_attention_for_every_head_grouping(base_tokenizer, monkeypatch, one_torch_thread, isa, heads, kv_heads,
                                           head_dim):
    """Attention runs up to 3 query heads of one KV head together (each cached key and value widened once for
    them): 8 heads on one KV head (3 + 3 + 2), 3 per KV head, 1; head sizes that take the 32-lane weighted sum,
    the 8-lane scores with the scalar weighted sum, the scalar scores, and (64) a bf16 model's weighted sum two
    values a vdpbf16ps on the zmm paths. Rows stay exact at every width and in a tree (bf16) on one and two threads;
    against transformers' logits, ours stay within 5% of its largest in bf16 and within 1e-4 of it in float32."""
    from transformers import DynamicCache

    shape = dict(hidden_size=96, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.bfloat16, adapter="alora", **shape), isa, monkeypatch)
    ids, m = lm.prompt_ids(PROMPT), lm.mask_token_id
    assert_rows_exact_on_one_and_two_threads(lm, ids, (2, 5, 8))
    x = torch.tensor([ids + [m] * 3])
    for dtype, tol in ((torch.bfloat16, 0.05), (torch.float32, 1e-4)):
        if dtype != lm.dtype:
            lm = on_kernels(_tiny(base_tokenizer, dtype=dtype, adapter="alora", **shape), isa, monkeypatch)
        with torch.no_grad():
            ours = lm.forward(x, lm.new_cache(), 3, 0).float()
            lib = lm.forward(x, DynamicCache(config=lm.model.config), 3, 0).float()
        assert float((ours - lib).abs().max()) <= tol * float(lib.abs().max()), dtype


@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("head_dim,length", [(32, 150), (64, 151)])
def test_rows_exact_after_a_long_cache(base_tokenizer, monkeypatch, one_torch_thread, isa, head_dim, length):
    """After a cache of 150 or 151 tokens (not a multiple of the 4 keys scored together; 151: a bf16 model's value
    pairs on the zmm paths straddle the cache and the pass), every row of a pass of 2-13 rows, linear or tree, on
    one and two threads, has the bits of a one-token pass (head_dim 32: the 32-lane weighted sum; 64: two values a
    vdpbf16ps); and in float32 a 1 + 3 masks pass after that cache stays within 1e-4 of transformers'."""
    from transformers import DynamicCache

    shape = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=head_dim)
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.bfloat16, adapter="alora", **shape), isa, monkeypatch)
    m = lm.mask_token_id
    ids = lm.prompt_ids(" ".join([PROMPT] * 8))[:length]
    assert len(ids) == length
    assert_rows_exact_on_one_and_two_threads(lm, ids, (2, 5, 8, 13))
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.float32, adapter="alora", **shape), isa, monkeypatch)

    def after_the_cache(cache):
        with torch.no_grad():
            lm.forward(torch.tensor([ids]), cache, 0, 1)
            return lm.forward(torch.tensor([[101] + [m] * 3]), cache, 3, 4).float()

    ours, lib = after_the_cache(lm.new_cache()), after_the_cache(DynamicCache(config=lm.model.config))
    assert float((ours - lib).abs().max()) <= 1e-4 * float(lib.abs().max())


@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_threads_give_the_bits_of_one(base_tokenizer, monkeypatch, isa, dtype):
    lm = on_kernels(_tiny(base_tokenizer, dtype=dtype, adapter="alora"), isa, monkeypatch)
    ids, m = lm.prompt_ids(PROMPT), lm.mask_token_id
    x = torch.tensor([ids + [m] * 7])
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            cache = lm.new_cache()
            out.setdefault(n, []).append(lm.forward(x, cache, 7, 0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1][0], out[2][0]) and torch.equal(out[1][0], out[1][1])


@pytest.mark.parametrize("isa", _isa_params())
def test_verify_equals_standard_in_bf16(base_tokenizer, monkeypatch, one_torch_thread, isa):
    """Lossless in bf16 as in float32: verify (linear and full tree) gives standard decoding's tokens."""
    lm = on_kernels(_tiny(base_tokenizer, dtype=torch.bfloat16, adapter="alora"), isa, monkeypatch)
    ids = lm.prompt_ids(PROMPT)
    want = run(lm, ids, standard(), 40).token_ids
    for layout in ("linear", "full"):
        assert run(lm, ids, verify(4, layout), 40).token_ids == want, layout


#: A shape whose q/k/v projection has an odd number of 16-column blocks (3 heads x 40 x 3 = 360 columns: 23 blocks,
#: the last one half full), so the adapter's A packed after it shares a pair of blocks with the weight's last block
#: (bf16 pairs are stored two blocks interleaved); the default tiny shape has even block counts.
ODD_BLOCKS = dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=3, head_dim=40)


@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [{}, ODD_BLOCKS], ids=["even-blocks", "odd-blocks"])
def test_close_to_transformers(base_tokenizer, monkeypatch, one_torch_thread, isa, dtype, shape):
    """Our sums run in another order than transformers' (so not the same bits): logits within rounding of the
    library path's, base and adapter rows alike, with even and odd column block counts."""
    from transformers import DynamicCache

    lm = on_kernels(_tiny(base_tokenizer, dtype=dtype, adapter="alora", **shape), isa, monkeypatch)
    if shape:
        qkv = lm.fast_engine().m.layer[0].qkv
        assert (qkv.n // 16 + (qkv.n % 16 > 0)) % 2 == 1 and qkv.rank > 0  # the weight's last block pairs with A's
    ids, m = lm.prompt_ids(PROMPT), lm.mask_token_id
    x = torch.tensor([ids + [m] * 3])
    with torch.no_grad():
        ours = lm.forward(x, lm.new_cache(), 3, 0).float()
        lib = lm.forward(x, DynamicCache(config=lm.model.config), 3, 0).float()
    scale = float(lib.abs().max())
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    assert float((ours - lib).abs().max()) <= tol * scale


@pytest.mark.parametrize("isa", _isa_params())
def test_adapter_trained_output_rows_reach_the_mask_rows_only(base_tokenizer, monkeypatch, one_torch_thread, isa):
    """An adapter that trains lm_head rows (peft trainable tokens on an untied head), bf16: its rows replace the
    head's on the mask rows (within rounding of peft's logits there: a 0.5-sized change to each row moves those
    logits by several units) and leave the real rows' logits the base's, bit for bit."""
    from transformers import DynamicCache

    tok = copy.deepcopy(base_tokenizer)
    lm = wrap_model(make_tiny(tok, dtype=torch.bfloat16, tie_word_embeddings=False), tok, source="tiny-llama")
    m, trained = lm.mask_token_id, [lm.mask_token_id, 7]
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                     alora_invocation_tokens=[m], trainable_token_indices={"embed_tokens": [m], "lm_head": trained})
    torch.manual_seed(1)
    lm.model, lm.adapter = get_peft_model(lm.model, cfg).eval(), "alora"
    delta = lm.model.base_model.model.lm_head.token_adapter.trainable_tokens_delta["default"]
    with torch.no_grad():
        delta.add_(0.5 * torch.randn(delta.shape, generator=torch.Generator().manual_seed(2)).to(delta.dtype))
    lm = on_kernels(lm, isa, monkeypatch)
    assert lm.fast_engine().m.head_override.n == len(trained)
    ids = lm.prompt_ids(PROMPT)
    x = torch.tensor([ids + [m] * 3])
    with torch.no_grad():
        ours = lm.forward(x, lm.new_cache(), 3, 0).float()[0, -4:]
        lib = lm.forward(x, DynamicCache(config=lm.model.config), 3, 0).float()[0, -4:]
        real = lm.forward(torch.tensor([ids]), lm.new_cache(), 0, 0).float()[0, -1]
    scale = float(lib.abs().max())
    assert float((ours[1:] - lib[1:]).abs().max()) <= 0.05 * scale  # the mask rows: the trained rows included
    assert torch.equal(ours[0], real)  # the last real row: the base head


@pytest.mark.parametrize("isa", _isa_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_adapters_a_is_swept_with_the_weight(base_tokenizer, monkeypatch, one_torch_thread, isa, dtype):
    """The adapter's A rides in the weight's sweep (``lora_a_in_w``) when its factors have the weight's dtype; with
    float32 factors beside bf16 weights (``MTP_LORA_FACTORS=float32``) it stays a product of its own. Both give the
    mask rows' logits within rounding of each other and the same argmax."""
    tiny = _tiny(base_tokenizer, dtype=dtype, adapter="alora")
    ids, m = tiny.prompt_ids(PROMPT), tiny.mask_token_id
    x = torch.tensor([ids + [m] * 3])
    out = {}
    for factors in ("bf16", "float32"):
        monkeypatch.setenv("MTP_LORA_FACTORS", factors)
        lm = on_kernels(tiny, isa, monkeypatch)
        qkv = lm.fast_engine().m.layer[0].qkv
        assert qkv.rank > 0
        assert qkv.lora_a_in_w == int(factors == "bf16" or dtype == torch.float32), factors
        assert (qkv.lora_a is None) == bool(qkv.lora_a_in_w)
        with torch.no_grad():
            out[factors] = lm.forward(x, lm.new_cache(), 3, 0).float()[0, -4:]
    scale = float(out["float32"].abs().max())
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    assert float((out["bf16"] - out["float32"]).abs().max()) <= tol * scale
    assert torch.equal(out["bf16"].argmax(-1), out["float32"].argmax(-1))


def test_the_ctypes_mirror_is_checked_against_the_library():
    """The library lists its structs' fields; the ctypes mirror matches, and a mirror with a field moved is
    refused by name."""
    import ctypes

    from model.engine.kernels import abi

    lib = K._load(False)
    assert abi.layout_differences(abi.library_layout(lib), abi.mirror_layout()) == []
    assert abi.library_layout(lib)["mtp_linear.lora_a_in_w"][1] == 4

    class Moved(ctypes.Structure):
        _fields_ = [(name, typ) for name, typ in abi.Batch._fields_ if name != "nseq"] + [("nseq", ctypes.c_int32)]

    diff = abi.layout_differences(abi.library_layout(lib), abi.mirror_layout({**abi.MIRRORS, "mtp_batch": Moved}))
    assert any(line.startswith("mtp_batch.nseq: offset, size (0, 4) in the library") for line in diff), diff


# ------------------------------------------------------------------------------------------- SmolLM2
#: HF generate's tokens per (dtype, prompt ids, n): the reference does not depend on our kernels' ISA, so each ISA's
#: test reads the one computed first.
_HF_REFERENCE: dict = {}


def hf_reference(plain, ids, n) -> list[int]:
    """HF generate on the plain base (cached across ISA parameters)."""
    key = (plain.dtype_name, tuple(ids), n)
    if key not in _HF_REFERENCE:
        _HF_REFERENCE[key] = hf_generate(plain, ids, n)
    return _HF_REFERENCE[key]


HF_PROMPTS = (("What is 12 times 7? Explain step by step.", 32),
              ("Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.", 64))


@pytest.mark.slow
@pytest.mark.parametrize("isa", _isa_params(emulated_amx=False))
def test_smollm2_bf16_rows_exact_and_verify_equals_standard(smollm2_adapter_bf16, monkeypatch, one_torch_thread,
                                                            isa):
    """The real model + shipped adapter in bf16: rows exact at T = 4 and 16 and in a tree; verify (linear and
    full tree) gives standard decoding's tokens; standard decoding follows HF generate on the plain base up to
    HF's first near-tie (its top two bf16 logits at most one bf16 step apart: two orders of summation may pick
    either; docs/DESIGN.md gives the measured figures)."""
    lm = on_kernels(smollm2_adapter_bf16, isa, monkeypatch)
    ids, m = lm.prompt_ids(HF_PROMPTS[0][0]), lm.mask_token_id
    for t in (4, 16):
        got = row_exactness(lm, ids, [100] + [m] * (t - 1), num_masks=t - 1)
        assert got.exact, (t, got)
    assert row_exactness(lm, ids, [100] + [m] * 5, num_masks=5, positions=TREE_POS, visible=TREE_VIS).exact
    plain = dataclasses.replace(lm, model=copy.deepcopy(lm.model).unload(), adapter=None, _fast=_FastState())
    for prompt, n in HF_PROMPTS:
        ids = lm.prompt_ids(prompt)
        want = run(lm, ids, standard(), n).token_ids
        assert run(lm, ids, verify(4, "full"), n).token_ids == want
        assert run(lm, ids, verify(4), n).token_ids == want
        hf = hf_reference(plain, ids, n)
        if want == hf:
            continue
        i = next(j for j in range(min(len(want), len(hf))) if want[j] != hf[j])
        with torch.no_grad():
            top = plain.model(torch.tensor([ids + hf[:i]])).logits[0, -1].float().topk(2).values
        step = 2.0 ** (float(torch.floor(torch.log2(top[0].abs()))) - 7)  # one bf16 step at that magnitude
        assert float(top[0] - top[1]) <= step, (prompt, i, top)


@pytest.mark.slow
@pytest.mark.parametrize("isa", _isa_params(emulated_amx=False))
def test_smollm2_float32_standard_equals_hf_generate(smollm2_adapter, monkeypatch, one_torch_thread, isa):
    """float32: standard decoding with the adapter loaded equals HF generate on the plain base, token for token
    (measured on 12 prompts x 64 tokens, both paths: 12 of 12), and verify equals standard."""
    lm = on_kernels(smollm2_adapter, isa, monkeypatch)
    plain = dataclasses.replace(lm, model=copy.deepcopy(lm.model).unload(), adapter=None, _fast=_FastState())
    for prompt, n in HF_PROMPTS:
        ids = lm.prompt_ids(prompt)
        want = run(lm, ids, standard(), n).token_ids
        assert want == hf_reference(plain, ids, n), prompt
        assert run(lm, ids, verify(4, "full"), n).token_ids == want
