"""The dataset of tiny_mc.yaml: the rows of tiny_mc.jsonl as one `test` split (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_dataset(**_: Any):
    import datasets

    lines = Path(__file__).with_name("tiny_mc.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
