"""Ring context parallelism with zig-zag chunks, against one process: a packed row of sequences of mixed lengths (one
crossing every chunk boundary) split over all 4 gloo ranks (cp = 4) and over two groups of 2 (cp = 2); each rank's
``ring_attend`` output and the gradients of its q, k, v chunks must equal those positions of ``attend`` over the whole
row in float32 (and bfloat16 inputs within bfloat16's rounding), with fewer query heads than ranks (what Ulysses
cannot split), grouped-query attention, and query tiles smaller than a chunk.

    torchrun --nproc-per-node 4 tests/models/programs/ring_attention.py
"""

import torch
import torch.distributed as dist

from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.ring_attention import ring_attend, zigzag_positions
from spmd_rlhf.runtime import end_process

DIM = 16
LENGTHS = [5, 19, 1, 7, 16]  # 48 tokens: 2 x cp chunks for cp = 2 and 4


def check(heads: int, kv_heads: int, group, cp: int, rank: int, dtype: torch.dtype, query_tile: int) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    total = sum(LENGTHS)
    q = torch.randn(1, total, heads, DIM, generator=generator).to(dtype)
    k, v = (torch.randn(1, total, kv_heads, DIM, generator=generator).to(dtype) for _ in range(2))
    weights = torch.randn(1, total, heads, DIM, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    batch = AttentionBatch.build(
        batch_size=1,
        seq_len=total,
        attention_mask=None,
        cu_seqlens=cu_seqlens,
        backend="torch",
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    whole = [tensor.float().clone().requires_grad_(True) for tensor in (q, k, v)]
    expected = attend(*whole, batch, scale=DIM**-0.5)
    (expected * weights).sum().backward()

    positions = zigzag_positions(rank, cp, total)
    mine = [tensor[:, positions].clone().requires_grad_(True) for tensor in (q, k, v)]
    out = ring_attend(*mine, batch, scale=DIM**-0.5, group=group, query_tile=query_tile)
    (out.float() * weights[:, positions]).sum().backward()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    label = f"cp={cp} heads={heads} kv_heads={kv_heads} {dtype}"
    torch.testing.assert_close(out.float(), expected[:, positions], **tolerance, msg=label)
    for name, local, reference in zip("qkv", mine, whole):
        torch.testing.assert_close(local.grad.float(), reference.grad[:, positions], **tolerance, msg=f"{label} {name}")


def main() -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    for heads, kv_heads in ((2, 1), (2, 2), (8, 2)):
        check(heads, kv_heads, dist.group.WORLD, world, rank, torch.float32, query_tile=4)
        check(heads, kv_heads, pair, 2, rank % 2, torch.float32, query_tile=1024)
    check(8, 2, dist.group.WORLD, world, rank, torch.bfloat16, query_tile=5)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
