"""Loader for the local gsm8k_mini task: the JSONL beside this file as a datasets.DatasetDict."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_docs(**kwargs) -> datasets.DatasetDict:
    """``{"test": Dataset}`` from gsm8k_mini.jsonl (fields question, answer with "#### number")."""
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_json(str(HERE / "gsm8k_mini.jsonl"))}
    )
