"""Run under ``TRITON_INTERPRET=1`` on two gloo ranks: a tensor-parallel generation replica on local shards
(``run_locally``, its projections merged) decodes on the static step with its projections through the skinny-linear
kernels (``use_skinny_linear``: the fused blocks, o and down row-parallel), eagerly and with its blocks compiled
around attention (traced by a counting backend), against the same replica through ``F.linear``. Rank 0 writes, as
JSON to the path given: whether tokens were equal, the largest log-prob difference, the operator calls that took the
kernels, and the fused blocks.

    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 tests/engine/programs/tp_skinny_decode.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
from counting_backend import CountingBackend
from skinny_decode import SkinnyCalls
from torch.distributed.device_mesh import init_device_mesh
from tp_schedule_agreement import ARGS, prompts

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.decode_compile import compile_around_attention
from spmd_rlhf.engine.decode_matmul import skinny_linear_unsupported, use_skinny_linear
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig
from spmd_rlhf.kernels.triton_support import INTERPRETING
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.local_tensor_parallel import run_locally
from spmd_rlhf.models.merged_linear import merge_projections
from spmd_rlhf.models.parallelize import parallelize


def generate(model) -> list:
    engine = LLMEngine(model, eos_token_id=None, block_size=4, max_num_seqs=4, decode_graphs="static")
    params = [
        SamplingParams(temperature=0, max_new_tokens=6),
        SamplingParams(temperature=1.0, max_new_tokens=5, seed=2),
    ]
    return engine.generate(prompts()[:4], params * 2)


def replica(mesh) -> DecoderLM:
    """The same weights on both ranks and in every call (the same seed), split over ``mesh``, on local shards,
    merged."""
    torch.manual_seed(0)
    model = DecoderLM(ARGS).eval()
    model.reset_buffers()  # the rotary frequencies are computed here, not in the constructor
    parallelize(model, tp_mesh=mesh, dp_mesh=None, gather_logits=True, role="rollout")
    return model


def main() -> None:
    assert INTERPRETING, "run with TRITON_INTERPRET=1"
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    expected_model = replica(mesh)
    report = {"refused_on_dtensor": skinny_linear_unsupported(expected_model, backend="triton")}
    models = {"reference": expected_model, "eager": replica(mesh), "compiled": replica(mesh)}
    for model in models.values():
        run_locally(model, mesh)
        model.requires_grad_(False)
        merge_projections(model)
    report["taken_on_local_shards"] = skinny_linear_unsupported(expected_model, backend="triton")
    expected = generate(models["reference"])
    for name in ("eager", "compiled"):
        torch._dynamo.reset()
        per_block, fused = use_skinny_linear(models[name], backend="triton", config=SkinnyConfig(block_out=32))
        backend = CountingBackend()
        if name == "compiled":
            compile_around_attention(models[name], backend=backend)
        with SkinnyCalls() as calls:
            got = generate(models[name])
        report[name] = {
            "tokens_equal": [g.generated_token_ids for g in got] == [e.generated_token_ids for e in expected],
            "max_log_prob_difference": max(
                (torch.tensor(g.log_probs) - torch.tensor(e.log_probs)).abs().max().item()
                for g, e in zip(got, expected)
            ),
            "per_block": per_block,
            "fused_blocks": fused,
            "kernel_calls": calls.kernel,
            "collective_graphs": backend.collective_graphs,
        }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(report, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
