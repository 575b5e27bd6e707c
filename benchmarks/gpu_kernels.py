"""Both Triton kernels at real sizes on one GPU, each against its torch reference measured in the same run:

    python benchmarks/gpu_kernels.py [--decode-seqs 256] [--context 1024] [--tokens 8192] [--vocab 151936]
    python benchmarks/gpu_kernels.py --smoke     # small sizes, CPU-sized: checks the script in seconds

- ``paged_decode``: one decode step's attention for ``--decode-seqs`` sequences of ``--context`` cached tokens,
  Qwen2.5-7B's attention shape (28 query / 4 KV heads, head_dim 128), 16-token blocks, bf16. The kernel
  (``kernels.paged_attention``) against the torch reference (gather the blocks, masked softmax): time, and the kernel's
  time against the floor of reading the whole KV context once at the copy bandwidth measured here; and batch-1 decode
  (one sequence at 256 and 4,096 tokens) timed inside a CUDA graph: one program per KV head with a separate K/V
  write, split-K with it, split-K with the write fused into the kernel, and with the rotation fused too.
- ``skinny_linear``: the projections of one decoder block of the 1.5B and 7B shapes (q/k/v merged with their bias,
  o, gate/up merged, down) at 1, 2 and 4 rows, bf16: ``F.linear`` (cuBLAS) against ``kernels.skinny_linear``, each
  timed inside a CUDA graph over 28 distinct weights (one per layer: a repeated weight would be read from L2), as
  bandwidth against the copy's; and the microseconds a 28-layer decode step would save (``rollout.decode_matmul``);
  at one row, q/k/v and gate/up also with the residual add and RMSNorm before them and down with SwiGLU's activation
  in its kernel (``FUSED_PROLOGUES``), as the engine runs them.
- ``fused_logprob``: log-prob and entropy of ``--tokens`` rows of ``--vocab`` bf16 logits at T = 0.7, forward and
  backward. The fused kernels (``kernels.fused_logprob``) against the reference (float32 log-softmax, the way a plain
  PyTorch trainer computes it): time and peak memory above the logits.

On CPU (or with ``--smoke``) both sides run the torch path: the figures then check the script, not the kernels.
Writes ``benchmarks/results/gpu_kernels_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse

import torch
from gpu_common import (
    add_kernel_arguments,
    copy_bandwidth,
    environment,
    kernel_dtype,
    meets_goal,
    parse_with_smoke,
    synchronize,
    write_result,
)
from gpu_skinny import measure_skinny_linear
from gpu_timing import GRAPH_CALLS, best_seconds, graphed_seconds

from spmd_rlhf.kernels.fused_logprob import fused_log_probs_and_entropy
from spmd_rlhf.kernels.paged_attention import (
    decode_splits,
    paged_decode_attention,
    write_new_tokens,
)
from spmd_rlhf.kernels.triton_support import multiprocessors

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 4, 128, 16


def peak_bytes_above(function, device: str) -> int | None:
    """CUDA allocator peak during ``function()`` above what was allocated before; None off CUDA."""
    if torch.device(device).type != "cuda":
        function()
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    function()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def decode_inputs(device: str, seqs: int, context: int, dtype: torch.dtype) -> tuple:
    """q, both caches, block tables and context lengths of ``seqs`` sequences of ``context`` cached tokens."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    generator = torch.Generator(device=device).manual_seed(0)
    key_cache, value_cache = (
        torch.randn(
            seqs * blocks_per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=generator
        )
        for _ in range(2)
    )
    # Each sequence's blocks scattered over the cache, as after continuous batching.
    block_tables = torch.randperm(seqs * blocks_per_seq, device=device, generator=generator).view(seqs, blocks_per_seq)
    block_tables = block_tables.to(torch.int32)
    context_lens = torch.full((seqs,), context, device=device, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=generator)
    return q, key_cache, value_cache, block_tables, context_lens


def new_token_inputs(key_cache: torch.Tensor, block_tables: torch.Tensor, context: int, dtype: torch.dtype) -> dict:
    """A decode step's new tokens for ``decode_inputs``' sequences, as the kernel's keyword arguments: their K/V
    (``new_keys``, ``new_values`` ``[seqs, kv_heads, head_dim]``), the ``slots`` of their last position and the
    step's rotary tables (``rope``)."""
    seqs, last = block_tables.shape[0], context - 1
    slots = (block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE).contiguous()
    new_keys, new_values = (torch.randn_like(key_cache[:seqs, 0]) for _ in range(2))
    angles = torch.rand(seqs, HEAD_DIM, device=key_cache.device) * context
    rope = (angles.cos().to(dtype), angles.sin().to(dtype))
    return {"new_keys": new_keys, "new_values": new_values, "slots": slots, "rope": rope}


def measure_paged_decode(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    device, seqs, context = args.device, args.decode_seqs, args.context
    q, key_cache, value_cache, block_tables, context_lens = decode_inputs(device, seqs, context, dtype)
    scale = HEAD_DIM**-0.5

    def run(backend: str):
        return lambda: paged_decode_attention(
            q, key_cache, value_cache, block_tables, context_lens, scale=scale, backend=backend
        )

    kernel_s = best_seconds(run("auto"), device, args.repeats)
    reference_s = best_seconds(run("torch"), device, args.repeats)
    kv_bytes = 2 * seqs * context * KV_HEADS * HEAD_DIM * key_cache.element_size()
    bandwidth = copy_bandwidth(device, nbytes=args.copy_mib * 2**20)
    # copy_bandwidth counts bytes read + written per second: the memory system's byte rate, at which the kernel's
    # one read of every cached key and value would take floor_s.
    floor_s = kv_bytes / bandwidth
    return {
        "seqs": seqs,
        "context": context,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "kernel_s": kernel_s,
        "reference_s": reference_s,
        "speedup": reference_s / kernel_s,
        "kv_bytes": kv_bytes,
        "copy_bytes_per_s": bandwidth,
        "floor_s": floor_s,
        "kernel_over_floor": kernel_s / floor_s,
        "batch1": measure_batch1(args, dtype),
    }


def measure_batch1(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    """Batch-1 decode attention (one sequence: as many programs as KV heads without split-K) at a short and a long
    context, timed inside a CUDA graph: one program per KV head with the new token's K/V written first (two
    ``index_copy_``, the engine before session 40), split-K with that write, split-K with the write fused into the
    kernel, and with the rotation of q and the new key fused too (the engine's path now). Session 38's H100 profile
    had 9.3 us per layer for the first at 256 tokens, and 1.9 us for each of the two writes."""
    results = {}
    for context in (40,) if args.smoke else (256, 4096):
        q, key_cache, value_cache, block_tables, context_lens = decode_inputs(args.device, 1, context, dtype)
        step = new_token_inputs(key_cache, block_tables, context, dtype)

        def run(splits, fused, rotary=False):
            def call():
                if not fused:
                    write_new_tokens(key_cache, value_cache, step["new_keys"], step["new_values"], step["slots"])
                new_tokens = {key: step[key] for key in ("new_keys", "new_values", "slots")} if fused else {}
                if rotary:
                    new_tokens["rope"] = step["rope"]
                return paged_decode_attention(
                    q,
                    key_cache,
                    value_cache,
                    block_tables,
                    context_lens,
                    scale=HEAD_DIM**-0.5,
                    splits=splits,
                    **new_tokens,
                )

            return call

        one_split_s, split_s, fused_s, rotating_s = (
            graphed_seconds(run(splits, fused, rotary), args.device, args.repeats)
            for splits, fused, rotary in (
                (1, False, False),
                (None, False, False),
                (None, True, False),
                (None, True, True),
            )
        )
        chosen = decode_splits(KV_HEADS, block_tables.shape[1] * BLOCK_SIZE, multiprocessors(torch.device(args.device)))
        results[str(context)] = {
            "splits": chosen,
            "one_split_with_write_s": one_split_s,
            "split_k_with_write_s": split_s,
            "split_k_fused_write_s": fused_s,
            # The engine's path since session 41: q and the new key rotated in the kernel (the rotation kernel per
            # layer it replaces took about 1 us in session 38's profile).
            "split_k_fused_write_and_rotation_s": rotating_s,
            "rotation_in_kernel_us_per_call": (rotating_s - fused_s) * 1e6,
            "speedup": one_split_s / fused_s,
            "saved_us_per_step_at_28_layers": (one_split_s - fused_s) * GRAPH_CALLS * 1e6,
        }
    return results


def measure_fused_logprob(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    device, tokens, vocab = args.device, args.tokens, args.vocab
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, device=device, dtype=dtype, generator=generator).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)

    def run(backend: str):
        def forward_backward():
            logits.grad = None
            log_probs, entropy = fused_log_probs_and_entropy(logits, labels, temperature=0.7, backend=backend)
            (log_probs.sum() + 0.01 * entropy.sum()).backward()

        return forward_backward

    kernel_s = best_seconds(run("auto"), device, args.repeats)
    reference_s = best_seconds(run("torch"), device, args.repeats)
    logits.grad = None
    kernel_peak, reference_peak = peak_bytes_above(run("auto"), device), peak_bytes_above(run("torch"), device)
    logits_bytes = logits.numel() * logits.element_size()
    return {
        "tokens": tokens,
        "vocab": vocab,
        "kernel_s": kernel_s,
        "reference_s": reference_s,
        "speedup": reference_s / kernel_s,
        "logits_bytes": logits_bytes,
        "kernel_peak_over_logits": None if kernel_peak is None else kernel_peak / logits_bytes,
        "reference_peak_over_logits": None if reference_peak is None else reference_peak / logits_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    parser.add_argument("--decode-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--skinny-rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--copy-mib", type=int, default=1024)
    args = parse_with_smoke(parser, dict(decode_seqs=4, context=40, tokens=64, vocab=512, repeats=2, copy_mib=4))
    real_run = torch.device(args.device).type == "cuda" and not args.smoke
    dtype = kernel_dtype(args.device)
    paged = measure_paged_decode(args, dtype)
    fused = measure_fused_logprob(args, dtype)
    # Goals: the paged kernel within 2x of reading its KV once; the fused pass at least as fast as the reference while
    # holding no float32 [tokens, vocab] table (peak below 1.5x the bf16 logits, the gradient itself being 1x).
    paged["meets_goal"] = meets_goal(paged["kernel_over_floor"], 2.0, at_least=False, real_run=real_run)
    fused["meets_goal"] = meets_goal(
        min(fused["speedup"], 1.5 / (fused["kernel_peak_over_logits"] or float("inf"))),
        1.0,
        at_least=True,
        real_run=real_run,
    )
    result = {
        "smoke": args.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "environment": environment(args.device),
        "paged_decode": paged,
        "fused_logprob": fused,
    }
    result_name = f"gpu_kernels_{torch.device(args.device).type}"
    # Written before the skinny linear is timed, and again after: a failure there keeps the figures above.
    write_result(args.out, result_name, result)
    skinny = result["skinny_linear"] = measure_skinny_linear(args, dtype, paged["copy_bytes_per_s"])
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    print(f"{'kernel':<14} {'kernel s':>10} {'torch s':>10} {'speed-up':>9}  other")
    print(
        f"{'paged_decode':<14} {paged['kernel_s']:>10.5f} {paged['reference_s']:>10.5f} {paged['speedup']:>9.2f}  "
        f"kernel / KV-read floor {paged['kernel_over_floor']:.2f}"
    )
    for context, batch1 in paged["batch1"].items():
        print(
            f"  batch 1, {context} tokens, per layer in a graph: one program + write "
            f"{batch1['one_split_with_write_s'] * 1e6:.1f} us, {batch1['splits']} splits + write "
            f"{batch1['split_k_with_write_s'] * 1e6:.1f} us, fused write {batch1['split_k_fused_write_s'] * 1e6:.1f} "
            f"us, and rotation {batch1['split_k_fused_write_and_rotation_s'] * 1e6:.1f} us"
        )
    peaks = (
        ""
        if fused["kernel_peak_over_logits"] is None
        else (
            f"peak / logits: kernel {fused['kernel_peak_over_logits']:.2f}, "
            f"torch {fused['reference_peak_over_logits']:.2f}"
        )
    )
    print(
        f"{'fused_logprob':<14} {fused['kernel_s']:>10.5f} {fused['reference_s']:>10.5f} "
        f"{fused['speedup']:>9.2f}  {peaks}"
    )
    for name, figures in skinny["projections"].items():
        print(
            f"  skinny_linear {name} ({figures['splits']} splits): F.linear {figures['torch_us']:.1f} us "
            f"({figures['torch_over_copy']:.2f} of copy), skinny {figures['skinny_us']:.1f} us "
            f"({figures['skinny_over_copy']:.2f}), {figures['speedup']:.2f}x, error {figures['relative_error']:.1e}"
        )
        if "fused" in figures:
            print(f"    with the {figures['fused']}: {figures['fused_us']:.1f} us (+{figures['prologue_us']:.1f})")
    for shape, saved in skinny["saved_us_per_28_layer_step"].items():
        print(f"  skinny_linear {shape}: us saved per 28-layer decode step by rows {saved}")
    write_result(args.out, result_name, result)


if __name__ == "__main__":
    main()
