"""Peak memory of the streamed Hugging Face save and of ``spmd-rlhf export``, per rank, on a model sharded over 4 gloo
ranks (each holding a quarter of it): the rise of the process's resident set over each (``VmHWM`` restarted from the
current resident set just before), beside the rank's shard bytes.

Per layout: load the model sharded, save it as a Hugging Face directory in bfloat16 in row bands of ``BAND_BYTES``
(measured on every rank), save the role's DCP state. After the last layout, rank 0 exports that state in float32 in
buckets of ``BUCKET_BYTES`` (export runs in one process), measured while the other ranks wait. Writes
``OUT_DIR/figures.json`` and ``OUT_DIR/<layout>/`` (the save), ``OUT_DIR/export/actor/`` (the export).

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 4 tests/models/programs/save_memory.py \\
        MODEL_DIR OUT_DIR dp4tp1 dp2tp2
"""

import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoTokenizer

from spmd_rlhf import checkpoint
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.shard_pieces import local_piece
from spmd_rlhf.models.sharded_save import save_sharded_pretrained
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.runtime import end_process

BAND_BYTES = 1 * 2**20
BUCKET_BYTES = 4 * 2**20


def status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class ResidentRise:
    """The peak rise of this process's resident set over a ``with`` block: the kernel's high-water mark, restarted
    from the current resident set on entry, so no short peak is missed."""

    def __enter__(self) -> "ResidentRise":
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.before = status_bytes("VmRSS")
        return self

    def __exit__(self, *_) -> None:
        self.rise = status_bytes("VmHWM") - self.before


def run_layout(model_dir: str, out_dir: str, layout: str) -> tuple[dict, torch.nn.Module]:
    dp, tp = (int(size) for size in re.fullmatch(r"dp(\d+)tp(\d+)", layout).groups())
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(model_dir)
    parallelize(model, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"])
    load_weights(model, model_dir, device="cpu")
    # What the rank holds: FSDP pads an uneven chunk's storage to the size of the largest chunk.
    storages = [local_piece(param)[0].untyped_storage() for param in model.parameters()]
    shard_bytes = sum({storage._cdata: storage.nbytes() for storage in storages}.values())
    with ResidentRise() as control:  # the meter sees a copy of the shard, even one freed before it is read
        copies = [local_piece(param)[0].clone() for param in model.parameters()]
        del copies
    dist.barrier()
    started = time.perf_counter()
    with ResidentRise() as save:
        save_sharded_pretrained(
            model,
            f"{out_dir}/{layout}",
            stage=0,
            stage_ranks=list(range(dist.get_world_size())),
            writers_group=None,
            group=None,
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
            band_bytes=BAND_BYTES,
        )
    figures = {
        "shard_bytes": shard_bytes,
        "save_rise": save.rise,
        "shard_copy_rise": control.rise,
        "save_s": time.perf_counter() - started,
    }
    return figures, model


def export_figures(model_dir: str, out_dir: str, model: torch.nn.Module) -> dict:
    """Save the role's DCP state from every rank into a checkpoint that rank 0 stages and renames (as the recipes
    do), then export it on rank 0 alone, measured, while the other ranks wait."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the checkpoint is the model
    parts = dict(
        model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    )
    run_dir = Path(out_dir, "run")

    def save_actor(staging: Path) -> None:
        dist.barrier()  # the staging directory exists
        state_dir = checkpoint.role_state_dir(staging, "actor")
        checkpoint.save_role_state(state_dir, process_group=None, **parts)
        if dist.get_rank() == 0:
            checkpoint.save_model_config(state_dir, model, tokenizer_path=model_dir)

    if dist.get_rank() == 0:
        checkpoint.write_checkpoint(run_dir / "step_1", save_actor, trainer_state={"step": 1, "recipe": "test"})
    else:
        save_actor(run_dir / ("step_1" + checkpoint.STAGING_SUFFIX))
    dist.barrier()  # renamed
    figures = {}
    if dist.get_rank() == 0:
        AutoTokenizer.from_pretrained(model_dir)  # first-use imports are not the export's
        started = time.perf_counter()
        with ResidentRise() as export:
            checkpoint.export_hf(run_dir, Path(out_dir, "export"), dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
        figures = {"export_rise": export.rise, "export_s": time.perf_counter() - started}
    dist.barrier()
    return figures


def main() -> None:
    dist.init_process_group("gloo")
    model_dir, out_dir, *layouts = sys.argv[1:]
    figures = {}
    for layout in layouts:
        figures[layout], model = run_layout(model_dir, out_dir, layout)
    figures["export"] = export_figures(model_dir, out_dir, model)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        ranks = [
            {"rank": rank, **{key: value for key, value in by_rank.items()}} for rank, by_rank in enumerate(gathered)
        ]
        Path(out_dir, "figures.json").write_text(
            json.dumps({"band_bytes": BAND_BYTES, "bucket_bytes": BUCKET_BYTES, "ranks": ranks})
        )
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
