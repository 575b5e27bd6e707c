"""Forward-pass speed of the spmd_rlhf decoder against ``transformers`` on the same weights, in the same process.

    python benchmarks/model_forward.py [--family qwen2] [--shape small|0.5b] [--device cpu] [--dtype float32]

Builds a random model (``--shape 0.5b``: Qwen2.5-0.5B-shaped; default ``small``), times a padded forward (logits) and
the per-token log-prob of the labels (our chunked path vs ``log_softmax`` + gather), and writes a JSON file next to the
printed table. Ratios are ours / transformers' time: below 1 is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from spmd_rlhf.models import load_model, log_probs_from_logits

SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
}


def _time(fn, *, repeats: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2", choices=["llama", "qwen2", "qwen3", "mistral"])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    config = AutoConfig.for_model(args.family, **SHAPES[args.shape], max_position_embeddings=4096)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        reference = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
        )
        ours = load_model(path, dtype=dtype, device=args.device, attention_backend="sdpa").eval()

    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, : args.seq // 4] = 0  # left padding on all rows but the first
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    labels = input_ids[:, 1:]

    with torch.no_grad():
        logits = ours(input_ids, attention_mask=attention_mask)
        rows = {
            "forward": (
                _time(lambda: ours(input_ids, attention_mask=attention_mask), repeats=args.repeats),
                _time(
                    lambda: reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids),
                    repeats=args.repeats,
                ),
            ),
            "log_probs": (
                _time(lambda: log_probs_from_logits(logits[:, :-1], labels), repeats=args.repeats),
                _time(
                    lambda: logits[:, :-1].float().log_softmax(-1).gather(-1, labels[..., None]), repeats=args.repeats
                ),
            ),
        }
    result = {
        "family": args.family,
        "shape": args.shape,
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "rows": {
            name: {"ours_s": ours_s, "baseline_s": base_s, "ratio": ours_s / base_s}
            for name, (ours_s, base_s) in rows.items()
        },
    }
    print(f"{'measure':<10} {'ours (ms)':>10} {'baseline (ms)':>14} {'ratio':>6}   baseline")
    baselines = {"forward": "transformers forward (sdpa)", "log_probs": "float32 log_softmax + gather"}
    for name, row in result["rows"].items():
        print(
            f"{name:<10} {row['ours_s'] * 1e3:>10.1f} {row['baseline_s'] * 1e3:>14.1f} "
            f"{row['ratio']:>6.2f}   {baselines[name]}"
        )
    os.makedirs(args.out, exist_ok=True)
    out_file = os.path.join(args.out, f"model_forward_{args.family}_{args.shape}_{args.device}_{args.dtype}.json")
    with open(out_file, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {out_file}")


if __name__ == "__main__":
    main()
