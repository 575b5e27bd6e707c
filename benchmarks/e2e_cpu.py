"""GRPO end to end on CPU: the spmd_rlhf recipe against TRL's ``GRPOTrainer``, same model, prompts, reward and sizes.

    pip install -e '.[bench]'      # TRL; without it only the spmd_rlhf half runs
    python benchmarks/e2e_cpu.py [--config tiny|tiny_gen32|small_gen32|qwen05b] [--nproc 2] [--trl-launch both]
                                 [--steps 12] [--warmup 2] [--rounds 1]
    python benchmarks/e2e_cpu.py --config qwen05b --steps 4 --warmup 1   # Qwen2.5-0.5B's shape: minutes per step
    python benchmarks/e2e_cpu.py --summary     # one table of every config's ratios, from benchmarks/results

Each named config fixes the model shape (qwen2 family from ``make_tiny``, random init), prompts per step, responses
per prompt, and new tokens; everything else (learning rate unless the config sets one, KL coefficient and estimator,
clip ratios, optimizer, temperature) comes from ``recipes/configs/grpo.yaml`` and is handed to TRL as the matching
``GRPOConfig`` field.

1. spmd_rlhf: ``recipes/grpo.py`` under ``torch.distributed.run --nproc-per-node N`` (one thread per rank) in a fresh
   temporary directory, where the recipe builds the arithmetic task on first use; ``metrics.jsonl`` gives every
   step's time, stage times and generated tokens. The reference gets the actor's micro-batch (grpo.yaml leaves it
   at the default 4), as TRL's reference pass uses the training micro-batch.
2. TRL: the same model directory, the task's parquet rows (conversational ``prompt`` column), the package's rule
   reward, one optimizer step per generation batch, fp32, no vLLM, no gradient checkpointing. It runs in one
   process with N threads, and under torchrun as N single-thread processes (DDP over gloo); a callback times each
   step, and the trainer's ``_generate`` and ``_generate_and_score_completions`` are timed for the stage split.

The runs take turns on the same cores, never overlapping. The first ``--warmup`` steps of each are left out and the
table gives per-step medians, which a busy neighbour on a shared machine moves less than means (the JSON also has
mean step times and the load average before and after); ``--rounds R`` alternates the runs R times and keeps each
one's fastest round. Ratios are spmd_rlhf / TRL: below 1 is faster for time and less for memory, above 1 faster
for rates. Memory is each process's peak resident set size (the kernel's ``VmHWM``, polled every 0.1 s while it runs,
so exact but for growth in its last 0.1 s; the torchrun agent left out): the most any one process held, allocator
caches included. Generation
alone (engine against ``transformers`` ``generate``) is measured by ``benchmarks/engine_generate.py``. Writes
``benchmarks/results/e2e_cpu_<config>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from benchmark_jobs import RECIPE, RECIPE_CONFIG, launched, launcher, run_job_measured, step_summary
from gpu_common import SHAPES
from trl_grpo import TRL_SCRIPT

from spmd_rlhf.config import load_config

TRAIN_FILE = "tiny/task/train.parquet"

CONFIGS = {
    # recipes/configs/grpo.yaml as shipped: many short responses, so training dominates generation.
    "tiny": dict(hidden_size=64, num_layers=2, prompts=8, n=16, max_new_tokens=4, micro_batch_size=32),
    # Fewer, longer responses: generation is a larger share of the step.
    "tiny_gen32": dict(hidden_size=64, num_layers=2, prompts=8, n=4, max_new_tokens=32, micro_batch_size=16),
    # A wider, deeper model, so that kernels rather than per-call overheads take the time.
    "small_gen32": dict(hidden_size=256, num_layers=4, prompts=8, n=4, max_new_tokens=32, micro_batch_size=16),
    # 64 new tokens ended early by stop ids (3% of the vocabulary, given to both), so responses vary in length as
    # EOS-terminated ones do: continuous batching drops finished rows, packed training skips their padding.
    "small_gen64": dict(
        hidden_size=256, num_layers=4, prompts=8, n=4, max_new_tokens=64, micro_batch_size=16, stop_fraction=0.03
    ),
    # Qwen2.5-0.5B's shape (151,936-row tied vocabulary), random init, a small batch: where memory and the vocabulary
    # projection, not per-call overheads, decide. grpo.yaml's learning rate is sized for the tiny model and would
    # blow this one up (as in benchmarks/gpu_grpo.py).
    "qwen05b": dict(**SHAPES["0.5b"], prompts=2, n=2, max_new_tokens=16, micro_batch_size=2, lr=1e-6),
}
MODEL_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "model_vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)
"""The keys of a ``CONFIGS`` entry that are ``make_tiny``'s (those left out keep its defaults)."""


def stop_ids(model_dir: Path, fraction: float) -> tuple[int, list[int]]:
    """The tokenizer's EOS id, and a fixed random ``fraction`` of its ordinary tokens as extra stop ids (none at 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ordinary = sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids))
    count = int(fraction * len(ordinary))
    chosen = torch.randperm(len(ordinary), generator=torch.Generator().manual_seed(0))[:count].tolist()
    return tokenizer.eos_token_id, sorted(ordinary[index] for index in chosen)


# ---- spmd_rlhf ---------------------------------------------------------------------------------------------------


def spmd_command(spec: dict, *, out_dir: Path, nproc: int) -> list[str]:
    """The command line (``launcher``) of the GRPO recipe run that ``spec`` describes, writing to ``out_dir``."""
    samples = spec["prompts"] * spec["n"]
    overrides = [
        f"trainer.total_steps={spec['steps']}",
        f"trainer.output_dir={out_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.save_every=0",
        "trainer.val_every=0",
        f"data.batch_size={spec['prompts']}",
        f"rollout.n={spec['n']}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        f"actor.mini_batch_size={samples}",
        f"actor.micro_batch_size={spec['micro_batch_size']}",
        f"reference.micro_batch_size={spec['micro_batch_size']}",
        f"actor.lr={spec['lr']}",
        f"rollout.stop_token_ids=[{','.join(map(str, spec['stop_ids']))}]",
    ]
    return launcher(nproc) + [str(RECIPE), "--config", str(RECIPE_CONFIG), *overrides]


def run_spmd(spec: dict, *, workdir: Path, out_dir: Path, nproc: int, warmup: int, huge_pages: bool = True) -> dict:
    """The GRPO recipe for ``spec['steps']`` steps in ``workdir`` (``huge_pages``: trainer.host_huge_pages); per-step
    medians over the steps after ``warmup``."""
    samples = spec["prompts"] * spec["n"]
    command = spmd_command(spec, out_dir=out_dir, nproc=nproc) + [f"trainer.host_huge_pages={str(huge_pages).lower()}"]
    wall, peak_rss = run_job_measured(command, cwd=str(workdir), threads=1, log=workdir / f"{out_dir.name}.log")
    with open(out_dir / "metrics.jsonl") as lines:
        steps = [json.loads(line) for line in lines][warmup:]
    scoring = ("reward", "old_log_probs", "ref_log_probs", "advantages")
    return step_summary(
        launch=f"{launched(nproc)} x 1 thread" + ("" if huge_pages else ", 4 KiB pages"),
        wall_s=wall,
        samples=samples,
        step_s=[row["time/step"] for row in steps],
        generated=[row["rollout/generated_tokens"] for row in steps],
        reward=[row["reward/mean"] for row in steps],
        peak_rss=peak_rss,
        stages={
            "generate": [row["time/generate"] for row in steps],
            "score_and_log_probs": [sum(row.get(f"time/{stage}", 0.0) for stage in scoring) for row in steps],
            "update": [row["time/update_actor"] for row in steps],
            **{stage: [row.get(f"time/{stage}", 0.0) for row in steps] for stage in scoring},
        },
    )


# ---- TRL ---------------------------------------------------------------------------------------------------------


def run_trl(spec: dict, *, workdir: Path, nproc: int, threads: int, warmup: int, huge_pages: bool = False) -> dict:
    """TRL's GRPO in a subprocess (one process, or ``nproc`` under torchrun), with glibc's huge pages if asked;
    per-step medians after ``warmup``."""
    workdir.mkdir()
    spec = {
        **spec,
        "threads": threads,
        "output_dir": str(workdir / "trl_out"),
        "result": str(workdir / "trl_result.json"),
    }
    spec_path = workdir / "trl_spec.json"
    spec_path.write_text(json.dumps(spec))
    wall, peak_rss = run_job_measured(
        launcher(nproc) + [str(TRL_SCRIPT), str(spec_path)],
        cwd=str(workdir),
        threads=threads,
        log=workdir / "trl.log",
        huge_pages=huge_pages,
    )
    raw = json.loads(Path(spec["result"]).read_text())
    step_s, generate, generate_and_score = (
        raw[key][warmup:] for key in ("step_s", "generate_s", "generate_and_score_s")
    )
    logs = raw["logs"][warmup:]
    if not len(step_s) == len(generate) == len(generate_and_score) == len(logs):
        raise RuntimeError(
            f"TRL did not generate once per optimizer step ({len(generate)} generations, {len(step_s)} steps)"
        )
    samples = spec["prompts"] * spec["n"]
    per_process = f"{threads} thread" + ("s" if threads > 1 else "")
    launch = f"{launched(nproc)} x {per_process}"
    launch += ", huge pages" if huge_pages else ""
    return step_summary(
        launch=launch,
        wall_s=wall,
        samples=samples,
        step_s=step_s,
        generated=[row["completions/mean_length"] * samples for row in logs],
        reward=[row["reward"] for row in logs],
        peak_rss=peak_rss,
        stages={
            "generate": generate,
            "score_and_log_probs": [both - alone for both, alone in zip(generate_and_score, generate)],
            "update": [step - both for step, both in zip(step_s, generate_and_score)],
        },
    )


# ---- report ------------------------------------------------------------------------------------------------------

ROWS = (  # label, key, format, whether the ratio spmd_rlhf / TRL is printed
    ("time per step (s)", "step_s", ".3f", True),
    ("steps/s", "steps_per_s", ".2f", False),
    ("samples/s (responses)", "samples_per_s", ".1f", True),
    ("generated tokens/s", "generated_tokens_per_s", ".0f", True),
    ("generated tokens per step", "generated_tokens_per_step", ".0f", False),
    ("generate (s/step)", "generate", ".3f", False),
    ("reward + log-probs + advantages (s/step)", "score_and_log_probs", ".3f", False),
    ("update (s/step)", "update", ".3f", False),
    ("peak RSS of a process (GiB)", "peak_rss_gib", ".2f", True),
    ("wall time incl. start-up (s)", "wall_s_with_startup", ".1f", False),
    ("mean reward over measured steps", "reward_mean", ".3f", False),
)


def _value(run: dict, key: str) -> float:
    return run["stage_s"][key] if key in run["stage_s"] else run[key]


def _table(result: dict) -> str:
    spec, ours, trl = result["config"], result["spmd_rlhf"], result["trl"]
    stops = f", responses also end at {len(spec['stop_ids'])} stop ids" if spec.get("stop_ids") else ""
    header = (
        f"GRPO `{result['name']}`: qwen2 hidden {spec['hidden_size']} x {spec['num_layers']} layers, vocab "
        f"{result['vocab']}; {spec['prompts']} prompts x {spec['n']} responses, {spec['max_new_tokens']} new tokens, "
        f"micro-batch {spec['micro_batch_size']}{stops}; {spec['steps']} steps, first {result['warmup']} left out, "
        f"medians per step, best of {result['rounds']} alternating round(s); CPU fp32, {result['cpus']} cores, "
        f"TRL {result['trl_version'] or 'not installed'}\n\n"
    )
    columns = ["", "spmd_rlhf", *(f"TRL ({name})" for name in trl), *(f"ratio vs TRL ({name})" for name in trl)]
    launches = [run["launch"] for run in (ours, *trl.values())] + [""] * len(trl)
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
        "| launch | " + " | ".join(launches) + " |",
    ]
    for label, key, fmt, ratio in ROWS:
        cells = [format(_value(run, key), fmt) for run in (ours, *trl.values())]
        cells += [f"{_value(ours, key) / _value(run, key):.2f}" if ratio else "" for run in trl.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    scoring = ("reward", "old_log_probs", "ref_log_probs", "advantages")
    stages = ", ".join(f"{stage} {ours['stage_s'][stage]:.3f}" for stage in scoring)
    return header + "\n".join(lines) + f"\n\nspmd_rlhf scoring stages (s/step): {stages}"


SUMMARY_STAGES = (
    ("step", "step_s"),
    ("generate", "generate"),
    ("reward + log-probs", "score_and_log_probs"),
    ("update", "update"),
)


def summary_table(results_dir: str) -> str:
    """One row per ``e2e_cpu_<config>.json`` in ``results_dir``: samples/s against TRL in one process, and each
    stage's time ratio (TRL / spmd_rlhf: above 1 is faster here)."""
    lines = [
        "| config | samples/s spmd_rlhf | samples/s TRL | speedup | "
        + " | ".join(f"{name} speedup" for name, _ in SUMMARY_STAGES[1:])
        + " | peak RSS / TRL's |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * len(SUMMARY_STAGES[1:]) + " ---: |",
    ]
    for path in sorted(Path(results_dir).glob("e2e_cpu_*.json")):
        result = json.loads(path.read_text())
        ours, trl = result["spmd_rlhf"], result["trl"].get("process")
        if trl is None:
            continue
        stages = " | ".join(f"{_value(trl, key) / _value(ours, key):.2f}x" for _, key in SUMMARY_STAGES[1:])
        memory = (
            f"{ours['peak_rss_gib'] / trl['peak_rss_gib']:.2f}"
            if "peak_rss_gib" in ours and "peak_rss_gib" in trl
            else ""
        )
        lines.append(
            f"| {result['name']} | {ours['samples_per_s']:.1f} | {trl['samples_per_s']:.1f} | "
            f"{ours['samples_per_s'] / trl['samples_per_s']:.2f}x | {stages} | {memory} |"
        )
    return "\n".join(lines)


def benchmark_spec(config: str, *, steps: int) -> dict:
    """The named ``CONFIGS`` entry completed with everything else from ``recipes/configs/grpo.yaml``."""
    recipe = load_config(RECIPE_CONFIG)
    actor, algorithm = recipe.actor, recipe.algorithm
    if (algorithm.kl_penalty, algorithm.kl_estimator, algorithm.loss_aggregation) != ("loss", "k3", "token_mean"):
        raise ValueError(
            f"{RECIPE_CONFIG} no longer matches TRL's GRPO loss (k3 KL in the loss, token mean); "
            "update the TRL arguments in this benchmark"
        )
    return {
        "lr": actor.lr,
        **CONFIGS[config],
        "steps": steps,
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


def build_model(spec: dict, workdir: Path) -> tuple[Path, int]:
    """The config's model (``make_tiny``, random init) in ``workdir/tiny/model``, where the recipe looks for it (it
    builds the task beside it on first use), and ``spec``'s stop ids set; the model directory and its vocabulary."""
    from spmd_rlhf.tiny.model import make_tiny

    model_dir = workdir / "tiny" / "model"
    make_tiny(family="qwen2", out_dir=str(model_dir), seed=0, **{key: spec[key] for key in MODEL_FIELDS if key in spec})
    spec["eos_token_id"], spec["stop_ids"] = stop_ids(model_dir, spec.get("stop_fraction", 0.0))
    return model_dir, json.loads((model_dir / "config.json").read_text())["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--summary", action="store_true", help="print one table of every config's ratios from --out")
    parser.add_argument(
        "--nproc", type=int, default=2, help="spmd_rlhf ranks (one thread each); TRL gets as many cores"
    )
    parser.add_argument(
        "--trl-launch",
        default="both",
        choices=["process", "torchrun", "both"],
        help="TRL in one process with --nproc threads, under torchrun with --nproc processes, or both",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternate the runs this often; each keeps its best round"
    )
    parser.add_argument(
        "--no-host-huge-pages",
        action="store_true",
        help="run spmd_rlhf with trainer.host_huge_pages=false (glibc's default 4 KiB pages)",
    )
    parser.add_argument(
        "--trl-huge-pages",
        action="store_true",
        help="also run TRL in one process with glibc's huge-page tunable, as our CPU ranks give themselves",
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.summary:
        print(summary_table(args.out))
        return
    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} leaves nothing after --warmup={args.warmup}; use more steps")

    spec = benchmark_spec(args.config, steps=args.steps)
    try:
        trl_version = version("trl")
    except PackageNotFoundError:
        trl_version = None
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(
            f"note: 1-minute load average {load_before:.1f} before starting (an earlier run counts too); "
            "other work on these cores skews the numbers"
        )
    launches = {
        "process": (1, args.nproc, False),
        "torchrun": (args.nproc, 1, False),
        "process_huge_pages": (1, args.nproc, True),
    }
    trl_launches = (
        [] if trl_version is None else ["process", "torchrun"] if args.trl_launch == "both" else [args.trl_launch]
    )
    trl_launches += ["process_huge_pages"] if args.trl_huge_pages and trl_version else []
    for name in trl_launches:
        samples, processes = spec["prompts"] * spec["n"], launches[name][0]
        if samples % (spec["micro_batch_size"] * processes):
            raise ValueError(
                f"--config {args.config}: {samples} samples per step do not split into micro-batches of "
                f"{spec['micro_batch_size']} on {processes} TRL processes; change micro_batch_size in CONFIGS"
            )
    if trl_version is None:
        print("TRL is not installed, so only spmd_rlhf is measured; for both: pip install -e '.[bench]'")
    runs: dict[str, list[dict]] = {"spmd_rlhf": [], **{name: [] for name in trl_launches}}
    with tempfile.TemporaryDirectory(prefix="e2e_cpu_") as directory:
        workdir = Path(directory)
        model_dir, vocab = build_model(spec, workdir)
        for round_index in range(args.rounds):
            print(
                f"round {round_index + 1}/{args.rounds}: spmd_rlhf, {args.steps} steps on {args.nproc} ranks",
                flush=True,
            )
            runs["spmd_rlhf"].append(
                run_spmd(
                    spec,
                    workdir=workdir,
                    out_dir=workdir / f"spmd_{round_index}",
                    nproc=args.nproc,
                    warmup=args.warmup,
                    huge_pages=not args.no_host_huge_pages,
                )
            )
            for name in trl_launches:
                nproc, threads, huge_pages = launches[name]
                print(
                    f"round {round_index + 1}/{args.rounds}: TRL {trl_version} ({name}), same model and task",
                    flush=True,
                )
                runs[name].append(
                    run_trl(
                        {**spec, "model_dir": str(model_dir), "train_file": str(workdir / TRAIN_FILE)},
                        workdir=workdir / f"trl_{name}_{round_index}",
                        nproc=nproc,
                        threads=threads,
                        warmup=args.warmup,
                        huge_pages=huge_pages,
                    )
                )
    trl = {
        name: {**min(each, key=lambda run: run["step_s"]), "rounds_step_s": [run["step_s"] for run in each]}
        for name, each in runs.items()
    }
    ours = trl.pop("spmd_rlhf")

    result = {
        "name": args.config,
        "config": spec,
        "vocab": vocab,
        "warmup": args.warmup,
        "spmd_rlhf": ours,
        "trl": trl,
        "ratios": {
            name: {
                "step_time": ours["step_s"] / run["step_s"],
                "samples_per_s": ours["samples_per_s"] / run["samples_per_s"],
                "peak_rss": ours["peak_rss_gib"] / run["peak_rss_gib"],
            }
            for name, run in trl.items()
        },
        "trl_version": trl_version,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "command": f"python benchmarks/e2e_cpu.py --config {args.config} --nproc {args.nproc} "
        f"--trl-launch {args.trl_launch} --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}"
        + (" --no-host-huge-pages" if args.no_host_huge_pages else "")
        + (" --trl-huge-pages" if args.trl_huge_pages else ""),
    }
    print()
    print(_table(result))
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"e2e_cpu_{args.config}.json")
    with open(out_file, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
