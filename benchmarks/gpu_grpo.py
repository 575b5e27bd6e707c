"""G4: GRPO end to end on GPU, the spmd_rlhf recipe against TRL's ``GRPOTrainer`` (no vLLM) on the same GPU(s), same
Qwen2.5-0.5B-shaped random model, prompts, batch, group size and lengths.

    python benchmarks/gpu_grpo.py [--shape 0.5b] [--prompts 32] [--n 8] [--prompt-tokens 128] [--new-tokens 512] \\
        [--micro-batch 16] [--steps 6] [--warmup 2] [--nproc 1] [--trl-weights float32] [--model-dir DIR]
    python benchmarks/gpu_grpo.py --smoke        # tiny model, CPU-sized: checks the script in seconds

Prompts: the arithmetic task's rows (``spmd_rlhf.tiny.task``) with random digits put in front of each question so that
every prompt is exactly ``--prompt-tokens`` tokens once the chat template is applied (digits are single tokens); the
reward is the package's rule. Each step: ``--prompts`` prompts x ``--n`` responses of at most ``--new-tokens`` tokens
(a random-init model almost never samples EOS, so nearly all run to the limit), one optimizer step over all of them in
micro-batches of ``--micro-batch``, reference log-probs for the k3 KL loss. Algorithm settings (KL coefficient,
clip ratios, sampling temperature / top-k / top-p, AdamW betas and weight decay, gradient clipping) come from
``recipes/configs/grpo.yaml`` and are handed to TRL as the matching ``GRPOConfig`` fields; the learning rate is
``LEARNING_RATE`` in both (the yaml's is sized for the tiny CPU model and would blow up this one).

1. spmd_rlhf: ``recipes/grpo.py`` with ``--nproc`` ranks (one rank as a plain process, more under torchrun; colocated
   actor, reference, rule reward), ``model.dtype=bfloat16`` on GPU (float32 master weights, FSDP2 mixed precision);
   ``metrics.jsonl`` gives each step's time and its prompt and generated tokens.
2. TRL: ``GRPOTrainer`` in one process (torchrun with ``--nproc`` > 1), ``use_vllm=False`` (``transformers``
   ``generate``, TRL's default cache), SDPA, on GPU ``bf16=True`` autocast over weights stored in ``--trl-weights``:
   float32 by default (TRL's default, and the same precision split as ours), or bfloat16 (faster, and lower-precision
   updates than ours); ``gradient_checkpointing=False`` (TRL defaults to True; ours is off too), ``loss_type="dapo"``
   (token mean, as ours), one generation per optimizer step. A callback times each step; tokens per step are the
   differences of TRL's own ``num_tokens`` (prompt + completion tokens) log.

The runs take turns on the device, ours first. The first ``--warmup`` steps of each are left out; per-step medians.
tokens/s = (prompt + generated tokens of a step, as each framework counts them) / step seconds. Goal (G4): ours >= 5x
TRL's tokens/s. Both run as ``benchmark_jobs.py`` runs jobs, TRL's half as ``trl_grpo.py`` (as in ``e2e_cpu.py``).
Writes ``benchmarks/results/gpu_grpo_<shape>_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
from importlib.metadata import version
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from benchmark_jobs import RECIPE, RECIPE_CONFIG, launched, launcher, run_job, step_summary
from gpu_common import (
    add_model_arguments,
    default_device,
    default_dtype,
    environment,
    meets_goal,
    parse_with_smoke,
    shaped_model,
    write_result,
)
from trl_grpo import TRL_SCRIPT

from spmd_rlhf.config import load_config
from spmd_rlhf.metrics.device_syncs import total_in_table

SPEEDUP_GOAL = 5.0
LEARNING_RATE = 1e-6

SMOKE = dict(shape="smoke", prompts=2, n=2, prompt_tokens=16, new_tokens=4, micro_batch=2, steps=2, warmup=1)


def write_prompts(path: Path, *, model_dir: str, rows: int, prompt_tokens: int) -> int:
    """``rows`` arithmetic rows whose chat-rendered prompts are all ``prompt_tokens`` tokens, as parquet at ``path``;
    returns that length."""
    from transformers import AutoTokenizer

    from spmd_rlhf.data.dataset import encode_prompt
    from spmd_rlhf.tiny.task import make_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    table = make_rows(task="arithmetic", train_size=rows, val_size=1, seed=0)["train"]
    for index, row in enumerate(table):
        (message,) = row["prompt"]
        filler = prompt_tokens - len(encode_prompt(tokenizer, row["prompt"], where="base"))
        if filler < 0:
            raise ValueError(
                f"--prompt-tokens={prompt_tokens} is shorter than the bare prompt; give at least "
                f"{prompt_tokens - filler}"
            )
        message["content"] = "".join(rng.choice("0123456789") for _ in range(filler)) + message["content"]
        length = len(encode_prompt(tokenizer, row["prompt"], where=f"row {index}"))
        if length != prompt_tokens:
            raise RuntimeError(
                f"row {index} renders to {length} tokens, not {prompt_tokens}: the tokenizer merged the filler digits"
            )
    pq.write_table(pa.Table.from_pylist(table), path)
    return prompt_tokens


# ---- spmd_rlhf ---------------------------------------------------------------------------------------------------


RECOMPILE_REASONS = 40
"""At most this many distinct recompile lines kept in the result."""


def recompile_reasons(log: str) -> list[str]:
    """The distinct lines of ``log`` where TorchDynamo said what it recompiled and which guard failed
    (``TORCH_LOGS=recompiles``), without their rank and time prefix, in order; at most ``RECOMPILE_REASONS``."""
    reasons: dict[str, None] = {}
    for line in log.splitlines():
        if "[__recompiles]" in line and "triggered by the following guard failure" not in line:
            reasons.setdefault(line.split("[__recompiles]", 1)[1].strip())
    return list(reasons)[:RECOMPILE_REASONS]


def device_syncs(profile: Path) -> int | None:
    """The device syncs ``metrics.profiling.profiled`` counted in the table at ``profile`` (None: not counted, as on
    CPU)."""
    return total_in_table(profile.read_text())


def run_spmd(spec: dict, *, workdir: Path, warmup: int, profile_to: Path) -> dict:
    """Our recipe on the spec's model and prompts; its last warm-up step runs under the profiler (its table copied to
    ``profile_to``): where a step's time goes, without touching the steps measured."""
    samples = spec["prompts"] * spec["n"]
    out_dir = workdir / "spmd_out"
    profiled_step = max(0, warmup - 1)
    overrides = [
        f"model.path={spec['model_dir']}",
        f"model.dtype={spec['dtype']}",
        f"data.train_files=[{spec['train_file']}]",
        "data.val_files=[]",
        f"data.max_prompt_length={spec['prompt_tokens']}",
        f"data.batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}",
        f"rollout.max_new_tokens={spec['new_tokens']}",
        f"actor.lr={LEARNING_RATE}",
        f"actor.mini_batch_size={samples}",
        f"actor.micro_batch_size={spec['micro_batch']}",
        f"reference.micro_batch_size={spec['micro_batch']}",
        f"trainer.total_steps={spec['steps']}",
        f"trainer.output_dir={out_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.save_every=0",
        "trainer.val_every=0",
        "trainer.resume=null",
        f"trainer.profile_steps=[{profiled_step}]",
    ]
    command = launcher(spec["nproc"]) + [str(RECIPE), "--config", str(RECIPE_CONFIG), *overrides]
    log = workdir / "spmd.log"
    # TorchDynamo logs each recompile with the guard that failed: session 48's H200 run spent compile-like seconds in
    # every step's reference and update stages, and its log was lost with the machine.
    wall = run_job(command, cwd=str(workdir), threads=spec["threads"], log=log, env={"TORCH_LOGS": "recompiles"})
    profile_to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "profile" / f"step_{profiled_step}.txt", profile_to)
    with open(out_dir / "metrics.jsonl") as lines:
        every_step = [json.loads(line) for line in lines]
    steps = every_step[warmup:]
    tokens = [row["rollout/prompt_tokens"] + row["rollout/generated_tokens"] for row in steps]
    summary = step_summary(
        launch=launched(spec["nproc"]),
        wall_s=wall,
        samples=samples,
        step_s=[row["time/step"] for row in steps],
        generated=[row["rollout/generated_tokens"] for row in steps],
        reward=[row["reward/mean"] for row in steps],
        stages={
            stage: [row.get(f"time/{stage}", 0.0) for row in steps]
            for stage in ("generate", "reward", "ref_log_probs", "advantages", "update_actor")
        },
    )
    return {
        **summary,
        "tokens_per_step": statistics.fmean(tokens),
        "tokens_per_s": statistics.fmean(tokens) / summary["step_s"],
        # Kept engines (rollout.keep_engine) capture their graphs once: every step after the first should read 0.
        "cuda_graph_captures_per_step": [row.get("rollout/cuda_graph_captures") for row in every_step],
        "peak_allocated_gib_per_step": [row.get("memory/peak_allocated_gib") for row in every_step],
        "peak_reserved_gib_per_step": [row.get("memory/peak_reserved_gib") for row in every_step],
        # The caching allocator's retries (each frees cached memory, waiting for the device) and cudaMallocs.
        "alloc_retries_per_step": [row.get("memory/alloc_retries") for row in every_step],
        "device_mallocs_per_step": [row.get("memory/device_mallocs") for row in every_step],
        # Graphs TorchDynamo compiled in each step (rank 0's process), and why it recompiled: 0 after the first steps.
        "compiled_graphs_per_step": [row.get("compile/graphs") for row in every_step],
        "compile_s_per_step": [row.get("compile/seconds") for row in every_step],
        "recompile_reasons": recompile_reasons(log.read_text()),
        # The profiled step's waits of the host for the device (metrics.DeviceSyncs; GPU only), by line in the table.
        "profile": {"step": profiled_step, "table": str(profile_to), "device_syncs": device_syncs(profile_to)},
    }


# ---- TRL ---------------------------------------------------------------------------------------------------------


def run_trl(spec: dict, *, workdir: Path, warmup: int) -> dict:
    """TRL's GRPO through ``trl_grpo.trl_worker`` (one process, or ``nproc`` under torchrun), with this benchmark's
    sizes under the names that worker reads."""
    spec = {
        **spec,
        "output_dir": str(workdir / "trl_out"),
        "result": str(workdir / "trl_result.json"),
        "micro_batch_size": spec["micro_batch"],
        "max_new_tokens": spec["new_tokens"],
        "lr": LEARNING_RATE,
    }
    spec_path = workdir / "trl_spec.json"
    spec_path.write_text(json.dumps(spec))
    wall = run_job(
        launcher(spec["nproc"]) + [str(TRL_SCRIPT), str(spec_path)],
        cwd=str(workdir),
        threads=spec["threads"],
        log=workdir / "trl.log",
    )
    raw = json.loads(Path(spec["result"]).read_text())
    if not len(raw["step_s"]) == len(raw["generate_s"]) == len(raw["logs"]) == spec["steps"]:
        raise RuntimeError(
            f"TRL ran {len(raw['step_s'])} steps with {len(raw['generate_s'])} generations and "
            f"{len(raw['logs'])} log rows; expected {spec['steps']} of each"
        )
    if any("num_tokens" not in row for row in raw["logs"]):
        raise RuntimeError("TRL's logs have no num_tokens: this TRL version counts tokens differently; update run_trl")
    seen = [0.0] + [row["num_tokens"] for row in raw["logs"]]
    tokens = [after - before for before, after in zip(seen, seen[1:])][warmup:]
    logs = raw["logs"][warmup:]
    samples = spec["prompts"] * spec["n"]
    summary = step_summary(
        launch=launched(spec["nproc"]),
        wall_s=wall,
        samples=samples,
        step_s=raw["step_s"][warmup:],
        generated=[row["completions/mean_length"] * samples for row in logs],
        reward=[row["reward"] for row in logs],
        stages={"generate": raw["generate_s"][warmup:]},
    )
    return {
        **summary,
        "tokens_per_step": statistics.fmean(tokens),
        "tokens_per_s": statistics.fmean(tokens) / summary["step_s"],
    }


# ---- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, default_shape="0.5b")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per training forward/backward")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1, help="processes (devices) for each framework")
    parser.add_argument(
        "--trl-weights",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype TRL stores the weights in (it computes in bf16 autocast on GPU either way)",
    )
    parser.add_argument("--threads", type=int, help="CPU threads per process; default: cores / --nproc")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--profile", help="where the profiled warm-up step's table goes; default: beside the JSON")
    args = parse_with_smoke(parser, SMOKE)
    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} leaves nothing after --warmup={args.warmup}; use more steps")
    samples = args.prompts * args.n
    if samples % (args.micro_batch * args.nproc):
        raise ValueError(
            f"{samples} responses per step do not split into micro-batches of {args.micro_batch} on "
            f"{args.nproc} processes; change --micro-batch"
        )
    recipe = load_config(RECIPE_CONFIG)
    actor, algorithm = recipe.actor, recipe.algorithm
    if (algorithm.kl_penalty, algorithm.kl_estimator, algorithm.loss_aggregation) != ("loss", "k3", "token_mean"):
        raise ValueError(
            f"{RECIPE_CONFIG} no longer matches TRL's GRPO loss (k3 KL in the loss, token mean); "
            "update the TRL arguments in this benchmark"
        )
    # Everything is local; without this a machine with no network can stall in the hub client's retries.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = default_device()
    real_run = device == "cuda" and not args.smoke
    spec = {
        "prompts": args.prompts,
        "n": args.n,
        "new_tokens": args.new_tokens,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "nproc": args.nproc,
        "threads": args.threads or max(1, (os.cpu_count() or 1) // args.nproc),
        "device": device,
        "dtype": default_dtype(device),
        "trl_weights": args.trl_weights,
        "seed": recipe.trainer.seed,
        "rule": recipe.reward.rule,
        "weight_decay": actor.weight_decay,
        "betas": actor.betas,
        "grad_clip": actor.grad_clip,
        "kl_coef": algorithm.kl_coef,
        "clip_low": algorithm.clip_ratio_low,
        "clip_high": algorithm.clip_ratio_high,
        "temperature": recipe.rollout.temperature,
        "top_k": recipe.rollout.top_k,
        "top_p": recipe.rollout.top_p,
    }
    result = {
        "benchmark": "gpu_grpo",
        "smoke": args.smoke,
        "shape": args.shape,
        "config": spec,
        "warmup": args.warmup,
        "learning_rate": LEARNING_RATE,
        "environment": environment(device),
    }
    name = f"gpu_grpo_{args.shape}_{device}"
    with (
        tempfile.TemporaryDirectory(prefix="gpu_grpo_") as directory,
        shaped_model(args.shape, args.model_dir) as model_dir,
    ):
        workdir = Path(directory)
        train_file = workdir / "prompts.parquet"
        spec.update(
            model_dir=model_dir,
            train_file=str(train_file),
            prompt_tokens=write_prompts(
                train_file, model_dir=model_dir, rows=args.prompts * args.steps, prompt_tokens=args.prompt_tokens
            ),
        )
        print(f"spmd_rlhf: {args.steps} steps of {args.prompts} x {args.n} responses on {device}", flush=True)
        profile_to = Path(args.profile or Path(args.out, f"{name}_profile.txt"))
        ours = result["spmd_rlhf"] = run_spmd(spec, workdir=workdir, warmup=args.warmup, profile_to=profile_to)
        write_result(args.out, name, result)  # ours kept should TRL's run fail or run out of time
        print(f"TRL {version('trl')}: the same", flush=True)
        trl = result["trl"] = run_trl(spec, workdir=workdir, warmup=args.warmup)

    speedup = ours["tokens_per_s"] / trl["tokens_per_s"]
    result.update(
        trl_version=version("trl"),
        tokens_per_s_ratio=speedup,
        step_time_ratio=ours["step_s"] / trl["step_s"],
        goal=f"tokens_per_s_ratio >= {SPEEDUP_GOAL}",
        meets_goal=meets_goal(speedup, SPEEDUP_GOAL, at_least=True, real_run=real_run),
    )
    print(
        f"\nGRPO, qwen2 {args.shape}, {args.prompts} prompts x {args.n} responses, {spec['prompt_tokens']} prompt + "
        f"{args.new_tokens} new tokens, {args.nproc} x {result['environment']['device_name']}, {spec['dtype']}; "
        f"medians of steps {args.warmup + 1}-{args.steps}{', SMOKE RUN: not a GPU figure' if args.smoke else ''}"
    )
    print("| per step | spmd_rlhf | TRL | spmd_rlhf / TRL |\n| --- | --- | --- | --- |")
    for label, key, fmt in (
        ("time (s)", "step_s", ".2f"),
        ("tokens (prompt + generated)", "tokens_per_step", ".0f"),
        ("tokens/s", "tokens_per_s", ".0f"),
        ("generated tokens/s", "generated_tokens_per_s", ".0f"),
    ):
        print(f"| {label} | {ours[key]:{fmt}} | {trl[key]:{fmt}} | {ours[key] / trl[key]:.2f} |")
    print(f"| generate (s) | {ours['stage_s']['generate']:.2f} | {trl['stage_s']['generate']:.2f} | |")
    print(f"tokens/s ratio {speedup:.2f} (goal >= {SPEEDUP_GOAL})")
    write_result(args.out, name, result)


if __name__ == "__main__":
    main()
