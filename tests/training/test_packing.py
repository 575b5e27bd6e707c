"""Packed micro-batches equal the padded batch: log-probs, entropy, values, scores, and the loss and gradients of a
policy step, in float32 within 1e-6, whatever the token budget groups the rows into, also when the packed
micro-batches are padded to common shapes for a pipeline schedule (``stack_packed``)."""

from __future__ import annotations

import types

import pytest
import torch

from spmd_rlhf.algos import Denominators, entropy_bonus, policy_loss
from spmd_rlhf.data import Batch
from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models.args import decoder_args
from spmd_rlhf.models.length_buckets import LengthBuckets, OneLengthClass
from spmd_rlhf.training.micro_batches import row_chunks, token_balanced_micro_batches
from spmd_rlhf.training.packing import PackedRows, PaddedRows, stack_packed
from spmd_rlhf.training.sharded_model import ShardedModel

PROMPT, RESPONSE, VOCAB = 7, 12, 97
BUDGETS = [None, 19, 25, 40, 1000]
"""Token budgets of one micro-batch (None: one row per micro-batch); the longest row has 19 tokens. ("stacked",
budget): the same groups padded to common shapes by ``stack_packed``, each run as a pipeline schedule slices it."""
BUDGETS += [("stacked", None), ("stacked", 19), ("stacked", 40)]


def rollout_batch() -> Batch:
    """Rows of very different lengths: prompts of 1 to 7 tokens (left-padded), responses of 0 to 12 (right-padded)."""
    generator = torch.Generator().manual_seed(0)
    prompt_lengths = torch.tensor([7, 1, 3, 7, 2, 5, 4, 6, 1])
    response_lengths = torch.tensor([12, 1, 0, 5, 12, 2, 9, 3, 11])
    rows = len(prompt_lengths)
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_lengths[:, None]).long()
    prompts = torch.randint(3, VOCAB, (rows, PROMPT), generator=generator) * prompt_mask
    responses = torch.randint(3, VOCAB, (rows, RESPONSE), generator=generator) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "old_log_probs": -torch.rand(rows, RESPONSE, generator=generator) * 5,
            "advantages": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
        }
    )


def tiny_model(head: str) -> DecoderLM:
    torch.manual_seed(0)
    args = decoder_args(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        qkv_bias=True,
    )
    model = DecoderLM(args, head=head, attention_backend="sdpa")
    model.reset_buffers()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return model


def groups_of(batch: Batch, budget: int | None | tuple) -> list[list[int]]:
    if isinstance(budget, tuple):
        budget = budget[1]
    if budget is None:
        return row_chunks(len(batch), 1)
    return token_balanced_micro_batches(batch["attention_mask"].sum(dim=1).tolist(), budget, agree=lambda count: count)


# The sharded model's own method, with what it reads from a one-rank model.
WORKER = types.SimpleNamespace(tp_group=None, vocab_start=0, device=torch.device("cpu"), context_parallel=None)


def run_micro_batches(model: DecoderLM, batch: Batch, budget: int | None | str, output_fn) -> list[torch.Tensor]:
    """``output_fn(outputs, micro)`` of each micro-batch: one padded pass (``budget="padded"``), or packed ones."""
    if budget == "padded":
        micro = PaddedRows(batch)
        return [output_fn(model(**micro.model_inputs(torch.device("cpu"), per_token=True)), micro)]
    per_token = model.head != "score"
    results = []
    if isinstance(budget, tuple):
        micros = [PackedRows(batch.select(rows)) for rows in groups_of(batch, budget)]
        input_ids, kwargs, host_inputs = stack_packed(micros, per_token=per_token)
        assert len({micro.total_tokens for micro in micros} | {input_ids.shape[1]}) > 1  # really padded
        for index, micro in enumerate(micros):
            # Micro-batch ``index`` as the schedule slices it (the model takes cu_seqlens and output positions flat),
            # with its own host inputs, as the pipeline's hook adds them.
            inputs = {
                key: value[index : index + 1] if key == "position_ids" else value[index]
                for key, value in kwargs.items()
            } | host_inputs[index]
            outputs = model(input_ids[index : index + 1], **inputs)
            results.append(output_fn(outputs[: micro.output_count(per_token=per_token)], micro))
        return results
    for rows in groups_of(batch, budget):
        micro = PackedRows(batch.select(rows))
        results.append(output_fn(model(**micro.model_inputs(torch.device("cpu"), per_token=per_token)), micro))
    return results


def per_row_outputs(model: DecoderLM, batch: Batch, budget: int | None | str, output_fn) -> torch.Tensor:
    """``output_fn`` results of every row, in row order."""
    grouped = torch.cat(run_micro_batches(model, batch, budget, output_fn))
    if budget == "padded":
        return grouped
    order = torch.tensor([row for rows in groups_of(batch, budget) for row in rows])
    return torch.empty_like(grouped).index_copy_(0, order, grouped)


@pytest.mark.parametrize("budget", BUDGETS)
def test_packed_log_probs_entropy_values_and_scores_equal_padded(budget):
    batch = rollout_batch()
    with torch.no_grad():
        model = tiny_model("lm")

        def log_probs_and_entropy(logits, micro):
            return torch.stack(ShardedModel.response_log_probs(WORKER, logits, micro, 0.7, with_entropy=True), dim=1)

        padded, packed = (per_row_outputs(model, batch, layout, log_probs_and_entropy) for layout in ("padded", budget))
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=0)
        assert (padded[:, 0] < 0).sum() == batch["response_mask"].sum()  # real log-probs exactly where the mask is
        values_model = tiny_model("value")

        def values(outputs, micro):
            return micro.scatter(micro.response_outputs(outputs))

        padded, packed = (per_row_outputs(values_model, batch, layout, values) for layout in ("padded", budget))
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=0)
        score_model = tiny_model("score")
        padded, packed = (
            per_row_outputs(score_model, batch, layout, lambda out, micro: out) for layout in ("padded", budget)
        )
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_packed_policy_loss_and_gradients_equal_padded(budget, aggregation):
    """Each micro-batch's loss is its share of the whole batch's (denominators over all rows), so the summed losses
    and accumulated gradients do not depend on the grouping."""
    batch = rollout_batch()
    denominators = Denominators.local(batch["response_mask"], RESPONSE)

    def loss_of(logits, micro):
        log_probs, entropy = ShardedModel.response_log_probs(WORKER, logits, micro, 0.7, with_entropy=True)
        mask = micro.rows["response_mask"]
        loss, _ = policy_loss(
            log_probs,
            micro.rows["old_log_probs"],
            micro.rows["advantages"],
            mask,
            clip_low=0.2,
            clip_high=0.28,
            aggregation=aggregation,
            denominators=denominators,
        )
        loss = loss - 0.01 * entropy_bonus(entropy, mask, aggregation=aggregation, denominators=denominators)
        loss.backward()
        return loss.detach()

    results = {}
    for layout in ("padded", budget):
        model = tiny_model("lm")
        loss = torch.stack(run_micro_batches(model, batch, layout, loss_of)).sum()
        results[layout] = loss, {name: param.grad for name, param in model.named_parameters()}
    (padded_loss, padded_grads), (packed_loss, packed_grads) = results["padded"], results[budget]
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert max(float(grad.abs().max()) for grad in padded_grads.values()) > 1e-3  # the loss really reaches the weights


def test_packed_rows_feed_no_padding_and_compute_response_logits_only():
    batch = rollout_batch()
    micro = PackedRows(batch)
    assert micro.total_tokens == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()
    assert micro.cu_seqlens.tolist() == [0, *batch["attention_mask"].sum(dim=1).cumsum(0).tolist()]
    assert micro.position_ids[0, :19].tolist() == list(range(19))  # row 0: 7 + 12 tokens, positions from 0
    assert len(micro.output_positions) == micro.response_tokens == int(batch["response_mask"].sum())
    # The LM head runs at response positions only: logits [response tokens, vocab], not [tokens, vocab].
    with torch.no_grad():
        logits = tiny_model("lm")(**micro.model_inputs(torch.device("cpu"), per_token=True))
    assert logits.shape == (micro.response_tokens, VOCAB)


def test_a_long_rows_length_classes_are_built_on_the_host_and_reach_the_model_with_its_inputs(monkeypatch):
    """A packed row over ``MASK_TOKEN_LIMIT`` tokens (here every row) attends per length class; the packer groups its
    sequences on the host, where its offsets are, so the model never reads ``cu_seqlens`` back from the device to
    build them (a sync per forward on a GPU), and gives the same outputs. A row whose length is no longer theirs
    (padded since) has its classes built again."""
    from spmd_rlhf.models import attention

    monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
    micro = PackedRows(rollout_batch())
    assert micro.length_classes is not None  # the rows span several classes
    assert "length_places" in micro.host_tensors()  # moved with the rest, in the one transfer
    inputs = micro.model_inputs(torch.device("cpu"), per_token=True)
    model = tiny_model("lm")
    with torch.no_grad():
        built_by_the_model = model(**{name: value for name, value in inputs.items() if name != "length_classes"})
        built = []
        monkeypatch.setattr(attention, "length_buckets", lambda *args: built.append(args) or None)
        logits = model(**inputs)
    assert not built
    torch.testing.assert_close(logits, built_by_the_model, rtol=0, atol=0)
    batch = attention.AttentionBatch.build(
        batch_size=1,
        seq_len=micro.total_tokens + 4,
        attention_mask=None,
        cu_seqlens=torch.cat([micro.cu_seqlens, micro.cu_seqlens[-1:] + 4]),
        backend="torch",
        device=torch.device("cpu"),
        dtype=torch.float32,
        length_classes=inputs["length_classes"],
    )
    assert len(built) == 1 and batch.length_buckets is None


def test_a_long_row_in_one_length_class_is_said_to_be_so_and_the_model_reads_nothing_back(monkeypatch):
    """Rows of 9 to 14 tokens, one power-of-two length class: the packer says so, and the model attends them as one
    padded batch without reading ``cu_seqlens`` back to find it, with the same outputs."""
    from spmd_rlhf.models import attention

    monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
    micro = PackedRows(rollout_batch().select([3, 4, 6, 7, 8]))
    assert micro.length_classes == OneLengthClass(micro.total_tokens)
    assert "length_places" not in micro.host_tensors()
    inputs = micro.model_inputs(torch.device("cpu"), per_token=True)
    model = tiny_model("lm")
    with torch.no_grad():
        found_by_the_model = model(**{name: value for name, value in inputs.items() if name != "length_classes"})
        built = []
        monkeypatch.setattr(attention, "length_buckets", lambda *args: built.append(args))
        logits = model(**inputs)
    assert not built
    torch.testing.assert_close(logits, found_by_the_model, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["sequence parallelism", "pipeline"])
def test_a_long_row_laid_out_again_takes_its_classes_and_longest_sequence_from_the_host(layout, monkeypatch):
    """Sequence parallelism pads a packed row by one sequence to a multiple of tp (here 91 tokens to 92); a
    pipeline pads its micro-batches to common shapes. The length classes and the longest sequence the model takes
    are those of the row so laid out, built on the host (``PackedRows(multiple=)``, ``stack_packed``'s host inputs):
    the model reads nothing back (no scalar read, no classes of its own) and gives the outputs it gives finding them
    itself."""
    from spmd_rlhf.metrics.dispatch_counts import DispatchCounts
    from spmd_rlhf.models import attention

    monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
    model, batch, host_keys = tiny_model("lm"), rollout_batch(), ("max_seqlen", "length_classes")
    if layout == "sequence parallelism":
        model.sequence_parallel = 2
        micro = PackedRows(batch, multiple=2)
        assert micro.total_tokens == 91 and micro.length_classes.total == 92
        inputs = micro.model_inputs(torch.device("cpu"), per_token=True)
        runs = [({key: value for key, value in inputs.items() if key not in host_keys}, inputs)]
    else:
        micros = [PackedRows(batch.select(rows), multiple=None) for rows in groups_of(batch, 40)]
        assert all(micro.length_classes is None for micro in micros)  # the pipeline's layout has its own
        input_ids, kwargs, host_inputs = stack_packed(micros, per_token=True)
        assert any(isinstance(host["length_classes"], LengthBuckets) for host in host_inputs)
        runs = []
        for index, host in enumerate(host_inputs):
            sliced = {
                key: value[index : index + 1] if key == "position_ids" else value[index]
                for key, value in kwargs.items()
            }
            sliced["input_ids"] = input_ids[index : index + 1]
            runs.append((sliced, sliced | host))
    built, real = [], attention.length_buckets
    monkeypatch.setattr(attention, "length_buckets", lambda *args: built.append(args) or real(*args))
    with torch.no_grad():
        for found_by_the_model, from_the_host in runs:
            expected = model(**found_by_the_model)
            already = len(built)
            with DispatchCounts() as counts:
                outputs = model(**from_the_host)
            assert len(built) == already and counts.scalar_reads == 0, counts.scalar_read_sites
            torch.testing.assert_close(outputs, expected, rtol=0, atol=0)
    assert built  # the model left to itself built them


@pytest.mark.parametrize("layout", [PackedRows, PaddedRows])
def test_a_micro_batch_moves_to_the_device_in_one_transfer(layout, monkeypatch):
    """Its model inputs, response labels and response index reach the device together (one pinned copy on a GPU),
    once, however many times a pass reads them."""
    import spmd_rlhf.training.packing as packing

    moves = []
    real = packing.to_device_together

    def counted(tensors, device):
        moves.append(sorted(tensors))
        return real(tensors, device)

    monkeypatch.setattr(packing, "to_device_together", counted)
    micro = layout(rollout_batch())
    cpu = torch.device("cpu")
    inputs = micro.model_inputs(cpu, per_token=True)
    micro.response_labels(cpu), micro.device_index(cpu), micro.model_inputs(cpu, per_token=False)
    assert len(moves) == 1 and {"labels", "index_row", "index_column", "input_ids"} <= set(moves[0])
    assert torch.equal(micro.response_labels(cpu), rollout_batch()["responses"][micro.response_index])
    if layout is PackedRows:
        assert "output_positions" in inputs and "output_positions" not in micro.model_inputs(cpu, per_token=False)


def _long_rows_through_a_pipeline_and_a_context_group(rank, port, results):
    """One rank: the micro-batches through a one-stage pipeline (``run_pipelined``: ``stack_packed``'s host inputs,
    the head on the stage's hidden states) and a one-rank context-parallel group (``context_parallel_step``, Ulysses'
    whole-row batch)."""
    import torch.distributed as dist

    from spmd_rlhf.models import attention
    from spmd_rlhf.models.pipeline import Pipeline
    from spmd_rlhf.training.context_parallel import ContextRow, context_parallel_step
    from spmd_rlhf.training.packing import run_pipelined

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    cpu, model, batch = torch.device("cpu"), tiny_model("lm"), rollout_batch()
    model.context_parallel = "ulysses"
    groups = groups_of(batch, 40)
    with torch.no_grad():
        expected = [model(**PackedRows(batch.select(rows)).model_inputs(cpu, per_token=True)) for rows in groups]
        built, real = [], attention.length_buckets
        attention.length_buckets = lambda *args: built.append(args) or real(*args)
        forwards = []
        model.register_forward_pre_hook(lambda *args: forwards.append(1))
        micros = [PackedRows(batch.select(rows), multiple=None) for rows in groups]
        before = len(built)
        pipeline = Pipeline(
            model,
            stage=0,
            stage_ranks=[0],
            group=dist.group.WORLD,
            device=cpu,
            schedule="gpipe",
            activation_dtype=torch.float32,
        )
        piped = run_pipelined(pipeline, micros, lambda outputs, _: outputs, per_token=True, train=False)
        results["pipeline"] = (len(built) - before, [torch.equal(*pair) for pair in zip(piped, expected)])
        results["forwards"] = (len(forwards), len(micros))
        before, stepped = len(built), []
        for micro in micros:
            row = ContextRow.of(micro, cp=1, per_token=True)
            stepped.append(
                context_parallel_step(
                    model, row, micro, lambda outputs, _: outputs, group=dist.group.WORLD, device=cpu, train=False
                )
            )
        results["context"] = (len(built) - before, [torch.equal(*pair) for pair in zip(stepped, expected)])
    dist.destroy_process_group()


def test_a_pipeline_and_a_context_group_give_the_model_a_long_rows_classes_built_on_the_host(monkeypatch):
    """A pipeline's hook hands each micro-batch's forward its own host inputs (longest sequence, length classes of
    the row padded to the schedule's shapes); a context-parallel step hands the model the classes of the group's
    row: the model builds none itself (no read of the offsets back), with outputs equal to the plain packed
    forward's. The pipeline declares its stages' shapes, so the schedule runs no forward of its own to infer them."""
    from torchrun_helpers import forked_ranks

    from spmd_rlhf.models import attention

    monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
    results = forked_ranks(_long_rows_through_a_pipeline_and_a_context_group, 1)
    assert results["pipeline"][0] == 0 and all(results["pipeline"][1]), results
    assert results["forwards"][0] == results["forwards"][1], results  # one forward per micro-batch, none to infer
    assert results["context"][0] == 0 and all(results["context"][1]), results
