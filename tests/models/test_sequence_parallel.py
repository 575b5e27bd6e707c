"""Sequence parallelism (``<role>.sequence_parallel``, ``models.tp_plan``): on 2 gloo ranks the split row equals tensor
parallelism without it, eager and compiled, and keeps fewer bytes for the backward (``programs/sequence_parallel.py``;
every role's update against one rank: tests/workers/test_parallel_parity.py, ``dp2tp2pp1sp`` and ``dp1tp2pp2sp``;
with context parallelism: tests/training/test_context_parallel_roles.py); the padded row; what the config takes."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model
from torchrun_helpers import torchrun

from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.models.sequence_parallel import padded_row


def test_sequence_parallel_equals_tensor_parallel(tmp_path):
    qwen3, llama, moe = (str(tmp_path / name) for name in ("qwen3", "llama", "moe"))
    write_hf_model("qwen3", qwen3, vocab_size=128)  # tp = 2 splits the vocabulary
    write_hf_model("llama2_bias", llama, kind="value", vocab_size=128)
    write_hf_model("qwen2_moe", moe, vocab_size=128)
    finished = torchrun("sequence_parallel.py", qwen3, llama, moe, nproc=2, timeout=240, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]


def test_a_row_is_padded_by_one_sequence_to_a_multiple_of_tp():
    ids, positions = torch.arange(1, 8)[None], torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32)
    padded_ids, padded_positions, offsets, longest = padded_row(ids, positions, None, cu_seqlens, 4, 4)
    assert padded_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]]
    assert padded_positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert offsets.tolist() == [0, 3, 7, 8] and longest == 4
    _, _, offsets, _ = padded_row(ids[:, :6], positions[:, :6], None, None, None, 4)  # one sequence, no offsets
    assert offsets.tolist() == [0, 6, 8]
    assert padded_row(ids[:, :4], positions[:, :4], None, cu_seqlens[:2], 3, 4)[0] is not None  # a multiple already
    with pytest.raises(ValueError, match="splits one packed row"):
        padded_row(ids.expand(2, 7), positions.expand(2, 7), torch.ones(2, 7), None, None, 2)
    # A later pipeline stage's chunk of hidden states cannot be padded: its row must be a multiple already.
    chunk = torch.zeros(1, 4, 8)
    assert padded_row(chunk, torch.arange(8)[None], None, None, None, 2, chunk=True)[0] is chunk
    with pytest.raises(ValueError, match="stack_packed\\(multiple=4\\)"):
        padded_row(chunk, positions, None, cu_seqlens, 4, 4, chunk=True)


def test_the_config_takes_it_with_pipelines_and_context_parallelism_and_refuses_it_for_generation():
    for layout in (["actor.pp=2", "actor.n_ranks=4"], ["actor.cp=2", "actor.n_ranks=4"]):
        assert load_config(None, ["actor.sequence_parallel=true", "actor.tp=2", *layout]).actor.sequence_parallel
    with pytest.raises(ConfigError, match="reward.sequence_parallel=true: splits training and scoring passes, not gen"):
        load_config(None, ["reward.kind=generative", "reward.sequence_parallel=true"])
    for tp in (1, 2):  # at tp = 1 it has no effect (placement=auto may choose it)
        assert load_config(None, ["actor.sequence_parallel=true", f"actor.tp={tp}"]).actor.sequence_parallel
