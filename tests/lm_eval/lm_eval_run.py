"""One lm-eval-harness run of the tiny_mc task (child process of test_lm_eval_harness.py).

    python lm_eval_run.py MODEL MODEL_ARGS [DEVICE]

Runs lm-eval's `simple_evaluate` with a TaskManager that indexes only this folder: indexing
lm-eval's ~27,000 built-in task files (what its CLI does, with no way to turn it off) took
most of a run. Prints, as one JSON object, each document's [loglikelihood, is_greedy] per
choice, keyed by doc_id.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

TASK = "meterserve_tiny_mc"


def main(model: str, model_args: str, device: str | None = None) -> None:
    tasks = TaskManager(include_path=str(Path(__file__).resolve().parent), include_defaults=False)
    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        batch_size=4,
        device=device,
        log_samples=True,
        task_manager=tasks,
    )
    results = {}
    for sample in out["samples"][TASK]:
        # resps: one list per choice holding that request's (loglikelihood, is_greedy).
        results[sample["doc_id"]] = [
            [float(resp[0][0]), resp[0][1] in (True, "True")] for resp in sample["resps"]
        ]
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
