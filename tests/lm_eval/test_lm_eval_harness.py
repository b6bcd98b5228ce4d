"""lm-eval-harness against meterserve: its `local-completions` backend (echo + logprobs over
HTTP, what loglikelihood tasks send) and its `hf` backend on the same weights, both in float32,
must give every (context, choice) pair the same loglikelihood within 1e-3.

The task is our own (tiny_mc.yaml: six questions from tiny_mc.jsonl, no download). Each run is
lm-eval's `simple_evaluate` in a subprocess (lm_eval_run.py), offline. The server chunks prefill
(a 32-token step budget over batches of four prompts), so prompt logprobs that span chunks are
covered too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import ServerProcess

from engine.loader import hf_checkpoint_dir

pytest.importorskip("lm_eval", reason="lm-eval-harness is not installed (pip install lm-eval)")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-3
RUN_TIMEOUT_S = 300


def run_lm_eval(model: str, model_args: dict[str, object]) -> dict[int, list]:
    """lm-eval on the task in a child process (lm_eval_run.py); per document, each choice's
    [loglikelihood, is_greedy]."""
    args = ",".join(f"{key}={value}" for key, value in model_args.items())
    command = [sys.executable, str(HERE / "lm_eval_run.py"), model, args]
    if model == "hf":
        command.append("cpu")
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        command,
        cwd=REPO,
        env=os.environ | offline,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (
        f"lm-eval {model} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    results = json.loads(done.stdout.strip().splitlines()[-1])  # the child's last line
    return {int(doc_id): choices for doc_id, choices in results.items()}


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_local_completions_agrees_with_hf_backend(tmp_path: Path) -> None:
    model_dir = hf_checkpoint_dir("default")  # the served GGUF's cached HF conversion
    server = ServerProcess(
        "lm-eval", ["--dtype", "float32", "--max-num-batched-tokens", "32"], tmp_path
    )
    with server.running():
        served = run_lm_eval(
            "local-completions",
            {
                "model": MODEL,
                "base_url": f"{server.base_url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": model_dir,
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 1,
            },
        )
    reference = run_lm_eval("hf", {"pretrained": model_dir, "dtype": "float32"})
    assert sorted(served) == sorted(reference) == list(range(6))
    worst = 0.0
    for doc_id, choices in reference.items():
        assert len(served[doc_id]) == len(choices)
        for (got, got_greedy), (want, want_greedy) in zip(served[doc_id], choices, strict=True):
            worst = max(worst, abs(got - want))
            assert got == pytest.approx(want, abs=TOLERANCE), (doc_id, got, want)
            assert got_greedy == want_greedy, (doc_id, got, want)
    print(f"largest loglikelihood difference over {sum(map(len, reference.values()))}: {worst}")
