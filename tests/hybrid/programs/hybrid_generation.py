"""The actor in several training layouts generating in several generation layouts on the same ranks: greedy
responses, peak memory per rank during generation (with the bound's parts), weights before and after a
generation round trip, and generation after an update against a fresh single-rank actor loaded with the new weights.

    torchrun --nproc-per-node 4 hybrid_generation.py POLICY_DIR OUT_DIR dp1tp1pp1:1 dp1tp4pp1:2 dp1tp2pp2:1r ... \\
        [+ POLICY_DIR OUT_DIR dp1tp1pp1:1 ...]

A trailing ``r`` puts the layout on a pool in descending order (stage 0 on the highest ranks); ``fsdp2`` after the
sizes shards FSDP over groups of 2 DP ranks (HSDP). Each ``+`` starts
another policy with its own output directory and layouts, run after the one before in the same job.
"""

import json
import re
import sys

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.metrics.peak_memory import PeakMemory
from spmd_rlhf.models import DecoderLM
from spmd_rlhf.runtime import ParallelDims, ResourcePool, all_to_all, launch
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "workers" / "programs"))
from dp_parity import argument_sets, rollout_batch  # noqa: E402


def local_bytes(model: torch.nn.Module) -> int:
    tensors = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in tensors)


class MeasuredActor(ActorWorker):
    """The actor with a generation that also reports this rank's peak memory and the parts of its bound."""

    def __init__(self, context, config):
        with PeakMemory(context.device) as loading:
            super().__init__(context, config)
        self.loading_peak = loading.peak_increase
        self.generator.engine = self._engine

    def _engine(self, model, **options):
        engine = type(self.generator).engine(self.generator, model, **options)
        self.generation_bytes = local_bytes(model)
        generate = engine.generate

        def measured_generate(*args, **kwargs):
            outputs = generate(*args, **kwargs)
            self.kv_bytes = engine.runner.num_blocks * engine.runner.block_bytes
            return outputs

        engine.generate = measured_generate
        return engine

    @all_to_all
    def measured_generation(self, _: object) -> dict:
        prompts = prompts_batch(100).split(self.reducer.size)[self.dp_rank]
        self.generation_bytes = self.kv_bytes = 0
        # The largest FSDP block (a layer, or the root's embedding + norm + head) in the compute dtype: FSDP's gather
        # buffers and the micro-DP gather hold at most a few of these at a time.
        dtype = getattr(torch, self.config.model.dtype)
        full = {name: p.numel() for name, p in meta_model(self.model.module.args).named_parameters()}
        blocks = [
            sum(n for name, n in full.items() if name.startswith(f"model.layers.{i}."))
            for i in range(self.model.module.args.num_layers)
        ]
        largest_block = (
            max(*blocks, sum(n for name, n in full.items() if not name.startswith("model.layers."))) * dtype.itemsize
        )
        build = self.hybrid.generation_model
        reshard = PeakMemory(self.device)

        def measured_build(dtype):
            with reshard:
                return build(dtype)

        self.hybrid.generation_model = measured_build
        with PeakMemory(self.device) as memory:
            batch = self.generate_sequences(prompts, greedy=True)
        del self.hybrid.generation_model
        return {
            "loading_peak": self.loading_peak,
            "training_bytes": local_bytes(self.model.module),
            "largest_tensor_bytes": max(full.values()) * 4,
            "peak_increase": memory.peak_increase,
            "reshard_peak_increase": reshard.peak_increase,
            "generation_bytes": self.generation_bytes,
            "kv_bytes": self.kv_bytes,
            "block_bytes": largest_block,
            "full_model_bytes": sum(full.values()) * dtype.itemsize,
            "responses": batch["responses"].tolist(),
        }


def meta_model(args):
    with torch.device("meta"):
        return DecoderLM(args, head="lm")


def prompts_batch(vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab, (8, 6), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0
    return Batch({"input_ids": ids * mask, "attention_mask": mask, "uid": torch.arange(8)})


def main(coordinator):
    for number, arguments in enumerate(argument_sets(sys.argv[1:])):
        generate_in_layouts(coordinator, *arguments, prefix=f"set{number}_")


def generate_in_layouts(coordinator, policy_dir: str, out_dir: str, *layouts: str, prefix: str) -> None:
    """One policy in ``layouts``; ``prefix`` keeps its roles' names apart from another policy's."""
    results = {}
    for layout in layouts:
        *sizes, reversed_pool = re.fullmatch(r"dp(\d+)tp(\d+)pp(\d+)(?:fsdp(\d+))?:(\d+)(r?)", layout).groups()
        dp, tp, pp, fsdp, tp_g = (int(size or 0) for size in sizes)
        config = load_config(
            None,
            [
                f"model.path={policy_dir}",
                "algorithm.name=grpo",
                "critic.enabled=false",
                "rollout.n=2",
                "rollout.max_new_tokens=8",
                f"rollout.tp={tp_g}",
                f"actor.tp={tp}",
                f"actor.pp={pp}",
                "data.batch_size=8",
                "actor.lr=1e-2",
                "actor.mini_batch_size=16",
                "actor.micro_batch_size=4",
                # One FSDP unit per layer, as at real sizes, so the reshard's peak is bounded by one layer's buffers.
                "actor.fsdp_unit_mb=0",
            ],
        )
        ranks = list(range(dp * tp * pp))
        if reversed_pool:  # the pool's TP blocks in descending order: stage 0 on the highest ranks
            ranks = [rank for start in reversed(range(0, len(ranks), tp)) for rank in range(start, start + tp)]
        pool, dims = ResourcePool(ranks), ParallelDims(pp=pp, dp=dp, tp=tp, fsdp_size=fsdp)
        actor = coordinator.spawn(MeasuredActor, config, name=f"{prefix}actor_{layout}", pool=pool, dims=dims)
        prompts = prompts_batch(100)
        actor.save_pretrained(f"{out_dir}/{layout}_before").result()
        measured = actor.measured_generation([None] * len(pool)).result()
        actor.save_pretrained(f"{out_dir}/{layout}_after").result()
        results[layout] = {"measured": measured}
        if "pp2:1" in layout or layout in ("dp1tp4pp1:2", "dp2tp1pp1:1", "dp4tp1pp1fsdp2:1"):
            # One update, then greedy generation against a fresh single-rank actor loaded with the new weights.
            actor.update_actor(rollout_batch(16, 5, 6, vocab=100)).result()
            updated = actor.generate_sequences(prompts, greedy=True).result().fetch()["responses"]
            actor.save_pretrained(f"{out_dir}/{layout}_updated").result()
            fresh_config = load_config(
                None,
                [
                    f"model.path={out_dir}/{layout}_updated",
                    "algorithm.name=grpo",
                    "critic.enabled=false",
                    "rollout.n=2",
                    "rollout.max_new_tokens=8",
                ],
            )
            fresh = coordinator.spawn(
                ActorWorker, fresh_config, name=f"{prefix}fresh_{layout}", pool=ResourcePool([0]), dims=ParallelDims()
            )
            expected = fresh.generate_sequences(prompts, greedy=True).result().fetch()["responses"]
            results[layout]["updated"] = updated.tolist()
            results[layout]["fresh"] = expected.tolist()
    with open(f"{out_dir}/results.json", "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    launch(main)
