"""Generation on one GPU, Qwen2.5-1.5B-shaped random model, against two baselines measured in the same run:

    python benchmarks/gpu_generate.py [--shape 1.5b] [--measure decode batch] [--model-dir DIR] [--repeats 3]
    python benchmarks/gpu_generate.py --smoke      # tiny model, CPU-sized: checks the script in seconds

- G1, ``decode``: batch-1 greedy decode speed of ``LLMEngine`` against the HBM floor. One prompt of
  ``--decode-prompt`` tokens is generated to ``--decode-tokens`` new tokens and to 1 new token (prefill and the first
  sample); the difference of the two times is ``--decode-tokens - 1`` decode steps. The floor is what memory allows:
  each decode step reads every weight once (a tied embedding counts once: it is read whole as the LM head), so at most
  copy bandwidth / weight bytes steps per second, the bandwidth being that of a large device-to-device copy (bytes
  read + written per second) measured here. Reported: decode tokens/s of the default engine (CUDA-graph decode steps
  where they apply), floor tokens/s and their ratio (goal >= 0.5); and the same engine with eager decode steps
  (``decode_graphs="off"``), measured beside it, with the graphs' speed-up over it.
- G2, ``batch``: ``--batch`` prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--new-tokens`` new tokens each,
  greedy, EOS off in both: ``LLMEngine`` (paged cache sized for the whole batch, all prompts prefilled together)
  against ``transformers`` ``generate`` with ``cache_implementation="static"`` on the same weights (left-padded, SDPA;
  ``generate`` compiles the static-cache forward itself where it does so by default, and the warm-up call pays for
  that). Reported: both times and the speed-up transformers / engine (goal >= 10).

Times are the best of ``--repeats`` interleaved calls after a warm-up call of each. Writes
``benchmarks/results/gpu_generate_<shape>_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse

import torch
from engine_generate import _best_times, mixed_prompts
from gpu_common import (
    add_model_arguments,
    copy_bandwidth,
    default_device,
    default_dtype,
    environment,
    meets_goal,
    parameter_bytes,
    parse_with_smoke,
    profiled,
    shaped_model,
    synchronize,
    write_result,
)

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import load_model

DECODE_GOAL = 0.5
"""G1: batch-1 decode tokens/s at least this fraction of the HBM floor rate."""
BATCH_GOAL = 10.0
"""G2: the engine at least this many times faster than transformers' static-cache generate."""

# Three repeats and 16 decode tokens: on a busy machine one slow call must not make 16 tokens look faster than 1.
SMOKE = dict(
    shape="smoke",
    decode_prompt=8,
    decode_tokens=16,
    batch=4,
    new_tokens=6,
    min_prompt=3,
    max_prompt=8,
    repeats=3,
    copy_mib=16,
)


def measure_decode(model: torch.nn.Module, args: argparse.Namespace, *, real_run: bool) -> dict:
    """G1 (see the module docstring)."""
    vocab = model.args.vocab_size
    prompt = torch.randint(0, vocab, (args.decode_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {
        mode: LLMEngine(model, eos_token_id=None, block_size=args.block_size, max_num_seqs=1, decode_graphs=mode)
        for mode in ("auto", "off")
    }
    runs = {
        f"{mode}_{name}": (
            lambda engine=engine, tokens=tokens: engine.generate(
                [prompt], SamplingParams(temperature=0, max_new_tokens=tokens)
            )
        )
        for mode, engine in engines.items()
        for name, tokens in (("to_last_token", args.decode_tokens), ("to_first_token", 1))
    }
    times, outputs = _best_times(runs, repeats=args.repeats, device=args.device)
    assert outputs["auto_to_last_token"][0].generated_token_ids == outputs["off_to_last_token"][0].generated_token_ids
    decode_s = {mode: times[f"{mode}_to_last_token"] - times[f"{mode}_to_first_token"] for mode in engines}
    if min(decode_s.values()) <= 0:
        raise RuntimeError(
            f"{args.decode_tokens} new tokens took no longer than 1 ({times}); the machine is too noisy "
            "for this measurement, or --decode-tokens is too small: raise it or --repeats"
        )
    with profiled(args.profile):
        runs["auto_to_last_token"]()
        synchronize(args.device)
    tokens_per_s = (args.decode_tokens - 1) / decode_s["auto"]
    eager_tokens_per_s = (args.decode_tokens - 1) / decode_s["off"]
    bandwidth = copy_bandwidth(args.device, nbytes=args.copy_mib * 2**20)
    weight_bytes = parameter_bytes(model)
    floor_tokens_per_s = bandwidth / weight_bytes
    ratio = tokens_per_s / floor_tokens_per_s
    return {
        "prompt_tokens": args.decode_prompt,
        "new_tokens": args.decode_tokens,
        "seconds": times,
        "decode_tokens_per_s": tokens_per_s,
        "ms_per_token": 1e3 / tokens_per_s,
        "cuda_graphs": engines["auto"].stats.cuda_graphs,
        "eager_tokens_per_s": eager_tokens_per_s,
        "graphs_speedup": tokens_per_s / eager_tokens_per_s,
        "copy_bytes_per_s": bandwidth,
        "copy_mib": args.copy_mib,
        "weight_bytes": weight_bytes,
        "floor_tokens_per_s": floor_tokens_per_s,
        "ratio_to_floor": ratio,
        "goal": f"ratio_to_floor >= {DECODE_GOAL}",
        "meets_goal": meets_goal(ratio, DECODE_GOAL, at_least=True, real_run=real_run),
    }


def measure_batch(
    model: torch.nn.Module, model_dir: str, dtype: torch.dtype, args: argparse.Namespace, *, real_run: bool
) -> dict:
    """G2 (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    reference = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    )
    reference.generation_config.eos_token_id = None
    pad_id = reference.config.pad_token_id
    prompts, input_ids, attention_mask = mixed_prompts(
        args.batch,
        args.min_prompt,
        args.max_prompt,
        token_ids=(0, model.args.vocab_size),
        pad_id=pad_id,
        device=args.device,
        seed=1,
    )
    engine = LLMEngine(
        model,
        eos_token_id=None,
        block_size=args.block_size,
        max_num_seqs=args.batch,
        max_num_batched_tokens=sum(map(len, prompts)),
    )
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)

    def hf_generate() -> torch.Tensor:
        with torch.no_grad():
            return reference.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                pad_token_id=pad_id,
                max_new_tokens=args.new_tokens,
                cache_implementation="static",
            )

    times, outputs = _best_times(
        {"engine": lambda: engine.generate(prompts, params), "transformers": hf_generate},
        repeats=args.repeats,
        device=args.device,
    )
    assert all(len(out.generated_token_ids) == args.new_tokens for out in outputs["engine"])
    assert outputs["transformers"].shape == (args.batch, input_ids.shape[1] + args.new_tokens)
    generated = args.batch * args.new_tokens
    speedup = times["transformers"] / times["engine"]
    return {
        "batch": args.batch,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens,
        "engine_s": times["engine"],
        "transformers_s": times["transformers"],
        "engine_tokens_per_s": generated / times["engine"],
        "transformers_tokens_per_s": generated / times["transformers"],
        "speedup": speedup,
        "baseline": "transformers generate, cache_implementation=static, sdpa, left-padded",
        "goal": f"speedup >= {BATCH_GOAL}",
        "meets_goal": meets_goal(speedup, BATCH_GOAL, at_least=True, real_run=real_run),
        "engine_stats": vars(engine.stats),
        "block_size": engine.block_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, default_shape="1.5b")
    parser.add_argument("--measure", nargs="+", default=["decode", "batch"], choices=["decode", "batch"])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument(
        "--block-size", type=int, help="KV block size; default: the engine's (256 under flash-attn, else 16)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile", help="write a profile of one more batch-1 decode run (G1, default engine) to this file"
    )
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's copy")
    parser.add_argument("--out", default="benchmarks/results")
    args = parse_with_smoke(parser, SMOKE)
    args.dtype = args.dtype or default_dtype(args.device)
    dtype = getattr(torch, args.dtype)
    real_run = torch.device(args.device).type == "cuda" and not args.smoke

    result = {
        "benchmark": "gpu_generate",
        "smoke": args.smoke,
        "shape": args.shape,
        "dtype": args.dtype,
        "environment": environment(args.device),
    }
    with shaped_model(args.shape, args.model_dir) as model_dir:
        model = load_model(model_dir, head="lm", dtype=dtype, device=args.device).eval()
        result["parameters"] = sum(p.numel() for p in model.parameters())
        if "decode" in args.measure:
            result["decode"] = measure_decode(model, args, real_run=real_run)
        if "batch" in args.measure:
            result["batch"] = measure_batch(model, model_dir, dtype, args, real_run=real_run)

    print(
        f"qwen2 {args.shape} ({result['parameters'] / 1e9:.2f}B parameters), {result['environment']['device_name']}, "
        f"{args.dtype}{', SMOKE RUN: not a GPU figure' if args.smoke else ''}"
    )
    print("| measure | ours | baseline | ratio | goal |\n| --- | --- | --- | --- | --- |")
    if "decode" in result:
        row = result["decode"]
        print(
            f"| G1 batch-1 decode, tokens/s | {row['decode_tokens_per_s']:.1f} "
            f"| HBM floor {row['floor_tokens_per_s']:.1f} ({row['copy_bytes_per_s'] / 1e9:.0f} GB/s "
            f"/ {row['weight_bytes'] / 1e9:.2f} GB) | {row['ratio_to_floor']:.2f} | >= {DECODE_GOAL} |"
        )
        print(
            f"| G1 with eager decode steps, tokens/s | {row['eager_tokens_per_s']:.1f} | CUDA graphs "
            f"({row['cuda_graphs']} captured) {row['decode_tokens_per_s']:.1f} "
            f"| graphs {row['graphs_speedup']:.2f}x | |"
        )
    if "batch" in result:
        row = result["batch"]
        print(
            f"| G2 batch {row['batch']} x {row['new_tokens']} tokens, s | {row['engine_s']:.2f} | transformers static "
            f"cache {row['transformers_s']:.2f} | {row['speedup']:.2f}x faster | >= {BATCH_GOAL}x |"
        )
    write_result(args.out, f"gpu_generate_{args.shape}_{result['environment']['device']}", result)


if __name__ == "__main__":
    main()
