"""``Generator`` keeps its engine between generations with ``rollout.keep_engine`` (the KV cache and the CUDA graphs on
it stay for the next RL step), builds a new one for another model, and without the key frees each engine's cache."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.engine import SamplingParams
from spmd_rlhf.models import load_model
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.training.reducer import DPReducer
from spmd_rlhf.workers.generation import Generator
from spmd_rlhf.workers.replicas import OneReplica


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_tiny(family="qwen2", out_dir=str(tmp_path_factory.mktemp("policy")), hidden_size=32, vocab_size=300)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The DP reducer's group: one rank of a gloo job."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


def _generator(policy: str, keep: bool, *more: str) -> Generator:
    config = load_config(
        None,
        [
            f"model.path={policy}",
            "algorithm.name=grpo",
            "critic.enabled=false",
            "rollout.n=2",
            "rollout.max_new_tokens=5",
            f"rollout.keep_engine={str(keep).lower()}",
            *more,
        ],
    )
    vocab = load_model(policy, dtype=torch.float32).args.vocab_size
    return Generator(
        config,
        role="actor",
        model_path=policy,
        vocab_size=vocab,
        device=torch.device("cpu"),
        reducer=DPReducer(dist.group.WORLD, role="actor"),
    )


def _prompts() -> Batch:
    ids = torch.tensor([[7, 8, 9, 10], [0, 0, 11, 12]])
    return Batch({"input_ids": ids, "attention_mask": (ids > 0).long(), "uid": torch.arange(2)})


def test_a_kept_engine_serves_the_next_generation_of_the_same_model(policy):
    generator = _generator(policy, keep=True)
    model = load_model(policy, dtype=torch.float32)
    first = generator.generate(_prompts(), model, OneReplica())
    (engine,) = generator._idle_engines
    cache = engine.runner._key_cache
    assert cache is not None and generator.engine(model) is engine and not generator._idle_engines
    generator.release(engine)
    second = generator.generate(_prompts(), model, OneReplica())
    assert generator._idle_engines == [engine] and engine.runner._key_cache is cache
    assert second["responses"].equal(first["responses"])
    assert second["rollout_log_probs"].equal(first["rollout_log_probs"])
    other = load_model(policy, dtype=torch.float32)
    assert generator.engine(other) is not engine and not generator._idle_engines  # the old model's engine is gone


def test_without_keep_engine_each_generation_frees_its_cache(policy):
    generator = _generator(policy, keep=False)
    model = load_model(policy, dtype=torch.float32)
    generator.generate(_prompts(), model, OneReplica())
    engine = generator.engine(model)
    assert not generator._idle_engines  # a new engine: the last one was not kept
    engine.generate([[7, 8, 9]], SamplingParams(temperature=0, max_new_tokens=2))
    generator.release(engine)
    assert engine.runner._key_cache is None and not generator._idle_engines


def test_a_memory_sized_engine_is_sized_for_its_call_and_replaced_when_a_wider_call_comes(policy, monkeypatch):
    """On GPU without rollout.kv_cache_blocks the cache comes from free memory: a new engine then decodes at most its
    call's rows (its cache no larger than they fill, since a kept engine holds it through training); a later call
    with more rows replaces it instead of decoding in waves."""
    generator = _generator(policy, True, "rollout.max_num_seqs=6")
    generator.device = torch.device("cuda")  # only the cache sizing reads it; the model stays on the CPU
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    model = load_model(policy, dtype=torch.float32)
    small = generator.engine(model, rows=2)
    longest = generator.config.data.max_prompt_length + generator.config.rollout.response_length
    assert small.max_num_seqs == 2
    assert small.fixed_num_blocks == 2 * -(-longest // small.block_size)
    generator.release(small)
    assert generator.engine(model, rows=1) is small  # narrower calls reuse it
    generator.release(small)
    wide = generator.engine(model, rows=10)
    assert wide is not small and wide.max_num_seqs == 6 and not generator._idle_engines


def test_rollout_overlap_host_reaches_the_engine(policy):
    model = load_model(policy, dtype=torch.float32)
    assert _generator(policy, True).engine(model).overlap_host
    assert not _generator(policy, True, "rollout.overlap_host=false").engine(model).overlap_host
