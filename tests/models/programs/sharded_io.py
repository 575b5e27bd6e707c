"""Sharded loading and the streamed Hugging Face save, per layout on 4 gloo ranks: the bytes each rank reads from
the checkpoint, its loaded pieces against a single-process load, and the peak memory of writing the model back in
bfloat16 (tensor storages with ``PeakMemory``, and the process's resident-set high-water mark) in row bands of
``BAND_BYTES``. Writes ``OUT_DIR/<layout>.json`` (every rank's figures) and ``OUT_DIR/<layout>/`` (the copy).

    torchrun --nproc-per-node 4 tests/models/programs/sharded_io.py MODEL_DIR OUT_DIR dp2tp2pp1 dp4tp1pp1 dp1tp2pp2
"""

import json
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.metrics.peak_memory import PeakMemory
from spmd_rlhf.models import load_model
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.pipeline import split_stage
from spmd_rlhf.models.shard_pieces import local_piece
from spmd_rlhf.models.sharded_save import save_sharded_pretrained
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.runtime import end_process

BAND_BYTES = 256 * 1024


def resident_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_layout(model_dir: str, out_dir: str, layout: str, reference: dict[str, torch.Tensor]) -> None:
    dp, tp, pp = (int(size) for size in re.fullmatch(r"dp(\d+)tp(\d+)pp(\d+)", layout).groups())
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    model = split_stage(build_model(model_dir), stage=stage, pp=pp)
    parallelize(model, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"])
    bytes_read = load_weights(model, model_dir, device="cpu")
    for name, param in model.named_parameters():
        local, piece = local_piece(param)
        torch.testing.assert_close(local, reference[name][piece.slices()], rtol=0, atol=0, msg=f"{layout} {name}")
    # What the rank holds: FSDP pads an uneven chunk's storage to the size of the largest chunk.
    storages = [local_piece(param)[0].untyped_storage() for param in model.parameters()]
    shard_bytes = sum({storage._cdata: storage.nbytes() for storage in storages}.values())

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the high-water mark restarts from the current resident set
    resident_before = resident_bytes("VmRSS")
    with PeakMemory(torch.device("cpu")) as tensors:
        save_sharded_pretrained(
            model,
            f"{out_dir}/{layout}",
            stage=stage,
            stage_ranks=mesh.mesh[stage].flatten().tolist(),
            writers_group=mesh["pp"].get_group() if pp > 1 else None,
            group=None,
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
            band_bytes=BAND_BYTES,
        )
    figures = {
        "rank": dist.get_rank(),
        "bytes_read": bytes_read,
        "shard_bytes": shard_bytes,
        "save_tensor_peak": tensors.peak_increase,
        "save_resident_peak": resident_bytes("VmHWM") - resident_before,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if dist.get_rank() == 0:
        with open(f"{out_dir}/{layout}.json", "w") as handle:
            json.dump({"band_bytes": BAND_BYTES, "ranks": gathered}, handle)


def main() -> None:
    dist.init_process_group("gloo")
    model_dir, out_dir, *layouts = sys.argv[1:]
    reference = dict(load_model(model_dir).named_parameters())
    for layout in layouts:
        run_layout(model_dir, out_dir, layout, reference)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
