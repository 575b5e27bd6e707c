"""Generation speed of the spmd_rlhf engine against ``transformers`` ``generate``, same weights, same process.

    python benchmarks/engine_generate.py [--hidden 256] [--layers 4] [--batch 32] [--new-tokens 64] [--device cpu]

Builds the named tiny config (``make_tiny``: qwen2 family, random weights), generates greedily for the same batch of
prompts of mixed lengths with both, and prints tokens/s and the time ratio (ours / transformers: below 1 is faster; best of ``--repeats`` interleaved runs).
EOS is switched off in both so that every prompt gets exactly ``--new-tokens`` tokens. ``transformers`` runs the batch
left-padded with SDPA attention and its dynamic KV cache; the engine runs its paged cache sized for the whole batch (no
preemption). Also reported: how many responses are token-for-token equal (padding changes float rounding, so a
near-tie can flip a token in either implementation). Writes JSON next to the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import load_model
from spmd_rlhf.tiny.model import make_tiny


def mixed_prompts(
    batch: int, min_length: int, max_length: int, *, token_ids: tuple[int, int], pad_id: int, device: str, seed: int
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of ``min_length``..``max_length`` tokens drawn from ``[token_ids[0], token_ids[1])``:
    as lists (the engine's input) and left-padded with their attention mask (``transformers``' input)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (batch,), generator=generator).tolist()
    prompts = [torch.randint(*token_ids, (length,), generator=generator).tolist() for length in lengths]
    longest = max(lengths)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    return prompts, input_ids, attention_mask


def _best_times(runs: dict, *, repeats: int, device: str) -> tuple[dict[str, float], dict]:
    """Fastest of ``repeats`` timed calls of each run after one warm-up call, the runs interleaved so that a noisy
    neighbour on the machine slows both alike; and each run's last result."""
    results = {name: run() for name, run in runs.items()}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            results[name] = run()
            if device == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3", "mistral"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as path:
        make_tiny(family=args.family, out_dir=path, hidden_size=args.hidden, num_layers=args.layers, seed=0)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
        ours = load_model(path, head="lm", dtype=dtype, device=args.device, attention_backend="sdpa").eval()
    reference.generation_config.eos_token_id = None
    pad_id = reference.config.pad_token_id

    prompts, input_ids, attention_mask = mixed_prompts(
        args.batch, args.min_prompt, args.max_prompt, token_ids=(5, reference.config.vocab_size), pad_id=pad_id,
        device=args.device, seed=0,
    )
    engine = LLMEngine(ours, eos_token_id=None, block_size=args.block_size, max_num_seqs=args.batch,
                       max_num_batched_tokens=sum(map(len, prompts)))
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)

    def hf_generate() -> torch.Tensor:
        with torch.no_grad():
            return reference.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                      max_new_tokens=args.new_tokens, pad_token_id=pad_id)

    times, results = _best_times({"engine": lambda: engine.generate(prompts, params), "transformers": hf_generate},
                                 repeats=args.repeats, device=args.device)
    engine_s, hf_s, outputs = times["engine"], times["transformers"], results["engine"]
    hf_tokens = results["transformers"][:, input_ids.shape[1]:].tolist()
    assert all(len(tokens) == args.new_tokens for tokens in hf_tokens)
    assert all(len(out.generated_token_ids) == args.new_tokens for out in outputs)
    generated = args.batch * args.new_tokens
    equal = sum(out.generated_token_ids == tokens for out, tokens in zip(outputs, hf_tokens))

    result = {
        "family": args.family, "hidden": args.hidden, "layers": args.layers, "vocab": reference.config.vocab_size,
        "device": args.device, "dtype": args.dtype, "batch": args.batch, "prompt_lengths": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens, "block_size": args.block_size, "repeats": args.repeats,
        "torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
        "engine_s": engine_s, "transformers_s": hf_s, "ratio": engine_s / hf_s,
        "engine_tokens_per_s": generated / engine_s, "transformers_tokens_per_s": generated / hf_s,
        "equal_responses": equal, "engine_stats": vars(engine.stats),
    }
    print(f"{args.family} hidden {args.hidden} x {args.layers} layers, {args.device} {args.dtype}: batch {args.batch}, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new tokens, greedy")
    print(f"{'generator':<28} {'time (s)':>9} {'tokens/s':>9}")
    print(f"{'spmd_rlhf LLMEngine':<28} {engine_s:>9.2f} {generated / engine_s:>9.0f}")
    print(f"{'transformers generate':<28} {hf_s:>9.2f} {generated / hf_s:>9.0f}")
    print(f"ratio (ours / transformers time): {engine_s / hf_s:.2f}; equal responses: {equal}/{args.batch}")
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"engine_generate_{args.family}_h{args.hidden}_l{args.layers}_{args.device}_{args.dtype}.json")
    with open(out_file, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
