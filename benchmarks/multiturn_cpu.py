"""Multi-turn tool rollouts on CPU: trajectories/s of GRPO on 2 ranks, and the prefill that cross-turn prefix reuse
saves, on the tool_products task.

    python benchmarks/multiturn_cpu.py [--nproc 2] [--steps 6] [--warmup 2] [--max-turns 3] [--block-size 16]
                                       [--environment-workers 16]

The policy is the tiny llama warm-started on tool_products demonstrations \
(``tiny.warm_start.make_tool_products_policy``:
good calculator calls, broken calls and guesses), and the environment is the real one (``rollout.environment=tool``):
its calls run the sandboxed calculator (a process start each), broken ones get error observations, and a turn without
a call ends the trajectory.

1. ``recipes/grpo.py`` under ``torch.distributed.run --nproc-per-node N`` with ``rollout.environment`` set to that
   environment and a learning rate small enough that every step samples the same kind of trajectories (at grpo.yaml's
   the policy learns the tool within a few steps): trajectories/s is rows per step /
   ``time/generate`` (median over the steps after ``--warmup``); the share of prompt tokens whose prefill was
   skipped comes from ``rollout/cached_prefill_tokens``.
2. One process, the engine alone: the same rollout with and without the cross-turn prefix cache
   (``run_multi_turn(reuse_prefix=...)``), each the fastest of 3: prefill tokens computed, and the time spent in the
   engine (the sandboxed calls are the same in both and left out). Without the session the n
   samples of a prompt still share the prompt's blocks within each turn, so the difference is what reuse across
   turns saves. Only whole KV blocks are shared: ``--block-size`` matters.

On a shared, loaded machine the times are indicative only; token counts are exact. Writes
``benchmarks/results/multiturn_cpu_block<B>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES = 8, 8
"""Prompts per step and trajectories per prompt, in both parts."""
MAX_NEW_TOKENS, TURN_BUDGET = 32, 48
"""Tokens per turn; tokens per turn and its observation in the trajectory budget."""


def _recipe(workdir: Path, model: str, task: str, args) -> list[dict]:
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{task}/train.parquet]",
        "data.val_files=[]",
        "trainer.val_every=0",
        f"trainer.total_steps={args.steps}",
        "trainer.save_every=0",
        "trainer.output_dir=out",
        f"data.batch_size={PROMPTS}",
        f"rollout.n={SAMPLES}",
        f"actor.mini_batch_size={PROMPTS * SAMPLES}",
        "actor.lr=1e-7",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.max_turns={args.max_turns}",
        f"rollout.max_response_tokens={args.max_turns * TURN_BUDGET}",
        f"rollout.kv_block_size={args.block_size}",
        "rollout.environment=tool",
        f"rollout.environment_workers={args.environment_workers}",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(ROOT / "recipes" / "grpo.py"),
        "--config",
        str(ROOT / "recipes" / "configs" / "grpo.yaml"),
        *overrides,
    ]
    finished = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if finished.returncode:
        raise SystemExit(finished.stdout[-4000:] + finished.stderr[-4000:])
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def _engine_ablation(model_dir: str, task: str, args) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoTokenizer

    from spmd_rlhf.data.dataset import read_rows
    from spmd_rlhf.engine import LLMEngine, SamplingParams
    from spmd_rlhf.envs import ChatDelta, ToolEnvironment
    from spmd_rlhf.envs.multi_turn import run_multi_turn
    from spmd_rlhf.models import load_model

    torch.set_num_threads(1)

    class TimedEngine(LLMEngine):
        seconds = 0.0

        def generate(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super().generate(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, head="lm", dtype=torch.float32)
    rows = read_rows(f"{task}/train.parquet")[:PROMPTS]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        for row in rows
    ]
    requests = [tokens for tokens in prompts for _ in range(SAMPLES)]
    samples = [row for row in rows for _ in range(SAMPLES)]
    results = {}
    for reuse in (True, False):
        best = None
        for _ in range(3):
            engine = TimedEngine(model, eos_token_id=tokenizer.eos_token_id, block_size=args.block_size)
            params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, seed=index) for index in range(len(requests))]
            trajectories, stats = run_multi_turn(
                engine,
                requests,
                [ToolEnvironment() for _ in requests],
                samples,
                params,
                delta=ChatDelta(tokenizer),
                max_turns=args.max_turns,
                max_response_tokens=args.max_turns * TURN_BUDGET,
                reuse_prefix=reuse,
            )
            seconds = engine.seconds
            if best is None or seconds < best["seconds"]:
                best = {
                    "seconds": seconds,
                    "trajectories": len(trajectories),
                    "turns": stats.turns,
                    "mean_turns": sum(t.num_turns for t in trajectories) / len(trajectories),
                    "generated_tokens": sum(sum(t.generated_mask) for t in trajectories),
                    "prefill_tokens": stats.prefill_tokens,
                    "cached_prefill_tokens": stats.cached_prefill_tokens,
                }
        results["reuse" if reuse else "fresh_cache_per_turn"] = best
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16, help="KV block size: only whole blocks are reused")
    parser.add_argument(
        "--environment-workers",
        type=int,
        default=16,
        help="rollout.environment_workers of the recipe part: environments answering a turn at once",
    )
    args = parser.parse_args()

    from spmd_rlhf.tiny.task import make_task
    from spmd_rlhf.tiny.warm_start import make_tool_products_policy

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        model = make_tool_products_policy(str(root / "model"))
        make_task(task="tool_products", out_dir=str(root / "task"), train_size=256, val_size=8)
        records = _recipe(root, model, str(root / "task"), args)[args.warmup :]
        ablation = _engine_ablation(model, str(root / "task"), args)
    rows = PROMPTS * SAMPLES
    generate = statistics.median(record["time/generate"] for record in records)
    cached = sum(record["rollout/cached_prefill_tokens"] for record in records)
    offered = cached + sum(record["rollout/prefill_tokens"] for record in records)
    reuse, fresh = ablation["reuse"], ablation["fresh_cache_per_turn"]
    result = {
        "recipe": {
            "nproc": args.nproc,
            "rows_per_step": rows,
            "median_generate_s": generate,
            "trajectories_per_s": rows / generate,
            "mean_turns": statistics.mean(record["rollout/turns/mean"] for record in records),
            "cached_share_of_prompt_tokens": cached / offered,
        },
        "engine_ablation": ablation,
        "prefill_saved_by_cross_turn_reuse": 1 - reuse["prefill_tokens"] / fresh["prefill_tokens"],
        "engine_time_ratio_reuse_over_fresh": reuse["seconds"] / fresh["seconds"],
    }
    result["block_size"] = args.block_size
    result["environment_workers"] = args.environment_workers
    suffix = "" if args.environment_workers == 16 else f"_workers{args.environment_workers}"
    out = ROOT / "benchmarks" / "results" / f"multiturn_cpu_block{args.block_size}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| measure | value |\n| --- | --- |")
    print(f"| GRPO on {args.nproc} CPU ranks: trajectories/s (generation stage) | {rows / generate:.1f} |")
    print(f"| mean turns per trajectory | {result['recipe']['mean_turns']:.2f} |")
    print(f"| prompt tokens whose prefill was skipped (recipe) | {cached / offered:.1%} |")
    print(
        "| prefill tokens, engine with cross-turn reuse / fresh cache per turn "
        f"| {reuse['prefill_tokens']} / {fresh['prefill_tokens']} |"
    )
    print(f"| prefill saved by cross-turn reuse | {result['prefill_saved_by_cross_turn_reuse']:.1%} |")
    print(f"| engine time, reuse / fresh (one process) | {result['engine_time_ratio_reuse_over_fresh']:.2f} |")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
