"""Generation on one GPU, Qwen2.5-1.5B-shaped random model, against two baselines measured in the same run:

    python benchmarks/gpu_generate.py [--shape 1.5b] [--measure decode batch] [--model-dir DIR] [--repeats 3]
    python benchmarks/gpu_generate.py --smoke      # tiny model, CPU-sized: checks the script in seconds

- G1, ``decode``: greedy decode speed of ``LLMEngine`` against the HBM floor at each of ``--decode-batches`` (1 and
  64). ``batch`` prompts of ``--decode-prompt`` tokens are generated to ``--decode-tokens`` new tokens and to 1 new
  token (prefill and the first sample); the difference of the two times is ``--decode-tokens - 1`` decode steps. The
  floor is what memory allows: each decode step reads every weight once (a tied embedding counts once: it is read
  whole as the LM head) and every row's KV cache (at its mean length over the run), at the bandwidth of a large
  device-to-device copy (bytes read + written per second) measured here. Reported per batch: decode tokens/s of the
  default engine (CUDA-graph decode steps where they apply), floor tokens/s and their ratio (goal >= 0.5 at batch 1);
  and the same engine with eager decode steps (``decode_graphs="off"``) measured beside it, the graphs' speed-up over
  it, and where the two token streams first differ (``graph_eager_first_mismatch``: a field, never an abort).
- G2, ``batch``: ``--batch`` prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--new-tokens`` new tokens each,
  greedy, EOS off in all: ``LLMEngine`` (paged cache sized for the whole batch, all prompts prefilled together)
  against ``transformers`` ``generate`` on the same weights (left-padded, SDPA) with each of ``--baselines``
  (``BASELINES``): ``dynamic``, its default cache, which is what TRL's ``GRPOTrainer`` without vLLM generates with
  (the goal, >= 10x, is against this one); ``static``, ``cache_implementation="static"``, which ``generate`` compiles
  itself (Inductor with CUDA graphs on CUDA; the warm-up call pays for a compile of minutes), the best ``transformers``
  does. Reported: each time and the speed-up baseline / engine.

Times are the best of ``--repeats`` interleaved calls after a warm-up call of each (the dynamic cache's of 8 tokens).
Writes ``benchmarks/results/gpu_generate_<shape>_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

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
from spmd_rlhf.engine.decode_matmul import DEFAULT_TILINGS
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig
from spmd_rlhf.models import load_model
from spmd_rlhf.models.merged_linear import merge_projections

DECODE_GOAL = 0.5
"""G1: batch-1 decode tokens/s at least this fraction of the HBM floor rate."""
BATCH_GOAL = 10.0
"""G2: the engine at least this many times faster than transformers' dynamic-cache generate."""

# Three repeats and 16 decode tokens: on a busy machine one slow call must not make 16 tokens look faster than 1.
SMOKE = dict(
    shape="smoke",
    decode_prompt=8,
    decode_tokens=16,
    decode_batches=[1, 3],
    batch=4,
    new_tokens=6,
    min_prompt=3,
    max_prompt=8,
    repeats=3,
    copy_mib=16,
)


def _swept_tiling(given: str | None, pattern: str, pick, make, default):
    """``(tiling, where it came from)`` for a ``--*-config`` flag: None (``default``), a JSON object of the tiling's
    fields (``make``), or a sweep's result, a file or the folder it was written to (a suite step's), whose tiling
    ``pick`` chooses; a path without one gives ``default``, said so."""
    if given is None:
        return default, "the defaults"
    if given.lstrip().startswith("{"):
        return make(json.loads(given)), "the command line"
    path = Path(given)
    found = sorted(path.glob(pattern)) if path.is_dir() else [path] if path.exists() else []
    if not found:
        return default, f"the defaults: no {pattern} at {path}"
    chosen = pick(json.loads(found[0].read_text()))
    if chosen is None:
        return default, f"the defaults: {found[0]} has no tiling that ran"
    return make(chosen), f"the best of {found[0]}"


def skinny_tiling(given: str | None, shape: str) -> tuple[SkinnyConfig | dict[str, SkinnyConfig], str]:
    """``--skinny-config``: the skinny-linear kernels' tilings, from a ``gpu_skinny_sweep.py`` result each
    projection's fastest for ``shape`` (else for its first shape), taking as many rows as ``DEFAULT_TILINGS``; a JSON
    object of ``SkinnyConfig`` fields is one tiling for every projection."""

    def pick(result: dict) -> dict | None:
        shapes = result["shapes"]
        projections = (shapes.get(shape) or next(iter(shapes.values())))["projections"]
        fastest = {
            name: min((key for key in timings if key.isdigit()), key=lambda key: timings[key]["us"])
            for name, timings in projections.items()
        }
        return {name: result["configs"][int(key)] for name, key in fastest.items()}

    def make(fields: dict) -> SkinnyConfig | dict[str, SkinnyConfig]:
        if fields.keys() == DEFAULT_TILINGS.keys():
            return {
                name: SkinnyConfig(**{**each, "max_rows": DEFAULT_TILINGS[name].max_rows})
                for name, each in fields.items()
            }
        return SkinnyConfig(**fields)

    return _swept_tiling(given, "gpu_skinny_sweep_*.json", pick, make, DEFAULT_TILINGS)


def with_dependent_launch(
    decode: SkinnyConfig | dict[str, SkinnyConfig], attention: PagedConfig
) -> tuple[SkinnyConfig | dict[str, SkinnyConfig], PagedConfig]:
    """``--dependent-launch``: every tiling as given, with programmatic dependent launch on."""
    on = {"dependent_launch": True}
    if isinstance(decode, SkinnyConfig):
        return replace(decode, **on), replace(attention, **on)
    return {name: replace(tiling, **on) for name, tiling in decode.items()}, replace(attention, **on)


def tiling_fields(tiling: SkinnyConfig | dict[str, SkinnyConfig]) -> dict:
    """``--skinny-config``'s tilings as the result JSON records them."""
    return asdict(tiling) if isinstance(tiling, SkinnyConfig) else {name: asdict(t) for name, t in tiling.items()}


def paged_tiling(given: str | None) -> tuple[PagedConfig, str]:
    """``--paged-config``: the paged decode kernel's tiling, from a ``gpu_paged_sweep.py`` result its best at batch 1
    (256 tokens: G1's regime)."""
    return _swept_tiling(
        given,
        "gpu_paged_sweep_*.json",
        lambda result: result["regimes"]["batch1_256"]["best_config"],
        lambda fields: PagedConfig(**fields),
        DEFAULT_PAGED_CONFIG,
    )


def first_mismatch(graphed: list[list[int]], eager: list[list[int]]) -> dict | None:
    """Where two runs' token streams first differ (the row, and the position within it), None where they agree: a
    field of the result, never an abort, since one bf16 rounding difference must not lose the speed figure."""
    for row, (left, right) in enumerate(zip(graphed, eager, strict=True)):
        if left != right:
            position = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
            return {"row": row, "position": position}
    return None


def decode_floor(model: torch.nn.Module, *, batch: int, prompt: int, new_tokens: int, bandwidth: float) -> dict:
    """What memory allows a decode step of ``batch`` rows: it reads every weight once and each row's KV cache
    (``prompt`` + the tokens so far, on average half of ``new_tokens``) at the copy ``bandwidth``."""
    args = model.args
    weight_bytes = parameter_bytes(model)
    element = model.model.embed_tokens.weight.element_size()
    kv_bytes_per_token = args.num_layers * 2 * args.num_kv_heads * args.head_dim * element
    kv_bytes = batch * (prompt + new_tokens / 2) * kv_bytes_per_token
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_per_step": kv_bytes,
        "floor_tokens_per_s": batch * bandwidth / (weight_bytes + kv_bytes),
    }


def measure_decode(model: torch.nn.Module, args: argparse.Namespace, *, batch: int, real_run: bool) -> dict:
    """G1 at ``batch`` rows (see the module docstring)."""
    vocab = model.args.vocab_size
    generator = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (args.decode_prompt,), generator=generator).tolist() for _ in range(batch)]
    engines = {
        mode: LLMEngine(
            model,
            eos_token_id=None,
            block_size=args.block_size,
            max_num_seqs=batch,
            max_num_batched_tokens=batch * args.decode_prompt,
            decode_graphs=mode,
            compile_layers=args.compile_layers,
            decode_matmul=args.decode_matmul,
            decode_tiling=args.decode_tiling,
            attention_tiling=args.attention_tiling,
        )
        for mode in ("auto", "off")
    }
    runs = {
        f"{mode}_{name}": (
            lambda engine=engine, tokens=tokens: engine.generate(
                prompts, SamplingParams(temperature=0, max_new_tokens=tokens)
            )
        )
        for mode, engine in engines.items()
        for name, tokens in (("to_last_token", args.decode_tokens), ("to_first_token", 1))
    }
    times, outputs = _best_times(runs, repeats=args.repeats, device=args.device)
    mismatch = first_mismatch(
        [out.generated_token_ids for out in outputs["auto_to_last_token"]],
        [out.generated_token_ids for out in outputs["off_to_last_token"]],
    )
    decode_s = {mode: times[f"{mode}_to_last_token"] - times[f"{mode}_to_first_token"] for mode in engines}
    if min(decode_s.values()) <= 0:
        raise RuntimeError(
            f"{args.decode_tokens} new tokens took no longer than 1 ({times}); the machine is too noisy "
            "for this measurement, or --decode-tokens is too small: raise it or --repeats"
        )
    if args.profile:
        path = Path(args.profile)
        with profiled(str(path if batch == 1 else path.with_name(f"{path.stem}_batch{batch}{path.suffix}"))):
            runs["auto_to_last_token"]()
            synchronize(args.device)
    tokens_per_s = batch * (args.decode_tokens - 1) / decode_s["auto"]
    eager_tokens_per_s = batch * (args.decode_tokens - 1) / decode_s["off"]
    bandwidth = copy_bandwidth(args.device, nbytes=args.copy_mib * 2**20)
    floor = decode_floor(
        model, batch=batch, prompt=args.decode_prompt, new_tokens=args.decode_tokens, bandwidth=bandwidth
    )
    ratio = tokens_per_s / floor["floor_tokens_per_s"]
    cuda_graphs = engines["auto"].stats.cuda_graphs
    del engines, runs, outputs
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "batch": batch,
        "prompt_tokens": args.decode_prompt,
        "new_tokens": args.decode_tokens,
        "seconds": times,
        "decode_tokens_per_s": tokens_per_s,
        "ms_per_step": 1e3 * batch / tokens_per_s,
        "cuda_graphs": cuda_graphs,
        "eager_tokens_per_s": eager_tokens_per_s,
        "graphs_speedup": tokens_per_s / eager_tokens_per_s,
        "graph_eager_first_mismatch": mismatch,
        "copy_bytes_per_s": bandwidth,
        "copy_mib": args.copy_mib,
        **floor,
        "ratio_to_floor": ratio,
        "goal": f"ratio_to_floor >= {DECODE_GOAL}",
        "meets_goal": meets_goal(ratio, DECODE_GOAL, at_least=True, real_run=real_run),
    }


BASELINES = {
    "dynamic": "transformers generate, dynamic cache (its default), eager, sdpa, left-padded",
    "static": "transformers generate, cache_implementation=static (compiled by generate itself), sdpa, left-padded",
}
"""G2's baselines: ``dynamic`` is what a user has without this project (TRL's GRPOTrainer without vLLM generates so);
``static`` is the best ``transformers`` does, its compile (Inductor with CUDA graphs on CUDA) paid in the warm-up."""


def measure_batch(
    model: torch.nn.Module, model_dir: str, dtype: torch.dtype, args: argparse.Namespace, *, real_run: bool
) -> dict:
    """G2 (see the module docstring): the engine against each of ``args.baselines``, all interleaved."""
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
        compile_layers=args.compile_layers,
        decode_matmul=args.decode_matmul,
        decode_tiling=args.decode_tiling,
        attention_tiling=args.attention_tiling,
    )
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)

    def hf_generate(cache: str, new_tokens: int = args.new_tokens):
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        with torch.no_grad():
            return reference.generate(
                input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                pad_token_id=pad_id,
                max_new_tokens=new_tokens,
                **extra,
            )

    runs = {"engine": lambda: engine.generate(prompts, params)}
    runs.update({cache: lambda cache=cache: hf_generate(cache) for cache in args.baselines})
    # The dynamic cache's eager modules compile and capture nothing: a few tokens warm them up (a whole call was 20 s
    # of an H200's suite budget); the engine's warm-up captures its graphs and the static cache's compiles.
    warmups = {"dynamic": lambda: hf_generate("dynamic", new_tokens=min(8, args.new_tokens))}
    times, outputs = _best_times(runs, repeats=args.repeats, device=args.device, warmups=warmups)
    assert all(len(out.generated_token_ids) == args.new_tokens for out in outputs["engine"])
    generated = args.batch * args.new_tokens
    result = {
        "batch": args.batch,
        "prompt_lengths": [args.min_prompt, args.max_prompt],
        "new_tokens": args.new_tokens,
        "engine_s": times["engine"],
        "engine_tokens_per_s": generated / times["engine"],
        "engine_stats": vars(engine.stats),
        "block_size": engine.block_size,
        "goal": f"speedup over the dynamic-cache baseline >= {BATCH_GOAL}",
    }
    for cache in args.baselines:
        assert outputs[cache].shape == (args.batch, input_ids.shape[1] + args.new_tokens)
        result[cache] = {
            "baseline": BASELINES[cache],
            "seconds": times[cache],
            "tokens_per_s": generated / times[cache],
            "speedup": times[cache] / times["engine"],
        }
    speedup = result["dynamic"]["speedup"] if "dynamic" in result else None
    result["speedup"] = speedup
    result["meets_goal"] = meets_goal(speedup, BATCH_GOAL, at_least=True, real_run=real_run)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, default_shape="1.5b")
    parser.add_argument("--measure", nargs="+", default=["decode", "batch"], choices=["decode", "batch"])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64], help="G1's batch sizes")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=128)
    parser.add_argument("--baselines", nargs="+", default=["dynamic"], choices=sorted(BASELINES), help="G2's")
    parser.add_argument(
        "--block-size", type=int, help="KV block size; default: the engine's (256 under flash-attn, else 16)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compile-layers",
        choices=("auto", "on", "off"),
        default="auto",
        help="rollout.compile (default auto, the config's): blocks compiled around attention where graphs are "
        "captured; the model is shared, so G1's eager engine runs the compiled blocks too",
    )
    parser.add_argument(
        "--decode-matmul",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="rollout.decode_matmul (default auto, the config's: triton where it can run): triton runs the blocks' "
        "projections at one row "
        "through the skinny-linear kernels",
    )
    parser.add_argument(
        "--skinny-config",
        help="with --decode-matmul triton, the kernels' tiling: a JSON object of SkinnyConfig fields, or a "
        "gpu_skinny_sweep.py result (a file or its folder) whose best tiling is taken; default: SkinnyConfig()",
    )
    parser.add_argument(
        "--paged-config",
        help="the paged decode kernel's tiling: a JSON object of PagedConfig fields, or a gpu_paged_sweep.py result "
        "(a file or its folder) whose best at batch 1 is taken; default: PagedConfig()",
    )
    parser.add_argument(
        "--dependent-launch",
        action="store_true",
        help="launch the skinny-linear and paged decode kernels with programmatic dependent launch (their tilings' "
        "dependent_launch; Hopper and later): each may start while the one before it finishes",
    )
    parser.add_argument(
        "--profile",
        help="write a profile of one more batch-1 decode run (G1, the engine measured) to this file, and of each other "
        "batch size to <stem>_batch<rows><suffix> beside it",
    )
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's copy")
    parser.add_argument("--out", default="benchmarks/results")
    args = parse_with_smoke(parser, SMOKE)
    args.dtype = args.dtype or default_dtype(args.device)
    dtype = getattr(torch, args.dtype)
    real_run = torch.device(args.device).type == "cuda" and not args.smoke
    args.decode_tiling, tiling_source = skinny_tiling(args.skinny_config, args.shape)
    args.attention_tiling, attention_source = paged_tiling(args.paged_config)
    if args.dependent_launch:
        args.decode_tiling, args.attention_tiling = with_dependent_launch(args.decode_tiling, args.attention_tiling)

    result = {
        "benchmark": "gpu_generate",
        "smoke": args.smoke,
        "shape": args.shape,
        "dtype": args.dtype,
        "compile_layers": args.compile_layers,
        "decode_matmul": args.decode_matmul,
        "decode_tiling": {**tiling_fields(args.decode_tiling), "source": tiling_source},
        "attention_tiling": {**asdict(args.attention_tiling), "source": attention_source},
        "environment": environment(args.device),
    }
    name = f"gpu_generate_{args.shape}_{result['environment']['device']}"
    with shaped_model(args.shape, args.model_dir) as model_dir:
        model = load_model(model_dir, head="lm", dtype=dtype, device=args.device).requires_grad_(False).eval()
        merge_projections(model)  # the generation copy's layout, as the reshard and the rollout role build it
        result["parameters"] = sum(p.numel() for p in model.parameters())
        print(
            f"qwen2 {args.shape} ({result['parameters'] / 1e9:.2f}B parameters), "
            f"{result['environment']['device_name']}, {args.dtype}"
            f"{', SMOKE RUN: not a GPU figure' if args.smoke else ''}"
        )
        print("| measure | ours | baseline | ratio | goal |\n| --- | --- | --- | --- | --- |")
        if "decode" in args.measure:
            result["decode"] = {}
            for batch in args.decode_batches:  # the JSON after each measurement: a run cut short keeps what it had
                row = result["decode"][str(batch)] = measure_decode(model, args, batch=batch, real_run=real_run)
                write_result(args.out, name, result)
                print(
                    f"| G1 batch-{batch} decode, tokens/s | {row['decode_tokens_per_s']:.1f} "
                    f"| HBM floor {row['floor_tokens_per_s']:.1f} ({row['copy_bytes_per_s'] / 1e9:.0f} GB/s "
                    f"/ {(row['weight_bytes'] + row['kv_bytes_per_step']) / 1e9:.2f} GB) | {row['ratio_to_floor']:.2f} "
                    f"| {'>= ' + str(DECODE_GOAL) if batch == 1 else ''} |"
                )
                print(
                    f"| G1 batch-{batch}, eager decode steps, tokens/s | {row['eager_tokens_per_s']:.1f} | CUDA graphs "
                    f"({row['cuda_graphs']} captured) {row['decode_tokens_per_s']:.1f} "
                    f"| graphs {row['graphs_speedup']:.2f}x | first mismatch {row['graph_eager_first_mismatch']} |"
                )
        if "batch" in args.measure:
            row = result["batch"] = measure_batch(model, model_dir, dtype, args, real_run=real_run)
            write_result(args.out, name, result)
            for cache in args.baselines:
                print(
                    f"| G2 batch {row['batch']} x {row['new_tokens']} tokens, s | {row['engine_s']:.2f} "
                    f"| transformers, {cache} cache {row[cache]['seconds']:.2f} | {row[cache]['speedup']:.2f}x faster "
                    f"| {'>= ' + str(BATCH_GOAL) + 'x' if cache == 'dynamic' else ''} |"
                )


if __name__ == "__main__":
    main()
