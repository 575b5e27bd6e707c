"""Peak memory of the streamed Hugging Face save and of export from DCP, on a ~155 MB float32 model sharded over 4
gloo ranks in (dp, tp) = (4, 1) and (2, 2), so each rank holds a quarter of it (~39 MB; the 2-D layout's norms,
replicated over TP, add a few KB):

- saving in bfloat16 in 1 MiB row bands raises each rank's resident set (which already holds its shard) by at most
  the bands the save documents (three on the writer, one on a rank that only sends) plus a small slack: the rank's
  peak is its shard plus a bucket, never a second shard, let alone the model;
- exporting the DCP state those ranks saved, in one process in 4 MiB buckets, raises it by at most a bucket, one
  saved chunk and one converted tensor, plus the same slack;
- a copy of the shard made and freed inside the measurement does show: the meter would see a transient copy;
- both saves and the export load in transformers equal to the model (bfloat16-rounded for the saves).

The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps every allocation of 64 KiB or more on its own
and unmaps it when freed, so the resident set follows the live tensors instead of the allocator's reuse of freed
heap.
"""

from __future__ import annotations

import json

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny

LAYOUTS = ["dp4tp1", "dp2tp2"]
WORLD = 4
RESIDENT_SLACK = 4 * 2**20
"""Growth of the resident set allowed besides the bands and buckets: the JSON piece map, gloo's transport buffers,
the safetensors header and DCP's read plan, and allocator pages of the Python objects made meanwhile. A quarter of
one rank's shard (~39 MB) would not fit, nor would the model in bfloat16 (~78 MB)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_memory")
    model_dir = make_tiny(
        family="llama",
        out_dir=str(root / "model"),
        hidden_size=512,
        intermediate_size=1536,
        num_layers=12,
        num_heads=8,
        num_kv_heads=4,
        model_vocab_size=1024,
    )
    out = root / "out"
    out.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
        finished = torchrun("save_memory.py", model_dir, str(out), *LAYOUTS, nproc=WORLD, timeout=400)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return model_dir, out, json.loads((out / "figures.json").read_text())


def model_bytes(model_dir: str) -> tuple[int, int]:
    """(bytes of all tensors of the float32 checkpoint, bytes of its largest tensor)."""
    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as handle:
        sizes = [torch.Size(handle.get_slice(name).get_shape()).numel() * 4 for name in handle.keys()]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_holds_shard_plus_bands(run, layout):
    model_dir, _, result = run
    total, _ = model_bytes(model_dir)
    band = result["band_bytes"]
    for figures in result["ranks"]:
        measured = figures[layout]
        assert total > (WORLD - 0.01) * measured["shard_bytes"] and total > 150 * 10**6, measured
        # The meter sees what a rank copies: a copy of its shard, freed again, raised the high-water mark by the shard.
        assert measured["shard_copy_rise"] > 0.95 * measured["shard_bytes"], measured
        bands = 3 if figures["rank"] == 0 else 1  # rank 0 writes: a band assembled, a piece received, one converted
        assert measured["save_rise"] < bands * band + RESIDENT_SLACK < measured["shard_bytes"] / 2, measured


def test_export_holds_a_bucket(run):
    model_dir, _, result = run
    total, largest_tensor = model_bytes(model_dir)
    exporter = result["ranks"][0]["export"]
    # One bucket of saved tensors, one saved chunk being read and one tensor converted.
    bound = result["bucket_bytes"] + 2 * largest_tensor + RESIDENT_SLACK
    assert exporter["export_rise"] < bound < total / 8, (exporter, bound)


def test_saved_and_exported_directories_load_in_transformers(run):
    from transformers import AutoModelForCausalLM

    model_dir, out, _ = run
    source = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for directory, dtype in [
        *((out / layout, torch.bfloat16) for layout in LAYOUTS),
        (out / "export" / "actor", torch.float32),
    ]:
        loaded = AutoModelForCausalLM.from_pretrained(str(directory))
        assert loaded.dtype == dtype, directory
        weights = loaded.state_dict()
        assert weights.keys() == source.keys()
        for name, tensor in source.items():
            assert torch.equal(weights[name], tensor.to(dtype)), (directory, name)
