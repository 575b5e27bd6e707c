"""Generation speed of the spmd_rlhf engine against ``transformers`` ``generate``, same weights, same process.

    python benchmarks/engine_generate.py [--hidden 256] [--layers 4] [--prompts 8] [--n 1 4 8] [--new-tokens 64]
    python benchmarks/engine_generate.py --shape 0.5b --prompts 4 --n 1 4 --new-tokens 32 --repeats 1

Builds the model (``make_tiny``: qwen2 family, random weights; ``--shape`` takes a real shape from
``gpu_common.SHAPES``) and generates for ``--prompts`` prompts of mixed lengths, with each generator, in these cases:

- ``greedy``: n = 1, greedy, EOS off, every response exactly ``--new-tokens`` long; the responses are also compared
  token for token (padding changes float rounding, so a near-tie can flip a token in either implementation);
- ``sampled n=N`` for each ``--n``: N samples per prompt at temperature 1, stopped by any of a fixed random set of
  ``--stop-fraction`` of the vocabulary (both generators stop on the same ids), so responses end at varied lengths
  (about 1 / stop-fraction tokens on average) as EOS-terminated ones do. ``transformers`` gets
  ``num_return_sequences=N``.

Each case reports the best of ``--repeats`` interleaved timed calls (after a warm-up), the generated tokens, and
prefill and decode throughput apart: the engine's steps are timed by kind (prefill steps give prefill tokens/s,
decode steps generated tokens/s) together with the time inside the model's forward, whose share of a decode step
is the floor that bounds the engine loop (scheduling, input building and sampling are the rest; a decode step
replayed from a CUDA graph runs no eager model call, so its share is not measured); ``transformers``'
prefill is a call with one new token, its decode the rest of the full call. ``transformers`` runs the batch
left-padded with SDPA attention and its dynamic KV cache, keeping finished rows in the batch until all end; the
engine runs its paged cache sized for the whole batch (no preemption), prefills a prompt once for its N samples and
drops finished rows. Writes JSON next to the printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections import defaultdict

import torch
from gpu_common import SHAPES, shape_fields

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


class StepClock:
    """Wall time of the engine's prefill and decode steps, their draw included, and of the model inside them (the
    decoder's ``hidden_states`` and the LM head, where they run eagerly), by wrapping the runner's ``sample_step`` and
    those two calls (CPU: synchronous, so host time is compute time; CUDA: each timed call synchronizes)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        runner, model = engine.runner, engine.runner.model
        sample_step, hidden_states, lm_head = runner.sample_step, model.hidden_states, model.lm_head.forward
        cuda = runner.device.type == "cuda"

        def timed(key: str, function, *args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            self.seconds[key] += time.perf_counter() - start
            return result

        def run_step(seqs, *, is_prefill, **sampling):
            self._kind = "prefill" if is_prefill else "decode"
            return timed(self._kind, sample_step, seqs, is_prefill=is_prefill, **sampling)

        runner.sample_step = run_step
        model.hidden_states = lambda *args, **kwargs: timed(f"{self._kind}_model", hidden_states, *args, **kwargs)
        model.lm_head.forward = lambda *args, **kwargs: timed(f"{self._kind}_model", lm_head, *args, **kwargs)

    def reset(self) -> None:
        self.seconds.clear()


def _best_times(runs: dict, *, repeats: int, device: str, warmups: dict | None = None) -> tuple[dict[str, float], dict]:
    """Fastest of ``repeats`` timed calls of each run after one warm-up call (``warmups[name]`` where given: a shorter
    call for a run with nothing to compile or capture), the runs interleaved so that a noisy neighbour on the machine
    slows both alike; and each run's result of its fastest call."""
    results = {name: (warmups or {}).get(name, run)() for name, run in runs.items()}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = run()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if seconds < best[name]:
                best[name], results[name] = seconds, result
    return best, results


def run_case(
    *,
    name: str,
    engine: LLMEngine,
    clock: StepClock,
    reference,
    prompts,
    input_ids,
    attention_mask,
    n: int,
    greedy: bool,
    new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    repeats: int,
    device: str,
) -> dict:
    params = SamplingParams(
        temperature=0.0 if greedy else 1.0,
        max_new_tokens=new_tokens,
        stop_token_ids=tuple(stop_ids),
        seed=None,
    )
    requests = [prompt for prompt in prompts for _ in range(n)]
    hf_options = dict(
        attention_mask=attention_mask,
        pad_token_id=pad_id,
        do_sample=not greedy,
        num_return_sequences=n,
        eos_token_id=stop_ids or None,
    )
    if not greedy:
        hf_options.update(temperature=1.0, top_k=0, top_p=1.0)

    def engine_generate():
        clock.reset()
        outputs = engine.generate(requests, params)
        return outputs, dict(clock.seconds), vars(engine.stats).copy()

    def hf_generate(max_new_tokens: int):
        with torch.no_grad():
            return reference.generate(input_ids, max_new_tokens=max_new_tokens, **hf_options)

    times, results = _best_times(
        {
            "engine": engine_generate,
            "transformers": lambda: hf_generate(new_tokens),
            "transformers_prefill": lambda: hf_generate(1),
        },
        repeats=repeats,
        device=device,
    )
    outputs, seconds, stats = results["engine"]
    engine_tokens = sum(len(out.generated_token_ids) for out in outputs)
    hf_rows = results["transformers"][:, input_ids.shape[1] :]
    # A row's response ends at its first stop id (kept, like the engine's) or runs to the limit; the rest is padding.
    hf_lengths = []
    for row in hf_rows.tolist():
        ends = [index for index, token in enumerate(row) if token in set(stop_ids)]
        hf_lengths.append(ends[0] + 1 if ends else len(row))
    hf_tokens = sum(hf_lengths)
    hf_decode_s = max(times["transformers"] - times["transformers_prefill"], 1e-9)
    case = {
        "case": name,
        "n": n,
        "greedy": greedy,
        "rows": len(requests),
        "engine_s": times["engine"],
        "transformers_s": times["transformers"],
        "engine_tokens": engine_tokens,
        "transformers_tokens": hf_tokens,
        "engine_tokens_per_s": engine_tokens / times["engine"],
        "transformers_tokens_per_s": hf_tokens / times["transformers"],
        "speedup": (engine_tokens / times["engine"]) / (hf_tokens / times["transformers"]),
        # Prompt tokens served per second: a prompt prefilled once for its n samples counts n times.
        "engine_prefill_tokens_per_s": int(attention_mask.sum()) * n / max(seconds.get("prefill", 0.0), 1e-9),
        "transformers_prefill_tokens_per_s": int(attention_mask.sum()) * n / times["transformers_prefill"],
        "engine_decode_tokens_per_s": (engine_tokens - len(requests)) / max(seconds.get("decode", 0.0), 1e-9),
        "transformers_decode_tokens_per_s": (hf_tokens - len(requests)) / hf_decode_s,
        "engine_model_share_of_decode": seconds.get("decode_model", 0.0) / max(seconds.get("decode", 0.0), 1e-9),
        "engine_step_seconds": seconds,
        "engine_stats": stats,
    }
    if greedy:
        case["equal_responses"] = sum(out.generated_token_ids == row for out, row in zip(outputs, hf_rows.tolist()))
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3", "mistral"])
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a real shape (overrides --hidden)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4, or the shape's own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 8], help="samples per prompt of the sampled cases")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stop-fraction", type=float, default=0.03, help="share of the vocabulary that ends a sample")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.shape:
        fields = shape_fields(args.shape, layers=args.layers)
        fields.pop("family")
        args.family = SHAPES[args.shape].get("family", args.family)  # a mixture-of-experts shape names its own
        label = f"{args.shape}_l{fields['num_layers']}"
    else:
        fields = dict(hidden_size=args.hidden, num_layers=args.layers or 4)
        label = f"h{args.hidden}_l{fields['num_layers']}"
    with tempfile.TemporaryDirectory() as path:
        make_tiny(family=args.family, out_dir=path, seed=0, **fields)
        reference = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
        )
        ours = load_model(path, head="lm", dtype=dtype, device=args.device, attention_backend="sdpa").eval()
    reference.generation_config.eos_token_id = None
    pad_id = reference.config.pad_token_id
    vocab = reference.config.vocab_size
    prompts, input_ids, attention_mask = mixed_prompts(
        args.prompts,
        args.min_prompt,
        args.max_prompt,
        token_ids=(5, min(vocab, 5000)),
        pad_id=pad_id,
        device=args.device,
        seed=0,
    )
    generator = torch.Generator().manual_seed(1)
    stop_ids = sorted(
        torch.randperm(vocab - 5, generator=generator)[: max(1, int(args.stop_fraction * vocab))].add(5).tolist()
    )
    rows = args.prompts * max(args.n)
    engine = LLMEngine(
        ours,
        eos_token_id=None,
        block_size=args.block_size,
        max_num_seqs=rows,
        max_num_batched_tokens=sum(map(len, prompts)) * max(args.n),
    )
    clock = StepClock(engine)
    common = dict(
        engine=engine,
        clock=clock,
        reference=reference,
        prompts=prompts,
        input_ids=input_ids,
        attention_mask=attention_mask,
        new_tokens=args.new_tokens,
        pad_id=pad_id,
        repeats=args.repeats,
        device=args.device,
    )
    cases = [run_case(name="greedy", n=1, greedy=True, stop_ids=[], **common)]
    cases += [run_case(name=f"sampled n={n}", n=n, greedy=False, stop_ids=stop_ids, **common) for n in args.n]

    result = {
        "family": args.family,
        "model": label,
        "model_fields": fields,
        "vocab": vocab,
        "device": args.device,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens,
        "stop_ids": len(stop_ids),
        "block_size": args.block_size,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cases": cases,
    }
    print(
        f"{args.family} {label}, {args.device} {args.dtype}: {args.prompts} prompts of {args.min_prompt}-"
        f"{args.max_prompt} tokens, up to {args.new_tokens} new tokens; {len(stop_ids)} stop ids in sampled cases"
    )
    print(
        "| case | rows | tokens ours / HF | tokens/s ours | tokens/s HF | speedup | prefill tok/s ours / HF "
        "| decode tok/s ours / HF | model share of decode |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case in cases:
        print(
            f"| {case['case']} | {case['rows']} | {case['engine_tokens']} / {case['transformers_tokens']} "
            f"| {case['engine_tokens_per_s']:.0f} | {case['transformers_tokens_per_s']:.0f} | {case['speedup']:.2f}x "
            f"| {case['engine_prefill_tokens_per_s']:.0f} / {case['transformers_prefill_tokens_per_s']:.0f} "
            f"| {case['engine_decode_tokens_per_s']:.0f} / {case['transformers_decode_tokens_per_s']:.0f} "
            f"| {case['engine_model_share_of_decode']:.0%} |"
        )
    print(f"greedy responses equal to transformers': {cases[0]['equal_responses']}/{args.prompts}")
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"engine_generate_{args.family}_{label}_{args.device}_{args.dtype}.json")
    with open(out_file, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
