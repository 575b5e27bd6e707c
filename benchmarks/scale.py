"""Memory floor benchmark: the peak memory per rank of each stage of a GRPO or PPO run at a real model shape, next to
the analytical floor of that stage (``benchmarks/scale_floor.py``) and their ratio.

    python benchmarks/scale.py --algo grpo --shape 0.5b --layers 2      # real widths and vocabulary, 2 layers
    python benchmarks/scale.py --algo ppo --shape 1.5b                   # the whole 1.5B shape
    python benchmarks/scale.py --algo grpo --shape 7b --nproc 8 --prompts 4   # on 8 GPUs
    python benchmarks/scale.py --smoke                                   # tiny model, seconds: checks the script
    python benchmarks/scale.py --algo grpo --shape 0.5b --lora 16        # LoRA adapters instead of the whole model
    python benchmarks/scale.py --shape 0.5b --layers 2 --seq-len 4096 8192 --cp 1 2   # long rows, context parallel

``--seq-len``: the actor's update alone on rows of that many tokens, at each ``--cp`` on that many ranks (one cp
group), against the floor of the rise it causes on a rank (``benchmarks/scale_seq_len.py``): what a long response
costs one rank with and without splitting it, and what the split costs in time. The rest of this docstring is the
recipe's stages.

Size the machine from the floor (printed, and in ``scale_floor``): on 2 ranks the largest stage's floor per rank is
about 5.5 GiB for GRPO at 0.5B in float32 (8.3 for PPO), 64 GiB for GRPO at 7B in bfloat16 (103 for PPO), 124 GiB
for GRPO at 14B in bfloat16; the measured peak on CPU was 1.4-2.6x the floor at 0.5B's widths. ``make_tiny`` also
builds the whole model once in host memory in float32.

The model is a random-init qwen2 of the shape's sizes (``gpu_common.SHAPES``: Qwen2.5 0.5B, 1.5B, 7B, 14B; ``--layers
N`` keeps the widths and vocabulary and changes the depth, so runs at two depths give the growth per layer and what
the vocabulary costs) with ``make_tiny``'s small tokenizer, on the arithmetic task with its rule reward. The recipe
(``recipes/configs/<algo>.yaml`` with the sizes below) runs under ``torchrun --nproc-per-node --nproc`` (default 2
ranks), every role colocated on all ranks (FSDP dp = ranks, tp = 1, rollout.tp = 1), ``--steps`` steps of ``--prompts``
prompts x ``--samples`` responses of ``--new-tokens`` tokens (one micro-batch per rank), in float32 on CPU and
bfloat16 on CUDA unless ``--dtype`` says otherwise; then it saves a checkpoint and exports each trained role's
weights as a Hugging Face directory (the roles' ``save_pretrained``), and a second run resumes from the checkpoint.

Stages: load (role setup), generate, log_probs (the reward, the reference's log-probs and for PPO the critic's
values, issued together), advantages, update (the actor's, and for PPO the critic's), save, export, resume (the
second run's setup plus checkpoint load). Every rank samples its memory every ~5 ms (``benchmarks/scale_worker.py``)
and the coordinator stamps each stage's wall-clock window; a stage's peak on a rank is the largest sample in its
windows (all steps) less the rank's memory just before the load began (Python, torch, the process groups). On CPU
the samples are the resident set size. glibc's malloc keeps freed blocks below its mmap threshold (which grows up to
32 MiB as large blocks are freed) in its heap, so by default RSS counts what the allocator keeps after tensors are
freed; the ranks therefore run with ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0``, which return
every freed block of 64 KiB or more to the kernel at once, and RSS follows the live tensors (plus Python's small
objects) — ``--keep-allocator-cache`` measures with glibc's defaults instead, an upper bound. On CUDA they are
``torch.cuda.max_memory_allocated`` between samples: live tensors only.

Writes ``benchmarks/results/scale_<algo>_<shape>_l<layers>_<device>.json`` and prints, per stage: peak per rank (the
larger rank), floor, peak / floor, whether the excess reaches one whole float32 copy of the model (a rank that
gathered the full model, which the design forbids at every stage but generation's own copy, already in the floor),
the stage's own rise (RSS does not fall when the allocator keeps freed memory, so a stage's peak may be an earlier
stage's: the rise says what the stage itself added) and its seconds.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import add_model_arguments, environment, parse_with_smoke, shape_fields, shaped_model, write_result  # noqa: E402
from scale_floor import STAGE_OF_TIMER, STAGES, design_parts, full_model_bytes, stage_floors  # noqa: E402

from spmd_rlhf.config import load_config  # noqa: E402
from spmd_rlhf.tiny.task import make_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "scale_worker.py"
GIB = 2**30
KV_BLOCK_SIZE = 16
RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
"""glibc malloc settings under which a freed block of 64 KiB or more goes back to the kernel at once (CPU only)."""


def recipe_overrides(args: argparse.Namespace, *, model_dir: str, task_dir: str, run_dir: str) -> list[str]:
    """The recipe config's overrides for this benchmark: model, task, sizes, one micro-batch per rank, no
    validation, no resume, every role colocated."""
    rows = args.prompts * args.samples
    if rows % args.nproc:
        raise ValueError(f"--prompts x --samples = {rows} rows do not split over {args.nproc} ranks; change either")
    micro = rows // args.nproc
    overrides = [
        f"model.path={model_dir}",
        f"model.dtype={args.dtype}",
        f"data.train_files=[{task_dir}/train.parquet]",
        "data.val_files=[]",
        f"data.batch_size={args.prompts}",
        f"rollout.n={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "placement=colocate",
        "rollout.tp=1",
        "actor.tp=1",
        f"actor.mini_batch_size={rows}",
        f"actor.micro_batch_size={micro}",
        f"reference.micro_batch_size={micro}",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={run_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.resume=null",
    ]
    if args.algo == "ppo":
        overrides += ["critic.tp=1", f"critic.mini_batch_size={rows}", f"critic.micro_batch_size={micro}"]
    if args.lora:
        # The actor's base serves as the reference: no reference role.
        overrides += [f"actor.lora.rank={args.lora}", "reference.enabled=false"]
        overrides += [f"critic.lora.rank={args.lora}"] if args.algo == "ppo" else []
    return overrides


def run_phase(args: argparse.Namespace, phase: str, *, config_path: Path, overrides: list[str], scratch: Path) -> Path:
    """One torchrun launch of the worker program for ``phase``; the directory of its records."""
    record = scratch / f"record_{phase}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(WORKER),
        "--algo",
        args.algo,
        "--phase",
        phase,
        "--record",
        str(record),
        "--checkpoint",
        str(scratch / "run" / "checkpoint"),
        "--export",
        str(scratch / "export"),
        "--config",
        str(config_path),
        *overrides,
    ]
    log = scratch / f"{phase}.log"
    environment_variables = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "SCALE_SAMPLE_INTERVAL": str(args.interval),
    }
    if not args.keep_allocator_cache and not torch.cuda.is_available():
        environment_variables.update(RETURN_FREED_MEMORY)
    print(f"{phase}: torchrun --nproc-per-node {args.nproc} {WORKER.name} ({log})", flush=True)
    with open(log, "w") as out:
        finished = subprocess.run(command, cwd=scratch, env=environment_variables, stdout=out, stderr=subprocess.STDOUT)
    if finished.returncode:
        tail = "\n".join(log.read_text().splitlines()[-60:])
        raise RuntimeError(f"the {phase} run exited with {finished.returncode}; last lines of {log}:\n{tail}")
    return record


def stage_peaks(record: Path, nproc: int) -> tuple[dict[str, dict], list[int]]:
    """Per stage: each rank's peak above its baseline (bytes), its rise (the most any one window of the stage rose
    above the sample before it began: what the stage itself added, where the peak may be memory an earlier stage
    left with the allocator) and the stage's seconds; and each rank's baseline, its last sample before the first
    stage began. A window's samples are those inside it plus the first after it (on CUDA a sample holds the peak
    since the one before), so a stage shorter than the interval still gets one."""
    windows = json.loads((record / "stages.json").read_text())
    first_start = min(start for _, start, _ in windows)
    by_stage: dict[str, list[tuple[float, float]]] = {}
    for name, start, end in windows:
        by_stage.setdefault(STAGE_OF_TIMER.get(name, name), []).append((start, end))
    stages: dict[str, dict] = {
        name: {
            "peak_bytes_per_rank": [],
            "rise_bytes_per_rank": [],
            "seconds": sum(end - start for start, end in spans),
        }
        for name, spans in by_stage.items()
    }
    baselines = []
    for rank in range(nproc):
        samples = json.loads((record / f"memory_rank{rank}.json").read_text())
        times, values = samples["times"], samples["bytes"]
        if not times or times[-1] < max(end for _, _, end in windows):
            raise RuntimeError(f"rank {rank}'s memory samples stop before its run ended: its sampler thread failed")
        baseline = values[max(0, bisect.bisect_left(times, first_start) - 1)]
        baselines.append(baseline)
        for name, spans in by_stage.items():
            peaks, rises = [], []
            for start, end in spans:
                first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
                peaks.append(max(values[first : last + 1], default=0))
                rises.append(peaks[-1] - values[max(0, first - 1)])
            stages[name]["peak_bytes_per_rank"].append(max(peaks) - baseline)
            stages[name]["rise_bytes_per_rank"].append(max(rises))
    return stages, baselines


def measurement(device: str, *, keep_allocator_cache: bool) -> str:
    if device == "cuda":
        return "cuda max_memory_allocated"
    if keep_allocator_cache:
        return "RSS with glibc's allocator cache (upper bound on live tensors)"
    return "RSS, freed blocks >= 64 KiB returned to the kernel (live tensors + small objects)"


def _order(name: str) -> tuple[int, str]:
    return (STAGES.index(name) if name in STAGES else len(STAGES), name)


def table(result: dict) -> str:
    lora = f", LoRA rank {result['lora_rank']} (floors: full fine-tuning's)" if result["lora_rank"] else ""
    lines = [
        f"{result['algo']}{lora} at {result['shape']} ({result['layers']} layers, vocab {result['vocab']}), "
        f"{result['nproc']} ranks, {result['dtype']}, {result['measurement']}; "
        f"{result['steps']} steps of {result['prompts']} prompts x "
        f"{result['samples']} samples x {result['new_tokens']} new tokens",
        "",
        "| stage | peak per rank (GiB) | floor (GiB) | peak / floor | floor + design buffers (GiB) | peak / that "
        "| whole-model copy? | rise in stage (GiB) | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stage in result["stages"]:
        lines.append(
            f"| {stage['stage']} | {stage['peak_bytes'] / GIB:.3f} | {stage['floor_bytes'] / GIB:.3f} | "
            f"{stage['peak_over_floor']:.2f} | {stage['design_floor_bytes'] / GIB:.3f} | "
            f"{stage['peak_over_design_floor']:.2f} | {'yes' if stage['whole_model_copy'] else 'no'} | "
            f"{max(stage['rise_bytes_per_rank']) / GIB:.3f} | {stage['seconds']:.1f} |"
        )
    lines += ["", f"floors per rank (parts, MiB; one float32 model = {result['full_model_bytes'] / 2**20:,.1f} MiB):"]
    for stage in result["stages"]:
        parts = ", ".join(f"{part} {size / 2**20:,.1f}" for part, size in stage["floor_parts"].items())
        design = ", ".join(f"{part} {size / 2**20:,.1f}" for part, size in stage["design_parts"].items())
        lines.append(f"  {stage['stage']}: {parts}" + (f"; design buffers: {design}" if design else ""))
    return "\n".join(lines)


def run_seq_len(args: argparse.Namespace) -> None:
    """``--seq-len``: ``scale_seq_len.py`` under torchrun at each ``--cp``; prints and writes the table."""
    records = []
    with (
        shaped_model(args.shape, args.model_dir, layers=args.layers, vocab=args.vocab) as model_dir,
        tempfile.TemporaryDirectory(prefix="scale_seq_len_") as scratch,
    ):
        for cp in args.cp:
            out = Path(scratch) / f"cp{cp}.jsonl"
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={cp}",
                str(ROOT / "benchmarks" / "scale_seq_len.py"),
                f"--model-dir={Path(model_dir).resolve()}",
                "--lengths",
                *map(str, args.seq_len),
                f"--repeats={args.repeats}",
                f"--out={out}",
                *(["--activation-checkpointing"] if args.activation_checkpointing else []),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1", **RETURN_FREED_MEMORY)
            subprocess.run(command, check=True, env=env, cwd=ROOT)
            records += [json.loads(line) for line in out.read_text().splitlines()]
    single = {record["length"]: record for record in records if record["cp"] == 1}
    rows = []
    for record in records:
        steady = [max(rises[1:] or rises) for rises in record["rise_bytes_per_rank"]]  # per rank, after the first
        floor = sum(record["floor_bytes"].values())
        seconds = max(min(times[1:] or times) for times in record["seconds_per_rank"])
        alone = single.get(record["length"])
        alone_s = max(min(times[1:] or times) for times in alone["seconds_per_rank"]) if alone else None
        rows.append(
            {
                **record,
                "steady_rise_bytes": max(steady),
                "floor": floor,
                "rise_over_floor": max(steady) / floor,
                "update_s": seconds,
                "time_over_cp1": seconds / alone_s if alone_s else None,
            }
        )
    print("| tokens | cp | rise per rank MiB | floor MiB | rise / floor | update s | time / cp=1 |\n|" + " --- |" * 7)
    for row in rows:
        ratio = "—" if row["time_over_cp1"] is None else f"{row['time_over_cp1']:.2f}"
        print(
            f"| {row['length']} | {row['cp']} | {row['steady_rise_bytes'] / 2**20:.0f} | {row['floor'] / 2**20:.0f} "
            f"| {row['rise_over_floor']:.2f} | {row['update_s']:.1f} | {ratio} |"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {
        "benchmark": "scale_seq_len",
        "shape": args.shape,
        "layers": args.layers,
        "vocab": args.vocab,
        "activation_checkpointing": args.activation_checkpointing,
        "rows": rows,
        "environment": environment(device),
    }
    write_result(args.out, f"scale_seq_len_{args.shape}_l{args.layers}_{device}", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="grpo", choices=["grpo", "ppo"])
    add_model_arguments(parser, default_shape="0.5b")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's own)")
    parser.add_argument("--experts", type=int, help="routed experts of a mixture-of-experts shape (default: its own)")
    parser.add_argument("--steps", type=int, default=2, help="steps (2 or more: later steps hold the Adam moments)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2, help="responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dtype", help="model.dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--interval", type=float, default=0.005, help="seconds between memory samples")
    parser.add_argument(
        "--keep-allocator-cache",
        action="store_true",
        help="CPU: measure with glibc malloc's defaults (RSS keeps freed heap blocks: an upper bound)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="train LoRA adapters of this rank on every linear layer (all-linear) instead of the whole "
        "model; the floors stay full fine-tuning's, so peak / floor compares LoRA with them",
    )
    parser.add_argument("--seq-len", type=int, nargs="+", help="tokens per row: the long-sequence update instead")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context-parallel degrees of --seq-len")
    parser.add_argument("--repeats", type=int, default=1, help="--seq-len: steady updates after the first")
    parser.add_argument(
        "--vocab", type=int, help="--seq-len: vocabulary rows (default the shape's; fewer keep CPU runs short)"
    )
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="--seq-len: model.activation_checkpointing=true"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parse_with_smoke(parser, {"shape": "smoke"})
    if args.seq_len:
        run_seq_len(args)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    fields = shape_fields(args.shape, layers=args.layers, experts=args.experts)
    config_path = ROOT / "recipes" / "configs" / f"{args.algo}.yaml"

    with (
        shaped_model(args.shape, args.model_dir, layers=args.layers, experts=args.experts) as model_dir,
        tempfile.TemporaryDirectory(prefix="scale_") as directory,
    ):
        scratch = Path(directory)
        make_task(task="arithmetic", out_dir=str(scratch / "task"))
        overrides = recipe_overrides(
            args, model_dir=str(Path(model_dir).resolve()), task_dir=str(scratch / "task"), run_dir=str(scratch / "run")
        )
        config = load_config(config_path, overrides)
        # The KV cache sized for this batch, as on CPU: on CUDA the engine otherwise takes what
        # rollout.memory_fraction leaves of the free memory (a pool by design, not a floor this benchmark checks).
        longest = config.data.max_prompt_length + config.rollout.response_length
        blocks = -(-config.data.batch_size * config.rollout.n // args.nproc) * -(-longest // KV_BLOCK_SIZE)
        overrides += [f"rollout.kv_block_size={KV_BLOCK_SIZE}", f"rollout.kv_cache_blocks={blocks}"]
        config = load_config(config_path, overrides)
        floors = stage_floors(config, devices=args.nproc)
        buffers = design_parts(config, devices=args.nproc)
        whole_model = full_model_bytes(config)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        stages, baselines = stage_peaks(
            run_phase(args, "train", config_path=config_path, overrides=overrides, scratch=scratch), args.nproc
        )
        resumed, resume_baselines = stage_peaks(
            run_phase(args, "resume", config_path=config_path, overrides=overrides, scratch=scratch), args.nproc
        )
    stages.update(resumed)

    rows = []
    for name in sorted(stages, key=_order):
        parts = floors.get(name, floors["advantages"])  # a stage the floor model does not name: the resident state
        extra = buffers.get(name, {})
        floor, peak = sum(parts.values()), max(stages[name]["peak_bytes_per_rank"])
        design_floor = floor + sum(extra.values())
        rows.append(
            {
                "stage": name,
                "seconds": stages[name]["seconds"],
                "peak_bytes_per_rank": stages[name]["peak_bytes_per_rank"],
                "rise_bytes_per_rank": stages[name]["rise_bytes_per_rank"],
                "peak_bytes": peak,
                "floor_bytes": floor,
                "floor_parts": parts,
                "peak_over_floor": peak / floor,
                "design_parts": extra,
                "design_floor_bytes": design_floor,
                "peak_over_design_floor": peak / design_floor,
                "whole_model_copy": peak - design_floor >= whole_model,
            }
        )
    result = {
        "benchmark": "scale",
        "smoke": args.smoke,
        "algo": args.algo,
        "shape": args.shape,
        "lora_rank": args.lora,
        "layers": fields["num_layers"],
        "vocab": vocab,
        "nproc": args.nproc,
        "dtype": args.dtype,
        "steps": args.steps,
        "prompts": args.prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "measurement": measurement(device, keep_allocator_cache=args.keep_allocator_cache),
        "sample_interval_s": args.interval,
        "baseline_bytes_per_rank": {"train": baselines, "resume": resume_baselines},
        "full_model_bytes": whole_model,
        "recipe_overrides": overrides,
        "stages": rows,
        "environment": environment(device),
        "worst_peak_over_floor": max(row["peak_over_floor"] for row in rows),
    }
    print(table(result))
    if args.smoke:
        print("SMOKE RUN: not a figure at scale")
    cache = "_allocator_cache" if args.keep_allocator_cache and device == "cpu" else ""
    lora = f"_lora{args.lora}" if args.lora else ""
    write_result(args.out, f"scale_{args.algo}_{args.shape}_l{fields['num_layers']}_{device}{lora}{cache}", result)


if __name__ == "__main__":
    main()
