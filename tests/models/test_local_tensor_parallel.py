"""The generation copy's tensor parallelism on local tensors (``programs/local_tensor_parallel.py``): equal to the
whole model and to the DTensor path for tied, q/k-normed and mixture-of-experts families."""

from __future__ import annotations

from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny


def test_local_shards_with_explicit_collectives_equal_the_whole_model(tmp_path):
    common = dict(hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300)
    paths = [
        make_tiny(family=family, out_dir=str(tmp_path / family), **common) for family in ("qwen2", "qwen3", "qwen3_moe")
    ]
    finished = torchrun("local_tensor_parallel.py", *paths, nproc=2, timeout=180, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    assert "local tensor parallelism matches" in finished.stdout
