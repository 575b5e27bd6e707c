"""Packed against padded micro-batches on a real rollout batch: tokens fed, logit rows computed, micro-batch counts,
and the CPU time of one log-prob pass over the batch.

    python benchmarks/packing.py [--config recipes/configs/grpo.yaml] [--repeats 3] [--truncate-responses]
                                 [key=value ...]

Generates the first step's rollouts of ``--config`` (the tiny arithmetic task by default, built on first use) with
the built-in engine on one process, in the rollout layout the workers receive (prompts left-padded to the batch's
longest, responses right-padded to ``rollout.max_new_tokens``). Then one log-prob pass over all rows, three ways:
padded rows in micro-batches of ``actor.micro_batch_size`` (the layout before packing, logits at every position),
the same row-count micro-batches packed, and token-balanced packed micro-batches under a budget of the longest row
times ``actor.micro_batch_size``. Ratios are padded / packed. Writes ``benchmarks/results/packing_<config
name>[_truncated].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.data.dataset import PromptDataset, PromptLoader
from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import DecoderLM, load_model, log_probs_from_logits
from spmd_rlhf.tiny import ensure_tiny_assets
from spmd_rlhf.training.micro_batches import row_chunks, token_balanced_micro_batches
from spmd_rlhf.training.packing import MicroBatch, PackedRows, PaddedRows


def rollout_batch(config, model: DecoderLM, tokenizer, *, truncate: bool) -> Batch:
    """The first step's prompts, ``rollout.n`` sampled responses each, in the rollout layout; ``truncate``: each
    response cut at a length drawn uniformly from 1 to its own, as if the policy had stopped there."""
    dataset = PromptDataset(
        config.data.train_files,
        tokenizer,
        prompt_key=config.data.prompt_key,
        max_prompt_length=config.data.max_prompt_length,
        overlong_prompts=config.data.overlong_prompts,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = PromptLoader(dataset, batch_size=config.data.batch_size, pad_token_id=pad, seed=config.data.seed).batch(0)
    rollout, n = config.rollout, config.rollout.n
    repeated = prompts.repeat(n)
    requests = [ids[mask.bool()].tolist() for ids, mask in zip(repeated["input_ids"], repeated["attention_mask"])]
    params = [
        SamplingParams(temperature=rollout.temperature, max_new_tokens=rollout.max_new_tokens, seed=row)
        for row in range(len(requests))
    ]
    outputs = LLMEngine(model, eos_token_id=tokenizer.eos_token_id, seed=config.trainer.seed).generate(requests, params)
    responses = torch.full((len(requests), rollout.max_new_tokens), pad, dtype=torch.long)
    response_mask = torch.zeros_like(responses)
    generator = torch.Generator().manual_seed(config.trainer.seed)
    for row, output in enumerate(outputs):
        length = len(output.generated_token_ids)
        if truncate:
            length = int(torch.randint(1, length + 1, (), generator=generator))
        responses[row, :length] = torch.tensor(output.generated_token_ids[:length])
        response_mask[row, :length] = 1
    return Batch(
        {
            "prompts": repeated["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([repeated["input_ids"], responses], dim=1),
            "attention_mask": torch.cat([repeated["attention_mask"], response_mask], dim=1),
        }
    )


def log_prob_pass(model: DecoderLM, micro_batches: list[MicroBatch]) -> float:
    """Seconds of one no-grad log-prob pass over ``micro_batches`` (the workers' path, without the DP plumbing)."""
    started = time.perf_counter()
    with torch.no_grad():
        for micro in micro_batches:
            logits = model(**micro.model_inputs(torch.device("cpu"), per_token=True))
            micro.scatter(
                log_probs_from_logits(micro.response_outputs(logits), micro.response_labels(torch.device("cpu")))
            )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipes/configs/grpo.yaml")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per layout; the fastest counts")
    parser.add_argument(
        "--truncate-responses",
        action="store_true",
        help="cut each response at a uniform random length (a random-init model never stops on its own)",
    )
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    options = parser.parse_args()
    config = load_config(options.config, options.overrides)
    ensure_tiny_assets(config)
    torch.manual_seed(config.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
    model = load_model(
        config.model.path, dtype=getattr(torch, config.model.dtype), attention_backend=config.model.attention
    )
    batch = rollout_batch(config, model, tokenizer, truncate=options.truncate_responses)

    rows, width = batch["input_ids"].shape
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    rows_per_micro_batch = config.actor.micro_batch_size
    budget = max(lengths) * rows_per_micro_batch
    groups = {
        "padded": row_chunks(rows, rows_per_micro_batch),
        "packed_rows": row_chunks(rows, rows_per_micro_batch),
        "packed_tokens": token_balanced_micro_batches(lengths, budget, agree=lambda count: count),
    }
    layouts = {
        name: [(PaddedRows if name == "padded" else PackedRows)(batch.select(group)) for group in chunks]
        for name, chunks in groups.items()
    }
    log_prob_pass(model, layouts["packed_rows"])  # warm-up
    seconds = {
        name: min(log_prob_pass(model, micro) for _ in range(options.repeats)) for name, micro in layouts.items()
    }
    response_tokens = int(batch["response_mask"].sum())
    results = {
        "config": options.config,
        "overrides": options.overrides,
        "truncated": options.truncate_responses,
        "rows": rows,
        "width": width,
        "prompt_width": batch["prompts"].shape[1],
        "max_new_tokens": config.rollout.max_new_tokens,
        "tokens_fed": {"padded": rows * width, "packed": sum(lengths)},
        "logit_rows": {"padded": rows * width, "packed": response_tokens},
        "micro_batches": {name: len(chunks) for name, chunks in groups.items()},
        "token_budget": budget,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    print(
        f"rollout batch: {rows} rows x {width} columns (prompts {results['prompt_width']}, responses "
        f"{results['max_new_tokens']}); vocabulary {model.args.vocab_size}\n"
    )
    print("| quantity | padded | packed | padded / packed |\n| --- | ---: | ---: | ---: |")
    for key in ("tokens_fed", "logit_rows"):
        padded, packed = results[key]["padded"], results[key]["packed"]
        print(f"| {key.replace('_', ' ')} | {padded} | {packed} | {padded / packed:.2f} |")
    for name in ("packed_rows", "packed_tokens"):
        label = f"log-prob pass, s ({name.replace('_', ' by ')}, {len(groups[name])} micro-batches)"
        print(f"| {label} | {seconds['padded']:.3f} | {seconds[name]:.3f} | {seconds['padded'] / seconds[name]:.2f} |")
    name = Path(options.config).stem + ("_truncated" if options.truncate_responses else "")
    out = Path(__file__).parent / "results" / f"packing_{name}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
