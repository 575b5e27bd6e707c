"""Measure this machine's rates for the cost model: matmul FLOP/s, memory copy bytes/s, per-op and per-collective
latency, and all-gather bandwidth between two local processes.

    spmd-rlhf calibrate [--out ~/.cache/spmd_rlhf/device_profile.json] [--quick] [--inter-node-gbps 400]

On CPU each process runs one thread, as the multi-rank jobs do (``OMP_NUM_THREADS=1``). On a machine with one GPU no
device-to-device link can be measured: the links are then taken from the built-in profile whose name matches the GPU,
and say so in ``source``. The network between nodes cannot be measured from one node either; pass its per-device
rate (``--inter-node-gbps``), else the within-node rate stands in for it.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rlhf.collectives import all_gather_flat
from spmd_rlhf.mapping.cost import OPS_PER_LAYER
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES, DeviceProfile, default_profile_path, load_profile
from spmd_rlhf.runtime.device import bind_thread

_JOIN_TIMEOUT_S = 120.0


def _best_seconds(run: Callable[[], object], *, repeats: int, sync: Callable[[], None]) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    run()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, *, size: int, repeats: int = 3) -> float:
    """FLOP/s of one ``[size, size] @ [size, size]`` matmul (2·size³ FLOPs)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats=repeats, sync=_sync_for(device))


def measure_copy_bandwidth(device: torch.device, *, num_bytes: int, repeats: int = 3) -> float:
    """Bytes/s moved by a device-memory copy (each byte read once and written once)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / _best_seconds(lambda: target.copy_(source), repeats=repeats, sync=_sync_for(device))


def _probe_model(device: torch.device, dtype: torch.dtype):
    """A tiny decoder of the framework's own code (4 layers, hidden 64): small enough that only per-op and
    per-collective costs show."""
    from spmd_rlhf.models.args import decoder_args
    from spmd_rlhf.models.decoder import DecoderLM

    args = decoder_args(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    return DecoderLM(args, head="lm").to(device=device, dtype=dtype)


def measure_op_latency(device: torch.device, dtype: torch.dtype) -> float:
    """Seconds per kernel of the framework's own decoder: one-token forwards of the probe model divided by the
    kernels they run (``OPS_PER_LAYER`` per layer). Includes the module and dispatch overhead a bare tensor op
    would not show."""
    model = _probe_model(device, dtype).eval()
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    calls = 50

    def forwards() -> None:
        with torch.inference_mode():
            for _ in range(calls):
                model(token)

    return _best_seconds(forwards, repeats=3, sync=_sync_for(device)) / calls / (model.args.num_layers * OPS_PER_LAYER)


def measure_fsdp_collective_seconds(device: torch.device, dtype: torch.dtype, world_size: int) -> float:
    """Seconds one FSDP collective costs in practice (hooks, copies, the collective itself) for a tiny message:
    a forward + backward of the probe model sharded per layer over the world, minus the same unsharded, divided by
    its collectives (an all-gather forward, one backward and a reduce-scatter per FSDP unit). Call on every rank."""
    from torch.distributed.fsdp import fully_shard

    tokens = torch.zeros(1, 8, dtype=torch.long, device=device)
    sync = _sync_for(device)

    def step_seconds(model: torch.nn.Module) -> float:
        def step() -> None:
            model(tokens).sum().backward()

        return _best_seconds(step, repeats=5, sync=sync)

    local = step_seconds(_probe_model(device, dtype))
    sharded = _probe_model(device, dtype)
    for layer in sharded.model.layers.values():
        fully_shard(layer)
    fully_shard(sharded)
    units = sharded.args.num_layers + 1
    return max(0.0, step_seconds(sharded) - local) / (3 * units)


def _link_worker(rank: int, world_size: int, port: int, backend: str, num_bytes: int, out: str) -> None:
    """One of the spawned processes: all-gather ``num_bytes`` per rank, time tiny all-reduces and FSDP's per-layer
    collectives; rank 0 writes ``(bandwidth, latency)`` to ``out``."""
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    bind_thread(device)
    timeout = datetime.timedelta(seconds=_JOIN_TIMEOUT_S)
    # An explicit store: under torchrun (placement=auto calibrating at start) a tcp:// init would defer to the
    # elastic agent's store (TORCHELASTIC_USE_AGENT_STORE), which these processes are not part of.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        sync = _sync_for(device)
        piece = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        gathered = torch.empty(num_bytes * world_size, dtype=torch.uint8, device=device)
        seconds = _best_seconds(lambda: all_gather_flat(gathered, piece), repeats=3, sync=sync)
        # Each rank sends its piece to the world_size - 1 others (ring: (w - 1)/w of the gathered bytes).
        bandwidth = num_bytes * (world_size - 1) / seconds
        tiny = torch.zeros(1, device=device)
        calls = 50
        # A ring all-reduce takes 2·(world_size - 1) steps.
        steps = 2 * (world_size - 1)
        latency = (
            _best_seconds(lambda: [dist.all_reduce(tiny) for _ in range(calls)], repeats=3, sync=sync) / calls / steps
        )
        # What a collective costs through FSDP, per ring step, when that is more than the bare collective.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        latency = max(latency, measure_fsdp_collective_seconds(device, dtype, world_size) / (world_size - 1))
        if rank == 0:
            with open(out + ".tmp", "w") as file:
                file.write(f"{bandwidth} {latency}")
            os.replace(out + ".tmp", out)  # complete or absent, never half-written
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: a thread FSDP's collectives leave joinable can abort it ("terminate called without
    # an active exception", seen in CI) after the measurement is safely written.
    os._exit(0)


def measure_link(*, backend: str, num_bytes: int, world_size: int = 2) -> tuple[float, float]:
    """(all-gather bytes/s sent per device, seconds per ring step of a small collective: a bare all-reduce or,
    when more, one through FSDP) between ``world_size`` local processes."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "link.txt")
        context = mp.start_processes(
            _link_worker,
            args=(world_size, port, backend, num_bytes, out),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"link calibration did not finish within {_JOIN_TIMEOUT_S:.0f} s ({backend})")
        except mp.ProcessExitedException:
            if not os.path.exists(out):
                raise
            # A worker died after the measurement was written (teardown): the figures stand.
        with open(out) as file:
            bandwidth, latency = map(float, file.read().split())
    return bandwidth, latency


def calibrate(
    *, quick: bool = False, dtype: torch.dtype | None = None, inter_node_bandwidth: float | None = None
) -> DeviceProfile:
    """Measure this machine and return its profile (CPU if no GPU is visible; bf16 on GPU, float32 on CPU)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)  # as each rank of a CPU job runs
    try:
        flops = measure_matmul_flops(
            device, dtype, size=(4096 if on_gpu else 384) if quick else (8192 if on_gpu else 1024)
        )
        # On CPU the copy must outgrow the caches even when quick: 16 MiB measured 49 GB/s on a VM whose memory
        # streams at 16 GB/s (128 MiB and 512 MiB), and decode reads weights from memory, not cache.
        copy = measure_copy_bandwidth(device, num_bytes=(2**30 if quick else 2**32) if on_gpu else 2**27)
        op_latency = measure_op_latency(device, dtype)
    finally:
        torch.set_num_threads(threads)
    name = torch.cuda.get_device_name().lower() if on_gpu else "cpu"
    gpus = torch.cuda.device_count() if on_gpu else 0
    source = f"calibrated on {socket.gethostname()}, {datetime.date.today().isoformat()}"
    if on_gpu and gpus < 2:
        known = next((profile for key, profile in BUILTIN_PROFILES.items() if key in name), None)
        if known is None:
            raise RuntimeError(
                f"one GPU ({name}) and no built-in profile for it: the device link cannot be measured here; run "
                f"`spmd-rlhf calibrate` on a machine with 2+ GPUs of this kind"
            )
        link = known.link_bandwidth(across_nodes=False)
        latency = known.collective_latency
        source += f"; links from the {known.name} datasheet profile (one GPU: no link to measure)"
    else:
        link, latency = measure_link(
            backend="nccl" if on_gpu else "gloo", num_bytes=(2**26 if quick else 2**28) if on_gpu else 2**22
        )
    memory = torch.cuda.get_device_properties(device).total_memory if on_gpu else _host_memory_bytes()
    return DeviceProfile(
        name=name,
        peak_flops=flops,
        memory_bandwidth=copy,
        intra_node_bandwidth=link,
        inter_node_bandwidth=inter_node_bandwidth or link,
        device_memory=float(memory),
        collective_latency=latency,
        op_latency=op_latency,
        shared_cores=0 if on_gpu else len(os.sched_getaffinity(0)),
        overlaps_communication=on_gpu,
        source=source,
    )


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_profile(choice: str) -> DeviceProfile:
    """``auto``: the calibrated profile at ``default_profile_path()`` if there is one, else the built-in profile whose
    name is in the visible GPU's name, else a quick calibration of this machine (CPU); anything else:
    ``load_profile``."""
    if choice != "auto":
        return load_profile(choice)
    if (path := default_profile_path()).is_file():
        return load_profile(path)
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name().lower()
        for name, profile in BUILTIN_PROFILES.items():
            if name in gpu:
                return profile
    return calibrate(quick=True)
