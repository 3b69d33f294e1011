"""GPU check: the engine's equivalences, the benchmark and one app turn on a CUDA device, in a few minutes.

    .venv/bin/python scripts/gpu_check.py                 # CUDA (bf16 by dtype auto); skips without CUDA
    .venv/bin/python scripts/gpu_check.py --device cpu    # the same checks on the CPU (a dry run)

Checks, on the embedded default (SmolLM2-135M-Instruct + the shipped aLoRA adapter) in the device's
``auto`` dtype, each printed as PASS / DIFF with its numbers:

1. fast path vs library path (transformers + peft): logits of a prefill, a standard pass and MTP passes
   (real rows and mask rows: largest difference, argmax agreement), and the two KV caches;
2. standard decoding with the adapter loaded == HF ``generate`` on the plain base, token for token
   (3 prompts x 64 new tokens);
3. lossless ``verify`` == standard decoding, in the linear layout and as a full tree of mask blocks
   (same prompts; in bf16 a near-tie may part them, see docs/DESIGN.md), and after each run the KV
   cache == a fresh prefill of the kept tokens; the width curve and the layout it would choose;
4. ``model.bench`` (tokens/s against HF ``generate``, the width curve, bandwidth achieved against measured);
5. one app turn through ``app.turn`` (standard and ConfAdapt side by side, effective k, speedup).

Exit status: 0 when every equivalence holds or the device is absent (skipped), 1 when one differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "Janet has 3 apples and buys 5 more. How many apples does she have? Think step by step.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Name three rivers in Europe and the seas they flow into.",
]


def report(name: str, ok: bool, detail: str) -> bool:
    print(f"[{'PASS' if ok else 'DIFF'}] {name}: {detail}", flush=True)
    return ok


def check_paths(lm) -> bool:
    """Fast path vs library path over a decoder-like pass schedule (prefill + 3 masks, standard pass,
    pending + masks); returns True when real rows agree within rounding and mask-row argmaxes agree."""
    from transformers import DynamicCache

    if lm.fast_engine() is None:
        return report("fast vs library path", True, f"no fast path here ({lm.forward_path}); nothing to compare")
    m = lm.mask_token_id
    ids = lm.prompt_ids(PROMPTS[0])
    schedule = [(ids + [m] * 3, 3, 4, 3), ([101], 0, 1, 0), ([102, 103] + [m] * 3, 3, 5, 3)]
    lib, fast = DynamicCache(config=lm.model.config), lm.new_cache()
    real_diff = mask_rel = 0.0
    agree = total = 0
    with torch.inference_mode():
        for toks, n_masks, keep, crop in schedule:
            x = torch.tensor([toks], device=lm.device)
            a = lm.forward(x, lib, num_masks=n_masks, logits_to_keep=keep)[0].float()
            b = lm.forward(x, fast, num_masks=n_masks, logits_to_keep=keep)[0].float()
            real = a.shape[0] - n_masks
            real_diff = max(real_diff, float((a[:real] - b[:real]).abs().max()))
            if n_masks:
                am, bm = a[real:], b[real:]
                mask_rel = max(mask_rel, float((am - bm).abs().max() / am.abs().max()))
                agree += int((am.argmax(-1) == bm.argmax(-1)).sum())
                total += n_masks
            agree += int((a[:real].argmax(-1) == b[:real].argmax(-1)).sum())
            total += real
            if crop:
                lib.crop(-crop)
                fast.crop(-crop)
    cache_diff = max(float((x.keys.float() - y.keys.float()).abs().max()) for x, y in zip(fast.layers, lib.layers))
    ok = agree >= total - 1 and mask_rel <= 0.05
    return report("fast vs library path", ok, f"real rows max |diff| {real_diff:.3g}, mask rows max rel diff "
                  f"{mask_rel:.3g}, argmax equal {agree}/{total}, cache keys max |diff| {cache_diff:.3g}")


def check_standard_and_verify(lm, new_tokens: int) -> bool:
    """Standard decoding == HF generate on the plain base; verify == standard; cache == fresh prefill."""
    from model.evaluation.speed import plain_base
    from model.engine.decoding import Decoder, hf_generate, run
    from model.engine.strategies import standard, verify

    plain = plain_base(lm)
    ok = True
    for i, prompt in enumerate(PROMPTS):
        ids = lm.prompt_ids(prompt)
        std = run(lm, ids, standard(), new_tokens)
        ref = hf_generate(plain, ids, new_tokens)
        ok &= report(f"standard == HF generate, prompt {i + 1}", std.token_ids == ref,
                     f"{len(std.token_ids)} tokens" + ("" if std.token_ids == ref else
                                                      f", first difference at token {_first_diff(std.token_ids, ref)}"))
        for layout in ("linear", "full"):
            dec = Decoder(lm, ids, verify(lm.default_k_max, layout), new_tokens)
            for _ in dec:
                pass
            out = dec.result()
            same = out.token_ids == std.token_ids
            where = "" if same else f", parts at token {_first_diff(out.token_ids, std.token_ids)} (bf16 near-tie?)"
            report(f"verify ({layout}) == standard, prompt {i + 1}", same,
                   f"mean acceptance length {out.mean_acceptance_length:.2f}, acceptance by position "
                   f"{[round(x, 2) for x in out.acceptance_by_position if x is not None]}{where}")
            ok &= same or lm.dtype != torch.float32
        with torch.inference_mode(), lm.base_model():
            fresh = lm.model(torch.tensor([dec.cached_ids], device=lm.device), use_cache=True).past_key_values
        diff = max(float((x.keys.float() - y.keys.float()).abs().max())
                   for x, y in zip(dec.cache.layers, fresh.layers))
        scale = max(float(y.keys.float().abs().max()) for y in fresh.layers)
        ok &= report(f"KV cache == fresh prefill, prompt {i + 1}", diff <= 0.02 * scale,
                     f"max |diff| {diff:.3g} (keys up to {scale:.3g}; tolerance 2%)")
    return ok


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_app_turn(device: str, new_tokens: int) -> bool:
    """One turn through the app's turn module on this device: both sides finish, the counters add up."""
    from functools import partial

    from app.registry import ModelRegistry
    from app.requests import TurnRequest
    from app.turn import prepare_turn, run_turn
    from model.engine.loading import load_checkpoint

    registry = ModelRegistry(loader=partial(load_checkpoint, device=device))
    turn = prepare_turn(registry, TurnRequest("Janet has 3 ducks and buys 2 more. How many ducks does she have?",
                                              strategy="ConfAdapt", tau=0.9, max_new_tokens=new_tokens))
    state = None
    for state in run_turn(turn):
        pass
    speed = state.speed
    ok = state.phase == "done" and state.standard.new_tokens > 0 and state.mtp.new_tokens > 0
    return report("app turn", ok, f"phase {state.phase}; standard {state.standard.new_tokens} tokens in "
                  f"{state.standard.forward_passes} passes; ConfAdapt {state.mtp.new_tokens} tokens in "
                  f"{state.mtp.forward_passes} passes (effective k {state.mtp.effective_k:.2f}); speedup "
                  f"{speed.ratio:.2f}x" if speed else "no speed estimate")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt in checks 2, 3, 5")
    p.add_argument("--no-bench", action="store_true", help="skip check 4")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: skipped (use --device cpu for a dry run on the CPU).")
        return 0
    from model.engine.loading import load_checkpoint

    t0 = time.perf_counter()
    lm = load_checkpoint("smollm2-135m", device=args.device)
    name = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "cpu"
    print(f"gpu_check on {name}: {lm.dtype_name}, {lm.forward_path}; loaded in {time.perf_counter() - t0:.1f} s")
    ok = check_paths(lm)
    ok &= check_standard_and_verify(lm, args.new_tokens)
    from model.engine.width import choose_verify_layout, conditional_acceptance, pass_costs

    costs = pass_costs(lm, widths=(1, 2, 4, 8, 16, 32))
    k, blocks, gain = choose_verify_layout(costs, conditional_acceptance([0.67, 0.42, 0.22]), 8)
    print(f"width curve (ms by tokens fed): {({w: round(1e3 * c, 2) for w, c in costs.items()})}; with acceptance "
          f"0.67 / 0.42 / 0.22 the fastest lossless setting is k_max {k}, blocks {blocks or 'linear'} "
          f"({gain:.2f}x standard decoding)", flush=True)
    if not args.no_bench:
        from model import bench

        print("--- model.bench", flush=True)
        bench.main(["--device", args.device, "--prompts", "3", "--max-new-tokens", str(args.new_tokens),
                    "--repeats", "3", "--strategies", "standard,confadapt:0.9,verify"])
    ok &= check_app_turn(args.device, args.new_tokens)
    print(f"gpu_check: {'all equivalences hold' if ok else 'SOME CHECKS DIFFER (see DIFF lines)'}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
