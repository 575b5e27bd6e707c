"""``spmd-rlhf forward``: greedy continuation equal to ``transformers``' ``generate``, and the command on a tiny model
(the ``make-tiny`` command itself: ``tests/tiny/test_model.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rlhf.models import load_model
from spmd_rlhf.models.demo import greedy_continue
from spmd_rlhf.tiny.model import make_tiny

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def test_greedy_continue_matches_transformers_generate(tmp_path):
    make_tiny(family="llama", out_dir=str(tmp_path), seed=1)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    input_ids = torch.tensor([tokenizer.encode("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")])
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    expected = reference.generate(input_ids, max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)[
        0, input_ids.shape[1] :
    ]
    ours = greedy_continue(load_model(str(tmp_path)), input_ids, max_new_tokens=6, eos_token_id=None)
    assert ours == expected.tolist()


def test_forward_cli_runs_on_a_tiny_model(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC}
    model_dir = make_tiny(family="qwen2", out_dir=str(tmp_path / "model"))
    result = subprocess.run(
        [sys.executable, "-m", "spmd_rlhf.cli", "forward", "--model", model_dir, "--prompt", "3+4="],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "greedy reply:" in result.stdout and "model: qwen2" in result.stdout
