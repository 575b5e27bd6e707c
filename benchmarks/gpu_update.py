"""G3: model-FLOP utilisation (MFU) of the actor's ``update_actor``, Qwen2.5-1.5B-shaped random model, bf16 compute.

    python benchmarks/gpu_update.py [--shape 1.5b] [--lengths 1024 2048] [--rows 32] [--micro-batch 2] \\
        [--peak-tflops 989] [--compile auto|on|off] [--activation-checkpointing full|selective] [--model-dir DIR]
    torchrun --nproc-per-node N benchmarks/gpu_update.py ...   # N data-parallel ranks (FSDP), MFU per device
    python benchmarks/gpu_update.py --smoke --peak-tflops 0.1 # tiny model, CPU-sized: checks the script in seconds

The real ``ActorWorker`` is spawned on every rank of the job (``actor.dp`` = world size, FSDP2 with float32 master
weights and ``model.dtype`` compute, AdamW, GRPO loss with the k3 KL term) and its ``update_actor`` is called on
synthetic rollouts built on each rank: ``--rows`` rows per step (one optimizer step: ``actor.mini_batch_size =
--rows``), micro-batches of ``--micro-batch`` rows, every sequence ``length`` real tokens (a quarter prompt, the rest
response; no padding). Per length: one warm-up update, then the median of ``--repeats`` timed updates.

MFU = model FLOPs / (seconds x devices x peak FLOP/s), model FLOPs from ``spmd_rlhf.metrics.step_metrics.step_flops``:
6 x (B x tokens + H x response tokens), B the body's matmul parameters (embedding lookup not included), H the LM
head's (tied or not), which runs at the response positions only. ``mfu_with_attention`` adds
the causal attention products, 6 x L x S x (heads x head_dim) per token for sequences of S tokens (forward
2 x S^2 x heads x head_dim per layer and sequence after causal masking, backward twice that). The peak is
``--peak-tflops``, else the dense bf16 peak of a known GPU by name (``gpu_common.PEAK_BF16_TFLOPS``); on CPU without
``--peak-tflops`` no MFU is reported. Goal (G3): MFU >= 0.4. Writes
``benchmarks/results/gpu_update_<shape>_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from gpu_common import (
    add_model_arguments,
    default_dtype,
    environment,
    meets_goal,
    parse_with_smoke,
    peak_tflops,
    profiled,
    shaped_model,
    write_result,
)

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.metrics.step_metrics import ModelPasses, matmul_parameters, step_flops
from spmd_rlhf.models import read_decoder_args
from spmd_rlhf.runtime import Coordinator, ParallelDims, ResourcePool, launch, one_to_all
from spmd_rlhf.workers import ActorWorker

MFU_GOAL = 0.4
GROUP_SIZE = 2
"""``rollout.n`` of the synthetic rollouts: the GRPO loss does not look at groups, the config only needs one."""

SMOKE = dict(shape="smoke", lengths=[16, 24], rows=4, micro_batch=2, repeats=1)


def response_tokens(length: int) -> int:
    """Response tokens of a synthetic row of ``length`` tokens: all but the quarter that is prompt."""
    return length - length // 4


def synthetic_rollout(rows: int, length: int, vocab: int, *, seed: int) -> Batch:
    """``rows`` rollout rows of ``length`` real tokens (a quarter prompt) with the fields ``update_actor`` reads."""
    generator = torch.Generator().manual_seed(seed)
    response_length = response_tokens(length)
    prompt_length = length - response_length
    input_ids = torch.randint(0, vocab, (rows, length), generator=generator)
    response_mask = torch.ones(rows, response_length, dtype=torch.long)
    return Batch(
        {
            "prompts": input_ids[:, :prompt_length],
            "responses": input_ids[:, prompt_length:],
            "response_mask": response_mask,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "old_log_probs": -3 * torch.rand(rows, response_length, generator=generator),
            "ref_log_probs": -3 * torch.rand(rows, response_length, generator=generator),
            "advantages": torch.randn(rows, response_length, generator=generator),
        },
        group_size=GROUP_SIZE,
    )


class TimedActor(ActorWorker):
    """The actor, with its own ``update_actor`` timed on synthetic rollouts made where they are used."""

    @one_to_all
    def time_updates(
        self, lengths: list[int], rows: int, repeats: int, profile: str | None = None
    ) -> list[list[float]]:
        """Seconds of each of ``repeats`` ``update_actor`` calls on this rank's ``rows`` rows, per length in
        ``lengths``, each after one untimed warm-up call (allocator growth, compilation). With ``profile``, rank 0
        runs one more call of the first length under the profiler and writes its table there."""
        seconds = []
        for length in lengths:
            batch = synthetic_rollout(rows, length, self.model.module.args.vocab_size, seed=self.context.rank)
            self.update_actor(batch)
            times = []
            for _ in range(repeats):
                self._synchronize()
                start = time.perf_counter()
                self.update_actor(batch)
                self._synchronize()
                times.append(time.perf_counter() - start)
            seconds.append(times)
            if profile and len(seconds) == 1:
                with profiled(profile if self.context.rank == 0 else None):
                    self.update_actor(batch)
                    self._synchronize()
        return seconds

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run(coordinator: Coordinator, args: argparse.Namespace) -> None:
    world = coordinator.world_size
    if args.rows % (world * GROUP_SIZE):
        raise ValueError(f"--rows={args.rows} must split into {world} ranks x groups of {GROUP_SIZE}")
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or default_dtype(torch.device(device).type)
    peak = peak_tflops(device, args.peak_tflops)
    real_run = torch.device(device).type == "cuda" and not args.smoke
    with shaped_model(args.shape, args.model_dir) as model_dir:
        config = load_config(
            None,
            [
                f"model.path={model_dir}",
                f"model.dtype={dtype}",
                f"model.compile={args.compile}",
                f"model.activation_checkpointing={str(args.activation_checkpointing is not None).lower()}",
                f"model.checkpoint_policy={args.activation_checkpointing or 'full'}",
                f"model.activation_offload={str(args.activation_offload).lower()}",
                "algorithm.name=grpo",
                "algorithm.kl_penalty=loss",
                "algorithm.kl_estimator=k3",
                "critic.enabled=false",
                f"rollout.n={GROUP_SIZE}",
                f"rollout.max_new_tokens={max(args.lengths)}",
                f"data.batch_size={args.rows // GROUP_SIZE}",
                f"actor.mini_batch_size={args.rows}",
                f"actor.micro_batch_size={args.micro_batch}",
                # 0 (the default): derived from the free memory; null: --micro-batch rows per pass
                f"actor.max_tokens_per_micro_batch={'null' if args.token_budget is None else args.token_budget}",
                "actor.lr=1e-6",
            ],
        )
        actor = coordinator.spawn(
            TimedActor, config, name="actor", pool=ResourcePool(range(world)), dims=ParallelDims(dp=world)
        )
        seconds = actor.time_updates(args.lengths, args.rows // world, args.repeats, args.profile).result()
        parameters = matmul_parameters(model_dir, head="lm")
        model_args = read_decoder_args(model_dir)

    rows = []
    for length, times in zip(args.lengths, seconds):
        step_s = statistics.median(times)
        tokens = args.rows * length
        flops = step_flops(
            ModelPasses(generate=parameters, train=(parameters,)),
            sequence_tokens=tokens,
            response_tokens=args.rows * response_tokens(length),
            generated_tokens=0,
        )
        attention_flops = 6 * model_args.num_layers * length * model_args.num_heads * model_args.head_dim * tokens
        per_device = flops / step_s / world
        with_attention = (flops + attention_flops) / step_s / world
        mfu = per_device / (peak * 1e12) if peak else None
        rows.append(
            {
                "length": length,
                "rows": args.rows,
                "micro_batch": args.micro_batch,
                "tokens_per_step": tokens,
                "seconds": times,
                "step_s": step_s,
                "tokens_per_s": tokens / step_s,
                "tflops_per_device": per_device / 1e12,
                "tflops_per_device_with_attention": with_attention / 1e12,
                "mfu": mfu,
                "mfu_with_attention": with_attention / (peak * 1e12) if peak else None,
                "meets_goal": meets_goal(mfu, MFU_GOAL, at_least=True, real_run=real_run),
            }
        )
    result = {
        "benchmark": "gpu_update",
        "smoke": args.smoke,
        "shape": args.shape,
        "dtype": dtype,
        "compile": args.compile,
        "token_budget": "rows" if args.token_budget is None else args.token_budget or "derived",
        "activation_checkpointing": args.activation_checkpointing,
        "activation_offload": args.activation_offload,
        "matmul_parameters": dataclasses.asdict(parameters),
        "peak_tflops": peak,
        "goal": f"mfu >= {MFU_GOAL}",
        "repeats": args.repeats,
        "per_length": rows,
        "environment": environment(device),
    }
    environment_row = result["environment"]
    print(
        f"update_actor, qwen2 {args.shape} ({parameters.total / 1e9:.2f}B matmul parameters), {world} x "
        f"{environment_row['device_name']}, {dtype}, peak {peak or 'unknown'} TFLOP/s"
        f"{', SMOKE RUN: not a GPU figure' if args.smoke else ''}"
    )
    print(
        "| length | rows x micro | step s | tokens/s | TFLOP/s per device | MFU | MFU with attention | goal |\n"
        "|" + " --- |" * 8
    )
    for row in rows:
        mfu = "—" if row["mfu"] is None else f"{row['mfu']:.3f}"
        with_attention = "—" if row["mfu_with_attention"] is None else f"{row['mfu_with_attention']:.3f}"
        print(
            f"| {row['length']} | {row['rows']} x {row['micro_batch']} | {row['step_s']:.3f} "
            f"| {row['tokens_per_s']:.0f} | {row['tflops_per_device']:.1f} | {mfu} | {with_attention} | >= {MFU_GOAL} |"
        )
    write_result(args.out, f"gpu_update_{args.shape}_{environment_row['device']}", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, default_shape="1.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="tokens per sequence")
    parser.add_argument("--rows", type=int, default=32, help="sequences per optimizer step, over all ranks")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype; default bfloat16 on cuda")
    parser.add_argument("--peak-tflops", type=float, help="peak FLOP/s of one device, TFLOP/s; default by GPU name")
    parser.add_argument(
        "--token-budget",
        type=lambda value: None if value == "null" else int(value),
        default=0,
        help="actor.max_tokens_per_micro_batch: token-balanced micro-batches of this many tokens; 0 (the recipe's "
        "default) derived from the free device memory (training.token_budget) on GPU; null: --micro-batch rows a pass",
    )
    parser.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="model.compile: torch.compile each decoder block (auto: on CUDA)",
    )
    parser.add_argument("--activation-offload", action="store_true", help="model.activation_offload=true")
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=("full", "selective"),
        help="model.activation_checkpointing with this model.checkpoint_policy (full when given bare); default off",
    )
    parser.add_argument("--profile", help="write a profile of one more update (first length, rank 0) to this file")
    parser.add_argument("--out", default="benchmarks/results")
    args = parse_with_smoke(parser, SMOKE)
    launch(lambda coordinator: run(coordinator, args))


if __name__ == "__main__":
    main()
