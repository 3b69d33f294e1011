"""The command-line tools (model/*.py): exit status, one ``error:`` line for bad input (before any
model is loaded where possible), their output; scripts/gpu_check.py. Library behaviour is tested
with its module (tests/engine, tests/training, tests/evaluation)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model.bench as bench_cli
import model.evaluate as evaluate_cli
import model.train as train_cli
from model.engine.decoding import Decoder, generate
from model.engine.strategies import confadapt
from model.evaluation.speed import HF
from tests.conftest import (
    ACCURACY_FIELDS,
    GSM8K_PROBLEMS,
    GSM8K_SAMPLE,
    ROOT,
    TASK_DIR,
    make_tiny,
    train_args,
    write_jsonl,
)


# ----------------------------------------------------- python -m model.generate
@pytest.mark.integration
def test_cli_json(smollm2, capsys):
    """``--json`` on the real model, in-process (the same entry point as ``python -m model.generate``, which
    the tiny-model tests below run as a process)."""
    from model.generate import main

    assert main(["--prompt", "What is 2+2?", "--strategy", "confadapt", "--tau", "0.9", "--k-max", "16",
                 "--max-new-tokens", "16", "--json", "--no-adapter"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) >= {"text", "new_tokens", "forward_passes", "effective_k", "seconds", "passes"}
    assert obj["new_tokens"] == sum(len(p["kept"]) for p in obj["passes"]) <= 16
    assert obj["forward_passes"] == len(obj["passes"])
    assert obj["passes"][0]["fed_masks"] == 15 and len(obj["passes"][0]["confidences"]) == 16
    assert obj["text"] == generate(smollm2, "What is 2+2?", confadapt(0.9, 16), 16).text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "hi", "--tau", "1.5"], "tau must be in"),
        (["--prompt", "hi", "--k-max", "0"], "k_max must be"),
        (["--prompt", "hi", "--strategy", "static", "--k", "5", "--k-max", "4"], "cannot exceed"),
        (["--prompt", "hi", "--model", "no/such/model/path"], "No such local model"),
        (["--prompt", "hi", "--model", "bogus source"], "Unknown model source"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["--prompt", "hi", "--strategy", "bogus"], "Unknown strategy 'bogus'"),
        (["--prompt", "hi", "--device", "banana"], "Unknown device 'banana'"),
        (["--prompt", "hi", "--strategy", "confadapt:1.5"], "tau must be in"),
        (["--prompt", "hi", "--strategy", "static:abc"], "Bad strategy 'static:abc'"),
        (["--prompt", "hi", "--strategy", "confadapt:0.9", "--k-max", "0"], "k_max must be"),
        (["--prompt", "hi", "--strategy", "verify:4:bogus"],
         "Bad strategy 'verify:4:bogus': a verify layout is linear, full or prefixes"),
        (["--prompt", "hi", "--strategy", "confadapt", "--k", "7"],
         "--k does nothing with --strategy confadapt (it is static k's block size)"),
        (["--prompt", "hi", "--strategy", "verify", "--tau", "0.5"], "--tau does nothing with --strategy verify"),
        (["--prompt", "hi", "--strategy", "standard", "--k-max", "4"], "--k-max does nothing with --strategy standard"),
    ],
)
def test_cli_bad_input(args, message, capsys):
    """Bad arguments: exit 2 and one ``error:`` line, before any model is loaded."""
    from model.generate import main

    assert main(args) == 2  # in-process: the same entry point as `python -m model.generate`
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, base_tokenizer):
    """Two local model directories: a healthy tiny Llama and one whose output layer holds a NaN."""
    root = tmp_path_factory.mktemp("safety")
    tok = copy.deepcopy(base_tokenizer)
    for name, poison in (("ok", False), ("nan", True)):
        model = make_tiny(tok)
        if poison:
            with torch.no_grad():
                model.model.norm.weight[0] = float("nan")
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def run_generate_isolated(*args):
    """``python -m model.generate ARGS`` in a minimal environment (one thread)."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "model.generate", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_overflow_exits_2_with_the_limit(tiny_dirs):
    r = run_generate_isolated("--model", str(tiny_dirs / "ok"), "--prompt", "hi", "--max-new-tokens", "5000", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert "2048 (max_position_embeddings)" in r.stderr and "Traceback" not in r.stderr


def test_cli_json_is_strict_on_a_nan_model(tiny_dirs, capsys):
    """In-process (the test above runs the entry point as a process): exit 1, the reason on stderr, no JSON."""
    from model.generate import main

    assert main(["--model", str(tiny_dirs / "nan"), "--prompt", "hi", "--max-new-tokens", "4", "--json"]) == 1
    out = capsys.readouterr()
    assert "NaN or infinite logits" in out.err and "Traceback" not in out.err
    assert out.out == ""


def test_cli_samples(tiny_dirs, capsys):
    """``--temperature`` samples; ``--num-samples N`` prints a JSON list of N answers (text, ids, the seed each
    used: seed, seed + 1, ...), the same list on a rerun with the same seed."""
    from model.generate import main

    args = ["--model", str(tiny_dirs / "ok"), "--prompt", "hi", "--max-new-tokens", "6", "--strategy", "verify",
            "--k-max", "3", "--temperature", "1.5", "--top-p", "0.9", "--seed", "3", "--num-samples", "3", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert isinstance(first, list) and len(first) == 3
    assert [o["sampling"]["seed"] for o in first] == [3, 4, 5]
    assert all(o["sampling"]["temperature"] == 1.5 and len(o["ids"]) == o["new_tokens"] for o in first)
    assert len({tuple(o["ids"]) for o in first}) > 1
    assert main(args) == 0
    assert [o["ids"] for o in json.loads(capsys.readouterr().out)] == [o["ids"] for o in first]


@pytest.mark.parametrize("args, message", [
    (["--num-samples", "2"], "set --temperature above 0"),
    (["--temperature", "-1"], "temperature must be"),
    (["--temperature", "0.7", "--top-p", "0"], "top-p must be"),
    (["--temperature", "0.7", "--top-k", "-2"], "top-k must be"),
    (["--temperature", "0.7", "--num-samples", "0"], "--num-samples must be"),
])
def test_cli_bad_sampling(args, message, capsys):
    from model.generate import main

    assert main(["--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# -------------------------------------------------------- python -m model.train
@pytest.mark.parametrize("content,line,reason", [
    ('{"question": "a?", "answer": "b"}\n{"question": "c?"}\n', 2, "missing field 'answer'"),
    ('{"question": "a?", "answer": "b"}\n{"text": "c"}\n', 2, "missing field 'question' or 'prompt'"),
    ("", None, "no examples (the file is empty)"),
    ('{"question": "a?", "answer": "b"}\n\n{"question": "c?", answer: 1}\n', 3, "not valid JSON"),
    ('["question", "answer"]\n', 1, "expected a JSON object"),
])
def test_bad_data_stops_before_training(tiny_train_dir, tmp_path, capsys, content, line, reason):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    out = tmp_path / "run"
    code = train_cli.main(["--base", str(tiny_train_dir / "model"), "--data", str(bad), "--output", str(out), "--max-steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    where = f"{bad}:{line}:" if line else f"{bad}:"
    assert where in err and reason in err, err
    assert not (out / "train_log.jsonl").exists()  # no training step ran


def test_undecodable_and_malformed_files_name_file_line_and_column(tiny_train_dir, tmp_path, capsys):
    """A binary file and a row missing its closing brace stop the run with file:line:column (the column of
    the problem in the line as written, not counting its newline)."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b'{"question": "a?", "answer": "b"}\n' + bytes([0x50, 0x4b, 0x8c, 0x00, 0xff]) * 20)
    row = '{"question": "What is 2+2?", "answer": "2 plus 2 is 4 #### 4"'  # no closing brace: at the line's end
    broken = tmp_path / "broken.jsonl"
    broken.write_text(row + "\n")
    for path, where, why in ((binary, f"{binary}:2:3:", "not UTF-8 text (byte 0x8c)"),
                             (broken, f"{broken}:1:{len(row) + 1}:", "not valid JSON")):
        code = train_cli.main(["--base", str(tiny_train_dir / "model"), "--data", str(path), "--output",
                               str(tmp_path / "run"), "--max-steps", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {where}") and why in err[0], err


@pytest.mark.parametrize("device, why", [("banana", "Unknown device 'banana'"), ("cuda", "cannot run here"),
                                         ("cuda:7", "cannot run here")])
def test_every_cli_refuses_a_device_it_cannot_run(tiny_train_dir, tmp_path, capsys, device, why):
    """``--device`` values that cannot run give one ``error:`` line and exit 2, in every CLI that takes one."""
    if torch.cuda.is_available() and device != "banana":
        pytest.skip("this machine has CUDA")
    import model.generate as generate_cli
    import model.self_answers as self_answers_cli

    data = str(tiny_train_dir / "data.jsonl")
    model_dir = str(tiny_train_dir / "model")
    calls = [
        (generate_cli.main, ["--model", model_dir, "--prompt", "hi", "--device", device]),
        (train_cli.main, train_args(tiny_train_dir, tmp_path / "t", "--device", device)),
        (evaluate_cli.main, ["--model", model_dir, "--data", str(GSM8K_SAMPLE), "--device", device,
                             "--out", str(tmp_path / "e.json")]),
        (bench_cli.main, ["--model", model_dir, "--device", device]),
        (self_answers_cli.main, ["--base", model_dir, "--data", data, "--out", str(tmp_path / "a.jsonl"),
                                 "--device", device]),
    ]
    for main, argv in calls:
        assert main(argv) == 2, main.__module__
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and why in err[0], (main.__module__, err)


def test_fsdp_launch_of_an_adapter_is_refused_before_loading(tiny_train_dir, tmp_path, capsys, monkeypatch):
    """Under ``accelerate launch --use_fsdp`` (it sets ACCELERATE_USE_FSDP): LoRA / aLoRA are refused (the
    teacher is the student with its adapter off, which peft cannot do in sharded modules); full
    fine-tunes shard (tests/training/test_trainer.py)."""
    for kind, why in ((["--adapter", "alora"], "FSDP trains full fine-tunes only"),
                      (["--lora-rank", "4"], "FSDP trains full fine-tunes only")):
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        out = tmp_path / f"fsdp{len(kind)}{kind[-1]}"
        assert train_cli.main(train_args(tiny_train_dir, out, "--max-steps", "1", *kind)) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err
        assert not out.exists() or not any(out.iterdir())  # nothing loaded, nothing written


def test_bad_options_are_rejected(tiny_train_dir, tmp_path, capsys):
    assert train_cli.main(train_args(tiny_train_dir, tmp_path / "r", "--k-max", "1")) == 2
    assert "--k-max must be in [2, 64]" in capsys.readouterr().err
    assert train_cli.main(train_args(tiny_train_dir, tmp_path / "r", "--adapter", "alora", "--lora-rank", "0")) == 2
    assert "needs --lora-rank" in capsys.readouterr().err


# ----------------------------------------------------- python -m model.evaluate
def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert evaluate_cli.main(["--data", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith("none.jsonl: no such data file.")
    d = write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS)
    assert evaluate_cli.main(["--data", str(d), "--strategies", "confadapt:2"]) == 2
    assert "tau" in capsys.readouterr().err
    assert evaluate_cli.main(["--data", str(d), "--out", str(tmp_path / "x.txt")]) == 2
    assert ".json" in capsys.readouterr().err
    assert evaluate_cli.main(["--data", str(d), "--max-new-tokens", "0"]) == 2
    assert evaluate_cli.main(["--strategies", "standard"]) == 2
    assert "--data is required" in capsys.readouterr().err
    assert evaluate_cli.main(["--rescore", str(d)]) == 2  # a JSONL file is not a report
    err = capsys.readouterr().err
    assert err.startswith("error: cannot rescore") and f"{d}:" in err and "not a report" in err
    assert evaluate_cli.main(["--rescore", str(tmp_path / "gone.json")]) == 2
    err = capsys.readouterr().err
    assert "gone.json: No such file or directory" in err and err.count("\n") == 1


def test_cli_rescore_writes_the_sweep_of_a_stopped_run(tiny_lm, tmp_path, capsys):
    """``--rescore REPORT --sweep PATH``: the sweep of the problems a (stopped) run finished, as a full run writes
    it."""
    from model.engine.strategies import parse_strategies
    from model.evaluation.accuracy import evaluate
    from model.evaluation.gsm8k import load_problems
    from model.evaluation.sweep import from_report, load_sweep

    problems = load_problems(write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS), None)
    report = evaluate(tiny_lm, problems, parse_strategies("standard,confadapt:0.9:4,verify:4", 4),
                      max_new_tokens=8, progress=False)
    saved = tmp_path / "partial.json"
    saved.write_text(json.dumps(report))
    assert evaluate_cli.main(["--rescore", str(saved), "--sweep", str(tmp_path / "adapter" / "sweep.json")]) == 0
    assert "wrote" in capsys.readouterr().out
    sweep = from_report(report)
    assert load_sweep(tmp_path / "adapter") == sweep
    assert [p.spec for p in sweep.points] == ["standard", "confadapt:0.9:4", "verify:4"]
    assert [p.effective_k for p in sweep.points] == [r["effective_k_mean"] for r in report["strategies"]]
    assert json.loads((tmp_path / "adapter" / "sweep.json").read_text()) == json.loads(json.dumps(sweep.to_dict()))


def test_cli_shards_merge_into_the_report_of_one_run(tiny_lm, tmp_path, capsys):
    """Two shards (``--offset``/``--limit``) merged with ``--rescore A B --out ALL``: the problems, texts and
    every summary figure but the timings equal one run over both problems; overlapping or mismatched
    shards are refused with one error line."""
    from model.engine.strategies import parse_strategies
    from model.evaluation.accuracy import evaluate
    from model.evaluation.gsm8k import load_problems

    data = write_jsonl(tmp_path / "d.jsonl", GSM8K_PROBLEMS)
    strategies = parse_strategies("standard,confadapt:0.5:4", 4)

    def report(**kw):
        return evaluate(tiny_lm, load_problems(data, **kw), strategies, max_new_tokens=8, progress=False)

    whole = report()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report(limit=1)))
    b.write_text(json.dumps(report(offset=1)))
    out = tmp_path / "all.json"
    assert evaluate_cli.main(["--rescore", str(b), str(a), "--out", str(out)]) == 0  # any order
    merged = json.loads(out.read_text())
    assert [row["index"] for row in merged["problems"]] == [0, 1]
    assert merged["config"]["n_problems"] == 2 and merged["config"]["complete"] and merged["config"]["merged_from"] == 2
    assert [[r["text"] for r in row["results"].values()] for row in merged["problems"]] == \
        [[r["text"] for r in row["results"].values()] for row in whole["problems"]]
    timing = {"seconds", "tokens_per_second"}
    for m, w in zip(merged["strategies"], whole["strategies"]):
        assert {k: v for k, v in m.items() if k not in timing} == json.loads(json.dumps(
            {k: v for k, v in w.items() if k not in timing}))
    capsys.readouterr()
    for argv, why in ((["--rescore", str(a), str(a), "--out", str(out)], "Problem 0 is in two reports"),
                      (["--rescore", str(a), str(b)], "name it with --out")):
        assert evaluate_cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: cannot rescore") and why in err[0]
    other = json.loads(b.read_text())
    other["config"]["max_new_tokens"] = 16
    b.write_text(json.dumps(other))
    assert evaluate_cli.main(["--rescore", str(a), str(b), "--out", str(out)]) == 2
    assert "differs from report 1 in max_new_tokens" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_cli_two_gsm8k_problems_default_model(tmp_path, capsys):
    data = GSM8K_SAMPLE
    out = tmp_path / "eval" / "smollm2.json"
    threads = torch.get_num_threads()
    try:
        rc = evaluate_cli.main(["--data", str(data), "--limit", "2", "--max-new-tokens", "12", "--no-progress",
                                 "--strategies", "standard,static:2,confadapt:0.9:4", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["n_problems"] == 2 and rep["config"]["complete"] and rep["config"]["model"] == "smollm2-135m"
    assert [r["strategy"] for r in rep["strategies"]] == ["standard", "static:2", "confadapt:0.9:4"]
    for r in rep["strategies"]:
        assert ACCURACY_FIELDS <= set(r) and r["n"] == 2 and 0.0 <= r["accuracy"] <= 1.0
        assert r["nll_teacher"] > 0 and r["tokens_per_second"] > 0 and r["new_tokens"] > 0
    by = {r["strategy"]: r for r in rep["strategies"]}
    assert by["standard"]["effective_k_mean"] == 1.0 and by["standard"]["agreement_with_standard"] == 1.0
    assert 1.0 <= by["confadapt:0.9:4"]["effective_k_mean"] <= 4.0
    assert by["static:2"]["effective_k_mean"] == pytest.approx(2.0, abs=0.25)  # only a stop token cuts a block
    if not rep["config"]["mtp_trained"]:
        # an untrained mask token: static k=2's second tokens are poor guesses, worse under the teacher
        assert by["static:2"]["nll_teacher"] > by["standard"]["nll_teacher"]
    assert len(rep["problems"]) == 2 and all(set(p["results"]) == set(by) for p in rep["problems"])
    assert Path(rep["figure"]["html"]).is_file()
    assert rep["figure"]["png"] is None or Path(rep["figure"]["png"]).is_file()
    assert "static k=2" in capsys.readouterr().out


# -------------------------------------------------------- python -m model.bench
@pytest.mark.parametrize("args", [["--repeats", "0"], ["--strategies", "fast"], ["--max-new-tokens", "-1"],
                                  ["--widths", "1,x"], ["--widths", "0"], ["--prompts", "0"],
                                  ["--data", "/no/such/file.jsonl"], ["--concurrency", "2", "--arrivals", "late"],
                                  ["--concurrency", "2", "--max-rows", "0"],
                                  ["--concurrency", "2", "--concurrency-repeats", "0"], ["--width-context", "-1"]])
def test_bench_cli_bad_input(args, capsys):
    assert bench_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_cli_on_smollm2(tmp_path, capsys, dtype):
    """What every CPU gives: standard decoding equals HF ``generate`` token for token in float32; in bf16 our
    kernels sum in their own order (not oneDNN's), so only verify == standard (rows exact) is promised there."""
    data = tmp_path / "q.jsonl"
    row = {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"} if dtype == "float32" else {
        "prompt": "What is 3 + 4?"}  # GSM8K rows or prompt rows
    data.write_text(json.dumps(row) + "\n")
    out = tmp_path / "bench.json"
    assert bench_cli.main(["--data", str(data), "--prompts", "1", "--repeats", "1", "--max-new-tokens", "4", "--widths", "1,2",
                           "--width-repeats", "1", "--no-bandwidth", "--no-llama-cpp", "--strategies", "standard,verify:2", "--threads", "1",
                           "--dtype", dtype, "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["prompts"] == 1 and rep["config"]["adapter"] == "alora" and rep["config"]["dtype"] == dtype
    assert [r["method"] for r in rep["methods"]] == [HF, "standard", "verify:2"]
    assert rep["verify_matches_standard"] == {"verify:2": True}
    if dtype == "float32":
        assert rep["standard_matches_hf"] is True
    text = capsys.readouterr().out
    assert "HF generate, plain base" in text and "ours + adapter" in text


@pytest.mark.integration
def test_bench_cli_samples(tmp_path, capsys):
    """``--temperature``: every method samples (seed 0 unless given), no output-equality claims, acceptance by
    draft position reported."""
    out = tmp_path / "bench.json"
    assert bench_cli.main(["--prompts", "1", "--repeats", "1", "--max-new-tokens", "8", "--widths", "", "--no-bandwidth",
                           "--strategies", "standard,verify:3", "--threads", "1", "--temperature", "0.7",
                           "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 0}
    assert rep["standard_matches_hf"] is None and rep["verify_matches_standard"] == {}
    row = next(r for r in rep["methods"] if r["method"] == "verify:3")
    assert row["acceptance_by_position"] and "llama_cpp" in rep
    assert "temperature 0.7" in capsys.readouterr().out


# -------------------------------------------------- python -m model.lm_eval_mtp
@pytest.mark.integration
@pytest.mark.slow
def test_cli_lm_eval_mtp_on_local_task_default_model(tmp_path, smollm2, capsys):
    """``python -m model.lm_eval_mtp --model mtp ...`` with the real SmolLM2 on tests/data/gsm8k_mini."""
    from model.lm_eval_mtp import main

    stats = tmp_path / "stats.json"
    args = ["--model", "mtp",
           # dtype float32 explicitly: the check below decodes with the float32 smollm2 fixture
           "--model_args", f"pretrained=smollm2-135m,tau=0.9,k_max=16,max_gen_toks=24,dtype=float32,"
                           f"stats_file={stats}",
           "--tasks", "gsm8k_mini", "--include_path", str(TASK_DIR), "--limit", "3",
           "--output_path", str(tmp_path / "out"), "--log_samples"]
    argv = list(sys.argv)
    assert main(args) == 0  # in-process: the same entry point as `python -m model.lm_eval_mtp`
    assert sys.argv == argv  # lm-eval's CLI read its own; the caller's is back
    out = capsys.readouterr()
    assert "gsm8k_mini" in out.out and "exact_match" in out.out
    assert "mtp confadapt:0.9:16: 3 requests" in out.err and "effective k" in out.err
    s = json.loads(stats.read_text())
    assert s["requests"] == 3 and s["strategy"] == "confadapt:0.9:16" and s["effective_k"] >= 1.0
    [results_file] = list((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(results_file.read_text())["results"]["gsm8k_mini"]["exact_match,flexible-extract"]
    [samples_file] = list((tmp_path / "out").rglob("samples_gsm8k_mini_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 3 and acc == pytest.approx(sum(x["exact_match"] for x in samples) / 3)
    sample = samples[0]
    # the harness's answer for the first problem is our ConfAdapt decoding of the same context, cut at a stop string
    ctx, gen_kwargs = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
    assert gen_kwargs["max_gen_toks"] == 32  # the task's value wins over the model's default (24)
    dec = Decoder(smollm2, smollm2.tokenizer(ctx, add_special_tokens=False)["input_ids"], confadapt(0.9, 16), 32)
    text = ""
    for rec in dec:
        text += rec.text
        if any(u in text for u in ("Question:", "\n\n", "<|im_end|>")):
            break
    text = dec.result().text
    for u in ("Question:", "\n\n", "<|im_end|>"):
        text = text.split(u, 1)[0]
    assert sample["resps"][0][0] == text


# --------------------------------------------------------- scripts/gpu_check.py
def test_gpu_check_skips_cleanly_without_cuda():
    """scripts/gpu_check.py (the engine's checks on a CUDA device) exits 0 with one line where there is
    no CUDA device; its CPU dry run (``--device cpu``) is run by hand, see the script's docstring."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: run scripts/gpu_check.py itself")
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("gpu_check: no CUDA device here: skipped "
                                  "(use --device cpu for a dry run on the CPU).")


# -------------------------------------------------------- python -m model.sweep
def test_sweep_cli_measures_any_prompts(tiny_dirs, tmp_path, capsys):
    """Prompt rows without answers (e.g. the Magpie held-out file): a sweep the app can draw, and a table."""
    from model.evaluation.sweep import load_sweep
    from model.sweep import main

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Name a colour."}, {"question": "Why is the sky blue?"}])
    out = tmp_path / "adapter" / "sweep.json"
    assert main(["--model", str(tiny_dirs / "ok"), "--data", str(data), "--strategies", "confadapt:0.5:2,verify:2",
                 "--max-new-tokens", "4", "--out", str(out)]) == 0
    sweep = load_sweep(out.parent)
    assert [p.spec for p in sweep.points] == ["standard", "confadapt:0.5:2", "verify:2"] and sweep.n_prompts == 2
    assert sweep.data == str(data)  # the prompts' file, for the record
    assert sweep.named("verify")[0].agreement_with_standard == 1.0  # lossless
    assert "eff. k" in capsys.readouterr().out
    assert main(["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["--data", str(data), "--strategies", "fast"]) == 2
