"""Ulysses context parallelism over every rank of a gloo job, against one process: a packed row of sequences of
mixed lengths (one crossing every chunk boundary) split into equal contiguous chunks, one per rank; each rank's
``ulysses_attend`` output and the gradients of its q, k, v chunks must equal those slices of ``attend`` over the
whole row in float32, with key/value heads equal to, fewer than (replicated) and more than the ranks.

    torchrun --nproc-per-node N tests/models/programs/ulysses_attention.py
"""

import torch
import torch.distributed as dist

from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.context_parallel import ulysses_attend
from spmd_rlhf.runtime import end_process

HEADS, DIM = 8, 16
LENGTHS = [5, 19, 1, 7, 16]  # 48 tokens


def check(kv_heads: int, backend: str) -> None:
    rank, cp = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(kv_heads)
    total = sum(LENGTHS)
    q = torch.randn(1, total, HEADS, DIM, generator=generator)
    k, v = (torch.randn(1, total, kv_heads, DIM, generator=generator) for _ in range(2))
    weights = torch.randn(1, total, HEADS, DIM, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    batch = AttentionBatch.build(
        batch_size=1,
        seq_len=total,
        attention_mask=None,
        cu_seqlens=cu_seqlens,
        backend=backend,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    whole = [tensor.clone().requires_grad_(True) for tensor in (q, k, v)]
    expected = attend(*whole, batch, scale=DIM**-0.5)
    (expected * weights).sum().backward()

    chunk = slice(rank * total // cp, (rank + 1) * total // cp)
    mine = [tensor[:, chunk].clone().requires_grad_(True) for tensor in (q, k, v)]
    out = ulysses_attend(*mine, batch, scale=DIM**-0.5, group=dist.group.WORLD)
    (out * weights[:, chunk]).sum().backward()
    torch.testing.assert_close(out, expected[:, chunk], rtol=1e-5, atol=1e-5)
    for name, local, reference in zip("qkv", mine, whole):
        torch.testing.assert_close(local.grad, reference.grad[:, chunk], rtol=1e-5, atol=1e-5, msg=name)


def main() -> None:
    dist.init_process_group("gloo")
    for kv_heads in (1, 2, 8):
        for backend in ("torch", "sdpa"):
            check(kv_heads, backend)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
