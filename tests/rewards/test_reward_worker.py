"""A rule-reward role whose DP replica spans two ranks (tp=2) splits the rows between them and gathers the outcomes:
the same scores as scoring inline in one process, each rank scoring half, failures counted once."""

from __future__ import annotations

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.rewards import RewardRow, RewardRunner
from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import train_tokenizer

USER_REWARD = """
import os

def score(data_source, solution_str, ground_truth, extra_info):
    if extra_info["index"] == 13:
        raise ValueError("row 13 is broken")
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct + extra_info["index"] / 100, "rank": float(os.environ.get("RANK", -1))}
"""


def test_replica_ranks_split_the_rows_and_match_single_process_scores(tmp_path):
    tokenizer = train_tokenizer(task_corpus("arithmetic"), vocab_size=300)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    out = tmp_path / "out.pt"
    finished = torchrun(
        "split_rule_rewards.py",
        str(tmp_path / "tokenizer"),
        str(tmp_path / "user_reward.py"),
        str(out),
        nproc=2,
        timeout=180,
        forked=True,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    result = torch.load(out, weights_only=True)
    texts = tokenizer.batch_decode(
        [row[mask.bool()].tolist() for row, mask in zip(result["responses"], result["response_mask"])],
        skip_special_tokens=True,
    )
    rows = [RewardRow("my/source", text, str(index % 5), {"index": index}) for index, text in enumerate(texts)]
    inline = RewardRunner(f"{tmp_path}/user_reward.py:score")
    expected = inline.summarize(inline.score(rows))
    assert 0 < sum(score >= 1 for score in expected.scores) < len(rows)  # some right, some wrong
    for workers in (0, 1):
        torch.testing.assert_close(result[f"scores_{workers}"], torch.tensor(expected.scores))
        metrics = result[f"metrics_{workers}"]
        assert metrics[f"reward_{workers}/mean"] == pytest.approx(sum(expected.scores) / len(rows))
        # Rows 0-7 were scored on rank 0 and rows 8-15 (13 failing) on rank 1: 7 of the 15 extras come from rank 1.
        assert metrics[f"reward_{workers}/rank/mean"] == pytest.approx(7 / 15)
        assert metrics[f"reward_{workers}/errors"] == 1.0  # counted once, not once per rank of the replica
        assert metrics[f"reward_{workers}/timeouts"] == 0.0 and metrics[f"reward_{workers}/non_finite"] == 0.0
    assert "row 13 is broken" in finished.stdout
