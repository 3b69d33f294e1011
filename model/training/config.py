"""Every training knob, declared once: its default, its help text and its bounds (paper 3.3, 4.1-4.4).

``python -m model.train``'s command line is generated from :class:`TrainConfig`'s fields
(:func:`build_parser`), and :meth:`TrainConfig.validate` checks the bounds declared here plus the rules
that tie knobs together. The paper's own settings: AdamW (0.9, 0.95), weight decay 0.1, grad clip 1.0,
lr 1e-5 after 2000 warm-up steps, N 160 tokens per sequence, k_max 16, hard teacher.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..engine.adapter_format import DEFAULT_MASK_TOKEN
from ..engine.loaded_model import PROMPT_FORMATS
from ..engine.loading import DEFAULT_SOURCE
from ..engine.strategies import DEFAULT_K_MAX, MAX_K_MAX

ADAPTERS = ("full", "lora", "alora")
DEFAULT_LORA_RANK = 16
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
SAVE_DTYPES = ("bfloat16", "float16", "float32")
LR_SCHEDULES = ("constant", "cosine")


def knob(default: Any, help: str, *, choices: Sequence[Any] | None = None, low: float | None = None,
         high: float | None = None, required: bool = False, hidden: bool = False, flags: Sequence[str] = (),
         metavar: str | None = None) -> Any:
    """A :class:`TrainConfig` field with its command-line help and bounds (``low <= value <= high``)."""
    return field(default=default, metadata=dict(help=help, choices=choices, low=low, high=high, required=required,
                                                hidden=hidden, flags=tuple(flags), metavar=metavar))


@dataclass
class TrainConfig:
    """Every option of ``python -m model.train``; each field's help is its ``--flag``'s help."""

    # ---- model and data
    base: str = knob(DEFAULT_SOURCE, "smollm2-135m, a local HF model directory, a .gguf file or a hub id")
    data: str = knob("", "JSONL with question/answer or prompt/response rows, or a datasets id", required=True)
    data_split: str = knob("train", "split for a datasets id")
    output: str = knob("runs/mtp", "run directory (log, checkpoints, final export)")
    prompt_format: str | None = knob(None, "default: chat if the tokenizer has a template", choices=PROMPT_FORMATS)
    mask_token: str = knob(DEFAULT_MASK_TOKEN, "name of the mask token (added with mean init when missing)")
    max_examples: int | None = knob(None, "read at most this many rows", low=1)
    # ---- the objective
    max_steps: int = knob(1000, "optimizer steps", low=1)
    batch_size: int = knob(8, "sequences per process per micro-batch", low=1)
    grad_accum: int = knob(1, "micro-batches per optimizer step", low=1)
    seq_len: int = knob(160, "ground-truth tokens per sequence (prompt included), N", low=4)
    k_max: int = knob(DEFAULT_K_MAX, "largest block size; k is drawn from [k_min, k_max] each step", low=2,
                      high=MAX_K_MAX)
    k_min: int = knob(2, "smallest block size drawn", low=2)
    num_regions: int | None = knob(None, "MTP regions per sequence, M (default N / (2 k_max))", low=1)
    spacing: int | None = knob(None, "region grid spacing in tokens (default 2 k_max)", low=1)
    soft_teacher: bool = knob(False, "match the teacher's distribution instead of its argmax")
    # ---- optimisation
    lr: float = knob(1e-5, "peak learning rate (AdamW, betas 0.9 / 0.95)", low=1e-12)
    warmup: int = knob(2000, "linear warm-up steps", low=0)
    lr_schedule: str = knob("constant", "after warm-up: constant, or cosine decay to 10%% of --lr at --max-steps",
                            choices=LR_SCHEDULES)
    weight_decay: float = knob(0.1, "AdamW weight decay", low=0)
    grad_clip: float = knob(1.0, "gradient norm clip", low=0)
    seed: int = knob(0, "seed of the data order, k and grid offsets, and the adapter's init")
    mixed_precision: str = knob("auto", "auto: bf16 autocast where the device computes bf16 natively (CUDA; CPUs "
                                "with AVX512-BF16 or AMX), else float32", choices=MIXED_PRECISIONS)
    # ---- what trains
    adapter: str | None = knob(None, "default: lora, or full with --lora-rank 0", choices=ADAPTERS)
    lora_rank: int | None = knob(None, "LoRA rank (default 16; with --init-adapter the adapter's own, and a larger "
                                 "value grows it, keeping what it computes); 0 = full fine-tune", low=0)
    lora_alpha: float | None = knob(None, "LoRA alpha (default 2 x rank)", low=0)
    target_modules: str = knob("all-linear", "projections that carry the (a)LoRA adapter: all-linear or names, "
                               "e.g. q_proj,v_proj,down_proj")
    init_adapter: str | None = knob(None, "start from a saved lora/alora adapter directory")
    # ---- the model's own answers
    self_distill_answers: int = knob(0, "train on the base model's own greedy answers to the first N prompts, "
                                     "generated batched into OUTPUT/self_answers.jsonl (or generate them beforehand "
                                     "with python -m model.self_answers and pass that file as --data)", low=0,
                                     metavar="N")
    answer_max_new_tokens: int = knob(256, "longest generated answer (tokens)", low=1)
    answer_batch_size: int = knob(16, "prompts per generate call", low=1)
    reference_share: float = knob(0.0, "with self-answer rows (model.self_answers output): train this share of them "
                                  "on the data's reference answer", low=0, high=1)
    # ---- saving, resuming, budgets
    save_every: int = knob(500, "steps between resumable checkpoints", low=1)
    keep_checkpoints: int = knob(2, "resumable checkpoints kept", low=1)
    compact_checkpoints: bool = knob(False, "store AdamW moments in bf16 (half the size; resume is close, not "
                                     "bit-exact)")
    resume: str | None = knob(None, "checkpoint dir, run dir, or 'auto' (latest in --output)")
    save_dtype: str = knob("bfloat16", "dtype of the exported weights", choices=SAVE_DTYPES)
    export_every: int = knob(0, "also write a loadable export to OUTPUT/exports/step-N every N steps", low=0)
    log_every: int = knob(1, "steps between log lines", low=1)
    max_minutes: float | None = knob(None, "stop (and save) after this much wall-clock training time", low=0)
    max_cpu_minutes: float | None = knob(None, "stop (and save) once the training steps used this much CPU time, "
                                         "counted over resumes (equal-compute comparisons)", low=0)
    # ---- held-out figures during training
    eval_data: str | None = knob(None, "held-out JSONL: teacher agreement at mask positions before and after "
                                 "training")
    eval_examples: int = knob(0, "held-out sequences to score (0 = no evaluation)", low=0)
    eval_k: int = knob(4, "block size of the held-out evaluation", low=2)
    # ---- the machine
    device: str = knob("auto", "auto (CUDA when present, else the CPU), cpu, cuda or cuda:N")
    threads: int | None = knob(None, "torch CPU threads per process; 1 is far faster on a CPU shared with other "
                               "jobs (no OpenMP spin-waits)", low=1)
    # ---- tests only
    debug_crash_after_step: int | None = knob(None, "kill the process after this step (tests of --resume)",
                                              hidden=True)
    debug_dump_params: bool = knob(False, "write a digest of every process's weights (DDP tests)", hidden=True)

    @property
    def kind(self) -> str:
        """``full``, ``lora`` or ``alora`` (``--adapter``, else from ``--lora-rank``)."""
        if self.adapter:
            return self.adapter
        return "full" if self.lora_rank == 0 else "lora"

    def validate(self) -> None:
        """Check every declared bound and choice, then the rules that tie knobs together.

        Raises:
            ValueError: the first impossible setting, naming its ``--flag``.
        """
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            flag = "--" + f.name.replace("_", "-")
            if meta.get("required") and not value:
                raise ValueError(f"{flag} is required ({meta['help']}).")
            if value is None or isinstance(value, bool):
                continue
            if meta.get("choices") and value not in meta["choices"]:
                raise ValueError(f"{flag} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}.")
            low, high = meta.get("low"), meta.get("high")
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f"in [{low:g}, {high:g}]" if high is not None else f"≥ {low:g}"
                raise ValueError(f"{flag} must be {bounds}, got {value}.")
        if self.kind in ("lora", "alora") and self.lora_rank == 0:
            raise ValueError(f"--adapter {self.kind} needs --lora-rank ≥ 1.")
        if self.k_min > self.k_max:
            raise ValueError(f"--k-min must be in [2, --k-max], got {self.k_min} > {self.k_max}.")
        if self.lr_schedule == "cosine" and self.max_steps <= self.warmup:
            raise ValueError("--lr-schedule cosine needs --max-steps > --warmup.")


def _arg_type(annotation: str) -> Any:
    return int if "int" in annotation else float if "float" in annotation else str


def build_parser(prog: str = "python -m model.train", description: str | None = None) -> argparse.ArgumentParser:
    """The command line, one ``--flag`` per :class:`TrainConfig` field (underscores become dashes)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        flags = ["--" + f.name.replace("_", "-"), *meta.get("flags", ())]
        help_text = argparse.SUPPRESS if meta.get("hidden") else meta["help"]
        if "bool" in str(f.type):
            p.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            continue
        kw: dict[str, Any] = dict(dest=f.name, type=_arg_type(str(f.type)), default=f.default, help=help_text)
        if meta.get("choices"):
            kw["choices"] = meta["choices"]
        if meta.get("required"):
            kw["required"] = True
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        p.add_argument(*flags, **kw)
    return p


def config_from_args(argv: Sequence[str] | None = None, description: str | None = None) -> TrainConfig:
    """Parse a command line into a :class:`TrainConfig` (argparse exits with status 2 on a flag it cannot
    parse); call :meth:`TrainConfig.validate` for the bounds."""
    return TrainConfig(**vars(build_parser(description=description).parse_args(argv)))
