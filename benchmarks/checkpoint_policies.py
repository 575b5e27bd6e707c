"""What each activation checkpointing policy costs (``model.activation_checkpointing``, ``model.checkpoint_policy``):
the memory a training forward keeps for its backward and the time of forward + backward, for no checkpointing,
``full`` and ``selective``, on decoder layers at Qwen2.5-0.5B's widths (896 hidden, 4864 MLP, 14 / 2 heads) on CPU.

    python benchmarks/checkpoint_policies.py                  # 4 layers, 4096 tokens, float32: about a minute
    python benchmarks/checkpoint_policies.py --tokens 8192 --layers 8

Each policy runs in its own process with glibc mapping every allocation of 64 KiB or more on its own
(``MALLOC_MMAP_THRESHOLD_``), so the resident set follows the live tensors: the kept bytes are the resident set after
the forward less before it (weights and the input built), the peak is the kernel's high-water mark of the whole
forward and backward, reset before the forward (``/proc/self/clear_refs``). Writes
``benchmarks/results/checkpoint_policies_cpu.json`` with each policy's figures and their ratios to no checkpointing,
beside the analytical count (``training.token_budget``) of what a token keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLICIES = ("none", "full", "selective")


def _resident(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def measure(policy: str, *, layers: int, tokens: int, repeats: int) -> dict:
    """One policy in this process: kept bytes after the forward, the peak over forward and backward, seconds."""
    import torch

    from spmd_rlhf.models.args import decoder_args
    from spmd_rlhf.models.decoder import DecoderLM
    from spmd_rlhf.models.parallelize import parallelize

    torch.manual_seed(0)
    args = decoder_args(
        family="qwen2",
        vocab_size=1024,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=layers,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1e6,
        max_position_embeddings=tokens,
        qkv_bias=True,
    )
    model = DecoderLM(args, head="lm")
    model.reset_buffers()
    if policy != "none":
        parallelize(model, tp_mesh=None, dp_mesh=None, activation_checkpointing=True, checkpoint_policy=policy)
    ids = torch.randint(0, args.vocab_size, (1, tokens))
    seconds = []
    kept = peak = 0
    for _ in range(repeats):
        model.zero_grad(set_to_none=False)
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the resident set now
        before = _resident("VmRSS:")
        start = time.perf_counter()
        # The body's activations only: the head's logits are the same under every policy.
        hidden = model.hidden_states(ids)
        kept = _resident("VmRSS:") - before
        hidden.float().square().mean().backward()
        seconds.append(time.perf_counter() - start)
        peak = _resident("VmHWM:") - before
        del hidden
    return {"kept_bytes": kept, "peak_bytes": peak, "seconds": min(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policy", choices=POLICIES, help=argparse.SUPPRESS)  # one policy, in a child process
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.policy:
        print(json.dumps(measure(args.policy, layers=args.layers, tokens=args.tokens, repeats=args.repeats)))
        return
    from spmd_rlhf.models.args import decoder_args  # noqa: F401 (import check before the children start)
    from spmd_rlhf.training.token_budget import activation_elements, selective_checkpoint_elements

    environment = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    results = {}
    for policy in POLICIES:
        command = [sys.executable, __file__, "--policy", policy, "--layers", str(args.layers)]
        command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        finished = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
        results[policy] = json.loads(finished.stdout.strip().splitlines()[-1])
    widths = dict(hidden=896, kv_width=2 * 64, mlp_width=4864)
    none = results["none"]
    for row in results.values():
        row["kept_over_none"] = row["kept_bytes"] / none["kept_bytes"]
        row["peak_over_none"] = row["peak_bytes"] / none["peak_bytes"]
        row["time_over_none"] = row["seconds"] / none["seconds"]
    report = {
        "benchmark": "checkpoint_policies",
        "layers": args.layers,
        "tokens": args.tokens,
        "dtype": "float32",
        "device": "cpu",
        "policies": results,
        "analytical_kept_per_layer_token": {
            "none": activation_elements(**widths),
            "full": widths["hidden"],
            "selective": selective_checkpoint_elements(**widths),
        },
    }
    print("| policy | kept after forward (MiB) | / none | peak (MiB) | / none | seconds | / none |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for policy, row in results.items():
        print(
            f"| {policy} | {row['kept_bytes'] / 2**20:.0f} | {row['kept_over_none']:.2f} | "
            f"{row['peak_bytes'] / 2**20:.0f} | {row['peak_over_none']:.2f} | {row['seconds']:.2f} | "
            f"{row['time_over_none']:.2f} |"
        )
    path = Path(args.out) / "checkpoint_policies_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
