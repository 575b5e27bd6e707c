"""Step metrics: stage timers, per-rank averaging, throughput and model-FLOP utilisation (MFU), and the
``MetricsLogger`` that hands each step's metrics to the sinks of ``trainer.loggers`` (``spmd_rlhf.metrics.sinks``)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

import torch

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.config.dataflow import ROLE_KINDS, dataflow_of
from spmd_rlhf.metrics.sinks import build_sinks
from spmd_rlhf.models import DecoderLM, read_decoder_args


class StageTimer:
    """Wall-clock seconds per named stage of one step, as ``time/<stage>`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start)

    def add(self, stage: str, seconds: float) -> None:
        """Count ``seconds`` more for ``stage`` (a call timed from its issue to its completion)."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"time/{stage}": seconds for stage, seconds in self.seconds.items()}


def mean_over_ranks(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average the metric dicts that each DP rank of a role returned."""
    keys = {key for metrics in per_rank for key in metrics}
    return {
        key: sum(m[key] for m in per_rank if key in m) / sum(1 for m in per_rank if key in m) for key in sorted(keys)
    }


# ---- model FLOPs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulParameters:
    """A model's parameters that multiply activations (N of the 2·N FLOPs per token), split where its passes differ:
    the body (decoder blocks and final norm) runs at every token of a sequence, the head (LM, value or score
    projection) only at the positions whose outputs a pass needs."""

    body: int
    head: int

    @property
    def total(self) -> int:
        return self.body + self.head


@dataclass(frozen=True)
class ModelPasses:
    """The model passes of one training step, each given as the matmul parameters of the model that runs it
    (``matmul_parameters``)."""

    generate: MatmulParameters
    """The generating model (the actor): one forward per generated token."""
    train: tuple[MatmulParameters, ...] = ()
    """One entry per forward + backward pass over the step's sequences: the actor and each critic, ppo_epochs times."""
    forward: tuple[MatmulParameters, ...] = ()
    """One entry per forward-only pass over the step's sequences: reference, recomputed log-probs, values, reward and
    cost models."""


def step_flops(
    passes: ModelPasses, *, sequence_tokens: float, response_tokens: float, generated_tokens: float
) -> float:
    """Model FLOPs of one step, by the dense-transformer estimate of Kaplan et al. (2020):

        FLOPs = 6 · (T · Σ B_train + R · Σ H_train)  +  2 · (T · Σ B_forward + R · Σ H_forward)
              +  2 · G · (B + H)_generate

    with T the step's prompt + response tokens, R its response tokens, G its generated tokens (R in an RL step, where
    every response token was generated) and B, H a model's body and head matmul parameters: a forward pass costs 2
    FLOPs per parameter per token, a backward pass twice that. Training and forward-only passes run the body at
    every token and the head only at the response positions (``models.decoder``'s ``output_positions``: the logits
    or values a log-prob, value or loss needs); generation runs both at every generated token.

    Not counted, so MFU from this errs low: attention's score and value products (the term quadratic in
    sequence length: small next to 2N for short sequences, not for long ones), prompt prefill during generation,
    norms, softmax and the optimizer step, ReMax's greedy baseline rollout and DAPO's extra sampling rounds. Counted
    at R positions though it needs one per sequence: a reward model's score head (hidden parameters, nothing next to
    its body). Counted only once: activation checkpointing's recomputed forward (these are model FLOPs, not
    hardware FLOPs; likewise padding, which the pipeline-parallel path feeds, is not counted).
    """

    def tokens_times_parameters(models: tuple[MatmulParameters, ...]) -> float:
        return sequence_tokens * sum(model.body for model in models) + response_tokens * sum(
            model.head for model in models
        )

    return (
        6 * tokens_times_parameters(passes.train)
        + 2 * tokens_times_parameters(passes.forward)
        + 2 * generated_tokens * passes.generate.total
    )


@functools.cache
def matmul_parameters(model_path: str, *, head: str) -> MatmulParameters:
    """Parameters of the model at ``model_path`` (with ``head``) that multiply activations, body and head: all but
    the token embedding, which is a lookup; a tied LM head is counted, since it is a matmul; of an MoE layer's routed
    experts, the share a token runs (``num_experts_per_tok / num_experts``). Built on the meta
    device, so no memory is allocated."""
    args = read_decoder_args(model_path)
    with torch.device("meta"):
        model = DecoderLM(args, head=head)
    counts = {"body": 0, "head": 0}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name.startswith("model.embed_tokens."):
            continue
        numel = parameter.numel()
        if ".mlp.experts." in name:  # a token runs num_experts_per_tok of an MoE layer's routed experts
            numel = numel * args.moe.num_experts_per_tok // args.moe.num_experts
        counts["head" if name.startswith(("lm_head.", "score.")) else "body"] += numel
    return MatmulParameters(**counts)


def step_passes(config: FrameworkConfig) -> ModelPasses:
    """The model passes of one step under ``config``, from its algorithm's declared dataflow: each ``train`` pass
    ``<role>.ppo_epochs`` times, each ``forward`` pass (recomputed log-probs, the reference, values, reward and cost
    models; a rule is no model) once, and the actor's generation. ReMax's ``greedy`` rollout is not counted."""

    def parameters(name: str) -> int:
        role = getattr(config, name)
        return matmul_parameters(role.model_path or config.model.path, head=ROLE_KINDS[name].head)

    train: list[int] = []
    forward: list[int] = []
    for work in dataflow_of(config.algorithm.name).passes(config):
        if work.kind == "train":
            train += [parameters(work.role)] * getattr(config, work.role).ppo_epochs
        elif work.kind == "forward":
            forward.append(parameters(work.role))
    return ModelPasses(generate=parameters("actor"), train=tuple(train), forward=tuple(forward))


def throughput_metrics(
    metrics: dict[str, float], *, world_size: int, passes: ModelPasses, peak_flops_per_device: float
) -> dict[str, float]:
    """Throughput of a step from its ``time/step``, ``time/generate``, ``rollout/prompt_tokens`` and
    ``rollout/generated_tokens``: prompt + response tokens per second (in all and per device of the job), generated
    tokens per second of generation, achieved model TFLOP/s per device (``step_flops``) and, when
    ``peak_flops_per_device`` is known (> 0), MFU = step FLOPs / (step seconds · devices · peak FLOP/s)."""
    seconds = metrics["time/step"]
    tokens = metrics["rollout/prompt_tokens"] + metrics["rollout/generated_tokens"]
    result = {
        "throughput/tokens_per_s": tokens / seconds,
        "throughput/tokens_per_s_per_device": tokens / seconds / world_size,
    }
    if metrics.get("time/generate"):
        result["throughput/generated_tokens_per_s"] = metrics["rollout/generated_tokens"] / metrics["time/generate"]
    generated = metrics["rollout/generated_tokens"]
    flops_per_device = (
        step_flops(passes, sequence_tokens=tokens, response_tokens=generated, generated_tokens=generated)
        / seconds
        / world_size
    )
    result["throughput/tflops_per_device"] = flops_per_device / 1e12
    if peak_flops_per_device > 0:
        result["perf/mfu"] = flops_per_device / peak_flops_per_device
    return result


# ---- logging -------------------------------------------------------------------------------------------------------


class MetricsLogger:
    """Hands each logged step's metrics to the sinks ``config.trainer.loggers`` names (the whole config becomes the
    wandb run's config). Build it on the coordinator before the models load: a sink whose package is missing then
    fails the run at once."""

    def __init__(self, config: FrameworkConfig, *, stream: TextIO | None = None) -> None:
        self.sinks = build_sinks(config.trainer, run_config=dataclasses.asdict(config), stream=stream)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Flush and close every sink (ends the wandb run)."""
        for sink in self.sinks:
            sink.close()
