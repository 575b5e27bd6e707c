"""Two gloo ranks run one tensor-parallel generation replica (tp_g = 2) with different local KV budgets (10 and 40
blocks, as ranks that measured different free memory would); the engine agrees on the smaller one, so both ranks run
the same steps (same sequences prefilled, decoded and preempted, in order) and produce the same tokens as a
single-rank engine with 10 blocks. Without the agreement the ranks' schedules part and their TP collectives hang.
Then the same replica on local shards (``run_locally``) runs its decode steps as the CUDA graphs would replay them
(``decode_graphs="static"``: padded fixed-address inputs, collectives inside the step): the same tokens again; and
with its blocks compiled around attention (traced by a counting backend): the same tokens, the all-reduces inside
the graphs, and as many graphs as the single-rank model compiles (every layer shares them). Rank 0 writes the
results as JSON to the path given.

    torchrun --nproc-per-node 2 tests/engine/programs/tp_schedule_agreement.py OUT.json
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from counting_backend import CountingBackend
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.decode_compile import compile_around_attention
from spmd_rlhf.models.args import decoder_args
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.local_tensor_parallel import run_locally
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.runtime import end_process

ARGS = decoder_args(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
LOCAL_BLOCKS = (10, 40)
"""Each rank's own KV budget; the agreed one is the smaller."""


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (length,), generator=generator).tolist() for length in (9, 5, 7, 9, 3, 6)]


def run(model: DecoderLM, num_blocks: int, decode_graphs: str = "auto") -> dict:
    """Greedy generation with a 4-token block size; the steps the engine ran and what it produced."""
    engine = LLMEngine(
        model, eos_token_id=None, block_size=4, num_blocks=num_blocks, max_num_seqs=4, decode_graphs=decode_graphs
    )
    steps = []
    run_step = engine.runner.run

    static_steps = []
    sample_step = engine.runner.sample_step

    def recorded(seqs, *, is_prefill):
        steps.append(["prefill" if is_prefill else "decode", [seq.seq_id for seq in seqs]])
        return run_step(seqs, is_prefill=is_prefill)

    def sampled(seqs, **kwargs):  # the overlapped loop's steps, the static ones among them
        samples = sample_step(seqs, **kwargs)
        static_steps.append(engine.runner.ran_static_step)
        return samples

    engine.runner.sample_step = sampled

    engine.runner.run = recorded
    outputs = engine.generate(prompts(), SamplingParams(temperature=0, max_new_tokens=12))
    return {
        "num_blocks": engine.runner.num_blocks,
        "preemptions": engine.num_preemptions,
        "steps": steps,
        "tokens": [seq.generated_token_ids for seq in outputs],
        "static_steps": sum(static_steps),
    }


def compiled_run(model: DecoderLM, num_blocks: int) -> dict:
    """``run`` on the static step with the blocks compiled around attention; the graphs it compiled."""
    backend = CountingBackend()
    compile_around_attention(model, backend=backend)
    result = run(model, num_blocks, decode_graphs="static")
    return result | {"graphs": backend.graphs, "collective_graphs": backend.collective_graphs, "calls": backend.calls}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DecoderLM(ARGS).eval()  # the same weights on both ranks (same seed)
    model.reset_buffers()  # the rotary frequencies are computed here, not in the constructor
    reference, one_rank = copy.deepcopy(model), copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2,))
    parallelize(model, tp_mesh=mesh, dp_mesh=None, gather_logits=True, role="rollout")
    mine = run(model, LOCAL_BLOCKS[rank])
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    run_locally(model, mesh)
    static = run(model, LOCAL_BLOCKS[rank], decode_graphs="static")
    compiled = compiled_run(model, LOCAL_BLOCKS[rank])
    if rank == 0:
        torch._dynamo.reset()
        results = {
            "ranks": gathered,
            "local_static": static,
            "local_compiled": compiled,
            "one_rank_compiled": compiled_run(one_rank, min(LOCAL_BLOCKS)),
            "reference": run(reference, min(LOCAL_BLOCKS)),
            "roomy_reference": run(reference, max(LOCAL_BLOCKS)),
        }
        with open(sys.argv[1], "w") as out:
            json.dump(results, out)
    # Both ranks leave together, without the interpreter's teardown (spmd_rlhf.runtime.end_process).
    dist.barrier()
    dist.destroy_process_group()
    end_process()


if __name__ == "__main__":
    main()
