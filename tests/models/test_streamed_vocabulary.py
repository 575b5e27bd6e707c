"""``models.streamed_vocabulary`` on 3 gloo ranks: an embedding and LM head, tied or not, streamed over dp (an uneven
split, in several steps; the embedding by steps of rows, or by tokens when they fit one step) give the plain model's
logits, and gradients equal to the plain model's on the whole batch, averaged over dp as FSDP averages; a streamed
weight is left out of FSDP and keeps its shard only. The same on 4 ranks under HSDP (2 replicas of 2 shards)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchrun_helpers import forked_ranks

from spmd_rlhf.models import DecoderLM, streamed_vocabulary
from spmd_rlhf.models.parallelize import parallelize
from tests.models.test_parallelize import tiny_args

RANKS = 3
VOCAB = 64  # 22 rows on the first two ranks, 20 on the last


def _loss(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).float()
    return (logits.logsumexp(-1) - logits[..., 0]).sum()


CASES = [(5, 5, False, True), (20, 2, True, True), (5, 5, False, False)]
"""(rows_per_step, steps, by_tokens, tied): every case runs in one spawn of the ranks (``compared``)."""
HYBRID_CASES = [(8, 4, False, True), (40, 1, True, False)]
"""The same on 4 ranks as HSDP: a 2 x 2 ``("dp_replicate", "dp_shard")`` mesh, 63 rows streamed over each pair of
ranks (32 and 31), the gradients all-reduced across the pairs (``hybrid``)."""


def _compare(
    rank: int, rows_per_step: int, tied: bool, *, shape: tuple[int, ...] = (RANKS,), vocab: int = VOCAB
) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    ranks, shards = dist.get_world_size(), shape[-1]
    hidden = tiny_args().hidden_size
    streamed_vocabulary.DEFAULT_CHUNK_BYTES = rows_per_step * shards * hidden * 4
    token_gathers = []
    gather_tokens = streamed_vocabulary.VocabularyStream.gather_tokens
    streamed_vocabulary.VocabularyStream.gather_tokens = lambda *args: token_gathers.append(1) or gather_tokens(*args)
    torch.manual_seed(0)
    args = dataclasses.replace(tiny_args(), tie_word_embeddings=tied, vocab_size=vocab)
    plain, sharded = DecoderLM(args, head="lm"), DecoderLM(args, head="lm")
    plain_state = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    sharded.load_state_dict(plain_state)
    for model in (plain, sharded):
        model.reset_buffers()
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp",)
    parallelize(sharded, tp_mesh=None, dp_mesh=init_device_mesh("cpu", shape, mesh_dim_names=names), min_unit_bytes=0)
    generator = torch.Generator().manual_seed(1)
    # 14, 10, 12 (and 16) tokens
    batch = [torch.randint(0, vocab, (2, length), generator=generator) for length in (7, 5, 6, 8)[:ranks]]
    logits_equal = torch.allclose(sharded(batch[rank]), plain(batch[rank]), rtol=1e-5, atol=1e-6)
    _loss(sharded, batch[rank]).backward()
    (sum(_loss(plain, ids) for ids in batch) / ranks).backward()
    weights = (sharded.model.embed_tokens.weight, sharded.lm_head.weight)
    grads = {name: param.grad.full_tensor() for name, param in sharded.named_parameters()}
    band = -(-vocab // shards)
    shard_rank = rank % shards
    result = dict(
        logits=logits_equal,
        grads=all(
            torch.allclose(grads[name], param.grad, rtol=1e-5, atol=1e-6) for name, param in plain.named_parameters()
        ),
        tied=(weights[0] is weights[1]) == tied,
        shard=all(
            isinstance(weight, DTensor)
            and weight.to_local().shape[0] == min(band, vocab - shard_rank * band)
            and weight.device_mesh.ndim == len(shape)
            for weight in weights
        ),
        steps=len(streamed_vocabulary.vocabulary_stream(sharded.model.embed_tokens).steps()),
        by_tokens=len(token_gathers) == 2,  # the embedding's two forwards
    )
    streamed_vocabulary.VocabularyStream.gather_tokens = gather_tokens
    if len(shape) == 2:
        result.update(_two_micro_batches(rank, args, plain_state, batch, mesh_shape=shape))
    return result


def _two_micro_batches(rank: int, args, state: dict, batch: list, *, mesh_shape: tuple[int, ...]) -> dict:
    """Two micro-batches per rank under ``training.fsdp_schedule`` (HSDP, reduce-scattering each): the gradients of
    their summed losses, with the streamed weights' all-reduce across replicas run once after the last backward,
    not in every step of rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rlhf.training.fsdp_schedule import micro_batch_schedule

    ranks = dist.get_world_size()
    plain, sharded = DecoderLM(args, head="lm"), DecoderLM(args, head="lm")
    for model in (plain, sharded):
        model.load_state_dict(state)
        model.reset_buffers()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_replicate", "dp_shard"))
    parallelize(sharded, tp_mesh=None, dp_mesh=mesh, min_unit_bytes=0)
    streams = {
        id(stream): stream
        for stream in map(streamed_vocabulary.vocabulary_stream, (sharded.model.embed_tokens, sharded.lm_head))
    }
    deferred, once = [], []  # per reduced step: whether it left out the replicas; the all-reduces made afterwards
    for stream in streams.values():

        def reduced_step(grad, stream=stream, step=stream.mean_over_dp):
            deferred.append(stream.defer_replica_reduce)
            return step(grad)

        def reduced_once(grad, after=stream.all_reduce_across_replicas):
            once.append(grad.shape)
            return after(grad)

        stream.mean_over_dp, stream.all_reduce_across_replicas = reduced_step, reduced_once
    mine = [batch[rank], batch[(rank + 1) % ranks]]
    with micro_batch_schedule(
        sharded, micro_batches=2, train=True, accumulate_unsharded=False, gather_forward=False, hybrid_replicas=2
    ) as before_micro_batch:
        for index, ids in enumerate(mine):
            before_micro_batch(index)
            _loss(sharded, ids).backward()
    (sum(_loss(plain, ids) + _loss(plain, batch[(r + 1) % ranks]) for r, ids in enumerate(batch)) / ranks).backward()
    grads = {name: param.grad.full_tensor() for name, param in sharded.named_parameters()}
    return dict(
        deferred_grads=all(
            torch.allclose(grads[name], param.grad, rtol=1e-5, atol=1e-6) for name, param in plain.named_parameters()
        ),
        replica_reduces=len(once) == len(streams)
        and bool(deferred)
        and all(deferred)
        and not any(stream.defer_replica_reduce for stream in streams.values()),
    )


def _compare_every_case(rank: int, port: int, results, ranks: int, cases: list, shape: tuple[int, ...], vocab: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    for rows_per_step, _, _, tied in cases:
        results[rank, rows_per_step, tied] = _compare(rank, rows_per_step, tied, shape=shape, vocab=vocab)
    dist.destroy_process_group()


def _spawn(ranks: int, cases: list, shape: tuple[int, ...], vocab: int) -> dict:
    """{(rank, rows_per_step, tied): what that rank found}, from one start of ``ranks`` forked processes."""
    return forked_ranks(_compare_every_case, ranks, ranks, cases, shape, vocab)


@pytest.fixture(scope="module")
def compared() -> dict:
    return _spawn(RANKS, CASES, (RANKS,), VOCAB)


@pytest.fixture(scope="module")
def hybrid() -> dict:
    return _spawn(4, HYBRID_CASES, (2, 2), 63)


@pytest.mark.parametrize(("rows_per_step", "steps", "by_tokens", "tied"), CASES)
def test_a_streamed_vocabulary_equals_the_plain_model(compared, rows_per_step, steps, by_tokens, tied):
    expected = dict(logits=True, grads=True, tied=True, shard=True, steps=steps, by_tokens=by_tokens)
    assert {rank: compared[rank, rows_per_step, tied] for rank in range(RANKS)} == {
        rank: expected for rank in range(RANKS)
    }


@pytest.mark.parametrize(("rows_per_step", "steps", "by_tokens", "tied"), HYBRID_CASES)
def test_a_vocabulary_streamed_under_hsdp_equals_the_plain_model(hybrid, rows_per_step, steps, by_tokens, tied):
    """Streamed within each shard group, replicated across the groups: the plain model's logits, and its gradients
    on all four ranks' rows (the replicas' all-reduce included), by steps of rows or by tokens; and over two
    micro-batches per rank, the all-reduce across replicas run once per streamed weight, after the last backward."""
    expected = dict(logits=True, grads=True, tied=True, shard=True, steps=steps, by_tokens=by_tokens)
    expected |= dict(deferred_grads=True, replica_reduces=True)
    assert {rank: hybrid[rank, rows_per_step, tied] for rank in range(4)} == {rank: expected for rank in range(4)}
