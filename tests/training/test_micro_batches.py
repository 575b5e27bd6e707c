"""Micro-batch grouping: the balanced partition keeps every row once and loads even, the fewest groups within a
token budget, and two DP ranks with uneven rows agree on their micro-batch count with no empty micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrun_helpers import forked_ranks

from spmd_rlhf.training.micro_batches import balanced_partition, fitting_parts, row_chunks, token_balanced_micro_batches


def test_balanced_partition():
    lengths = [19, 2, 3, 12, 14, 7, 13, 9, 12]
    for parts in range(1, len(lengths) + 1):
        groups = balanced_partition(lengths, parts)
        assert len(groups) == parts and all(groups)
        assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
        loads = [sum(lengths[row] for row in group) for group in groups]
        # LPT: no group exceeds the average by more than the longest row.
        assert max(loads) <= sum(lengths) / parts + max(lengths)
    loads = sorted(sum(lengths[row] for row in group) for group in balanced_partition(lengths, 3))
    assert loads == [29, 30, 32]  # longest first to the lightest: 19+9+2, 14+12+3, 13+12+7
    assert fitting_parts(lengths, 40) == 3  # 91 tokens: ceil(91 / 40) = 3 groups fit
    assert fitting_parts(lengths, 19) == 6  # the 19-token row alone, the rest in pairs of at most 19
    assert fitting_parts(lengths, 40, at_least=7) == 7
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        fitting_parts(lengths, 18)
    with pytest.raises(ValueError, match="non-empty"):
        balanced_partition(lengths, 10)


def _agree_over_two_ranks(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # Rank 0 holds long rows and needs 4 micro-batches of 40 tokens; rank 1's short rows would fit in one.
    lengths = [30, 25, 28, 35, 20, 33] if rank == 0 else [3, 4, 5, 2, 6, 3]
    calls = []

    def agree(count: int) -> int:
        total = torch.tensor(count)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        calls.append(count)
        return int(total)

    groups = token_balanced_micro_batches(lengths, 40, agree)
    results[rank] = (groups, calls)
    dist.destroy_process_group()


def test_dp_ranks_with_uneven_lengths_agree_on_the_micro_batch_count():
    results = forked_ranks(_agree_over_two_ranks, 2)
    long_groups, _ = results[0]
    short_groups, _ = results[1]
    long_lengths = [30, 25, 28, 35, 20, 33]
    assert len(long_groups) == len(short_groups) == fitting_parts(long_lengths, 40)
    assert all(short_groups)  # the short rank split its rows: no empty forward
    assert max(sum(long_lengths[row] for row in group) for group in long_groups) <= 40
    assert sorted(row for group in short_groups for row in group) == list(range(6))
    assert len(results[0][1]) == len(results[1][1])  # the same number of collectives on both ranks


def test_row_chunks_are_consecutive():
    assert row_chunks(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_a_pipeline_minimum_splits_rows_that_would_fit_one_micro_batch():
    """A 1F1B pipeline of 3 stages needs 3 micro-batches even when the budget holds every row at once; with fewer
    rows than that there is one per row."""
    lengths = [5, 7, 3, 4]
    assert len(token_balanced_micro_batches(lengths, 100, agree=lambda count: count)) == 1
    groups = token_balanced_micro_batches(lengths, 100, agree=lambda count: count, at_least=3)
    assert len(groups) == 3 and sorted(row for group in groups for row in group) == [0, 1, 2, 3]
    assert len(token_balanced_micro_batches(lengths[:2], 100, agree=lambda count: count, at_least=3)) == 2


def test_a_derived_token_budget_follows_the_free_memory_and_the_pass():
    from transformers import AutoConfig

    from spmd_rlhf.models.args import args_from_hf_config
    from spmd_rlhf.training.token_budget import TOKEN_BUDGET_HEADROOM, bytes_per_token, derived_token_budget

    # Qwen2.5-1.5B's widths, from transformers' own config class.
    args = args_from_hf_config(
        AutoConfig.for_model(
            "qwen2",
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
        )
    )
    layer = (11 * 1536 + 3 * 2 * 128 + 4 * 8960) * 2  # norms, attention, the 8960-wide MLP; bf16
    train = bytes_per_token(args, tp=1, pp=1, dtype_bytes=2, train=True, activation_checkpointing=False)
    assert train == 28 * layer + 2 * 151936 * 2
    forward = bytes_per_token(args, tp=1, pp=1, dtype_bytes=2, train=False, activation_checkpointing=False)
    assert forward == layer + 151936 * 2
    checkpointed = bytes_per_token(args, tp=2, pp=2, dtype_bytes=2, train=True, activation_checkpointing=True)
    # Under TP each rank keeps the block inputs, the residual stream and the norms' activations whole (8 h)...
    replicated = 8 * 1536 * 2
    assert checkpointed == 2 * 1536 * 2 * 14 + (layer - replicated) / 2 + replicated + 2 * 151936 * 2 / 2
    split = bytes_per_token(
        args, tp=2, pp=2, dtype_bytes=2, train=True, activation_checkpointing=True, sequence_parallel=True
    )
    assert split == (2 * 1536 * 2 * 14 + layer) / 2 + 2 * 151936 * 2 / 2  # ... and sequence parallelism splits them
    selective = bytes_per_token(
        args, tp=1, pp=1, dtype_bytes=2, train=True, activation_checkpointing=True, checkpoint_policy="selective"
    )
    kept = (5 * 1536 + 2 * 2 * 128 + 2 * 8960) * 2  # the input and the matmuls' and attention's outputs, bf16
    assert selective == 28 * kept + layer + 2 * 151936 * 2 and 0.45 < kept / layer < 0.55
    free = 40 * 2**30
    budget = derived_token_budget(free_bytes=free, per_token=train, longest=2048)
    assert budget == int(free * TOKEN_BUDGET_HEADROOM // train)
    assert derived_token_budget(free_bytes=free, per_token=forward, longest=2048) > 4 * budget
    assert derived_token_budget(free_bytes=2**20, per_token=train, longest=2048) is None  # rows per micro-batch then


def test_the_token_budget_key_takes_zero_null_or_a_budget_that_holds_the_longest_row():
    from spmd_rlhf.config import ConfigError, load_config

    assert load_config(None, []).actor.max_tokens_per_micro_batch == 0  # derived on GPU, rows elsewhere
    assert load_config(None, ["actor.max_tokens_per_micro_batch=0"]).actor.max_tokens_per_micro_batch == 0
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch=-1: must be >= 0 or null"):
        load_config(None, ["actor.max_tokens_per_micro_batch=-1"])
    with pytest.raises(ConfigError, match="set it to at least .*, 0 \\(derived on GPU\\) or null"):
        load_config(None, ["actor.max_tokens_per_micro_batch=3"])


def test_a_role_derives_its_budget_on_gpu_only(monkeypatch):
    """``ShardedModel.derived_token_budget``'s glue: the model's shape, the layout, model.dtype and the batch's width
    on a CUDA device (free memory stubbed: this machine has none); None on the CPU."""
    from types import SimpleNamespace

    from spmd_rlhf.config import load_config
    from spmd_rlhf.data import Batch
    from spmd_rlhf.models.args import read_decoder_args
    from spmd_rlhf.tiny import ensure_tiny_assets
    from spmd_rlhf.training import sharded_model
    from spmd_rlhf.training.token_budget import TOKEN_BUDGET_HEADROOM, bytes_per_token

    config = load_config(None, ["model.dtype=bfloat16"])
    ensure_tiny_assets(config)
    args = read_decoder_args(config.model.path)
    role = SimpleNamespace(
        device=torch.device("cuda"),
        module=SimpleNamespace(args=args, sequence_parallel=1),
        context=SimpleNamespace(dims=SimpleNamespace(tp=1, pp=1, cp=1)),
        config=config,
    )
    batch = Batch({"attention_mask": torch.ones(3, 20, dtype=torch.long)})
    monkeypatch.setattr(sharded_model, "free_device_bytes", lambda device: 2**30)
    per_token = bytes_per_token(args, tp=1, pp=1, dtype_bytes=2, train=True, activation_checkpointing=False)
    budget = sharded_model.ShardedModel.derived_token_budget(role, batch, train=True)
    assert budget == int(2**30 * TOKEN_BUDGET_HEADROOM // per_token) >= 20
    monkeypatch.setattr(sharded_model, "free_device_bytes", lambda device: 100)
    assert sharded_model.ShardedModel.derived_token_budget(role, batch, train=True) is None  # rows per micro-batch
    role.device = torch.device("cpu")
    assert sharded_model.ShardedModel.derived_token_budget(role, batch, train=True) is None
