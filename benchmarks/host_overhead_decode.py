"""Host overhead of decode, counted exactly on CPU: ``python benchmarks/host_overhead.py --decode`` (this module holds
that side of ``host_overhead.py``).

A random qwen2-shaped model (hidden 64, ``--decode-layers`` layers, a 512-token vocabulary) in the generation copy's
layout (q/k/v and gate/up projections merged: ``merge_projections``) runs the real ``LLMEngine``. The counts take the
engine's CUDA attention path: on CPU decode attention would gather the cache (the pure-torch path), so the Triton
paged kernel is stood in for by what its wrapper dispatches on an H100 (its output, and split-K's partial results at
small batches) plus one call per launch (the kernel; split-K's combine is in it, ``PagedConfig.last_combines``); the
kernel stores the new tokens' K/V
itself (its fused write), so the cache write costs no call.
Figures, each with its goal from issue 34:

- dispatcher calls and non-view calls (about one kernel each on a GPU) per decode step in bf16: the eager engine
  step, the step a CUDA graph captures (``StaticDecodeStep._step``: trunk, LM head and sampler), and the work left
  outside the graph (input copies, the copy back, scheduler) for greedy and sampled rows; goal <= 500 kernels per
  step (graph + outside);
- host µs per decode step with the captured step replaced by a no-op (a stand-in graph whose replay does nothing),
  at batch 1 and ``--decode-batch`` rows, greedy and sampled, float32, the engine prepared for rows of
  ``--decode-max-len`` tokens as the rollout prepares it (this thread's CPU time, the best of 3 runs, the
  synchronous loop's beside it); goal <= 50 µs at batch 1 and <= 500 µs at batch 256;
- kernels per graphed decode step with what ``rollout.compile=on`` compiles (``engine.decode_compile``: the blocks
  around attention and the greedy draw; Inductor's C++ kernels on CPU, each counted as one launch, as in
  ``host_overhead.py --train``'s compiled figure), greedy, batch 1, bf16, plus the work outside the graph; goal <= 500;
- syncs per decode step in steady state (``aten._local_scalar_dense``: ``.item()``, ``int()``; and ``.tolist()``), with
  the lines that made them; goal 0. The engine's overlapped loop (``overlap_host``, the default) reads each graphed
  step's tokens one step late from a pinned buffer, waiting on an event after the next step is launched: counted
  apart as late reads, which leave the device busy; the synchronous loop (``overlap_host=False``) is shown beside it.

Steady state: the requests are prefilled and take one decode step in a first segment (``advance`` with
``segment_tokens=2``), then their last ``--decode-steps`` decode steps are measured, every row decoding to its length
limit (no EOS), the last step finishing them all.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch._inductor.config

from spmd_rlhf.engine import LLMEngine, SamplingParams, llm_engine
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep
from spmd_rlhf.engine.readback import PendingSamples
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, decode_splits
from spmd_rlhf.metrics.dispatch_counts import DispatchCounts, innermost_package_line
from spmd_rlhf.models import DecoderLM, attention
from spmd_rlhf.models.args import decoder_args
from spmd_rlhf.models.merged_linear import merge_projections

KERNEL_GOAL = 500
"""Kernels (non-view calls) per decode step in bf16, graphed step and the work outside it together."""
HOST_GOALS_US = {1: 50.0, 256: 500.0}
"""Host µs per decode step outside the graph, by batch size."""
HOST_TIME_REPEATS = 3
"""Host time is the best of this many runs: on a shared machine the other tenants only ever add time."""
PROMPT = [11, 12, 13, 14, 15, 16, 17]
COUNTED_MAX_LEN = 2048
"""Tokens per row the counted engines are prepared for, as a rollout prepares them: the block tables' width decides
the paged kernel's split-K at batch 1 (on an H100: split-K's partial results, combined in the same launch)."""


def decode_model(layers: int, dtype: torch.dtype) -> DecoderLM:
    """A random qwen2-shaped model (tied head, q/k/v biases) of ``layers`` layers in ``dtype``, its projections
    merged as the generation copy's are."""
    args = decoder_args(
        family="qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qkv_bias=True,
    )
    torch.manual_seed(0)
    model = DecoderLM(args, head="lm")
    model.reset_buffers()
    model = model.to(dtype).requires_grad_(False).eval()
    merge_projections(model)
    return model


STAND_IN_PROCESSORS = 132
"""The multiprocessors of an H100 SXM, for the stand-in's split-K choice (``decode_splits``)."""


def _kernel_stand_in(q, key_cache, value_cache, block_tables, context_lens, *, scale, **new_tokens):
    """What the wrapper dispatches on an H100: its output (and split-K's partial results), one call per launch. The
    new tokens' K/V (``new_tokens``) are stored by the kernel itself, and q and k rotated by it, so they cost no
    call."""
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    splits = decode_splits(q.shape[0] * kv_heads, block_tables.shape[1] * block_size, STAND_IN_PROCESSORS)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if splits > 1:
        partial = torch.empty((q.shape[0], kv_heads, splits), dtype=torch.float32, device=q.device)
        if not DEFAULT_PAGED_CONFIG.last_combines:
            partial.zero_()  # the attention kernel's launch writing partial results, before the combine kernel's
    return out.zero_()  # the launch writing the output (split-K's last programs combine inside the kernel)


@contextmanager
def cuda_attention_path() -> Iterator[None]:
    """Decode attention takes the branch it takes on CUDA (the Triton paged kernel, stood in for)."""
    saved = attention._is_triton_decode, attention.paged_decode_attention
    attention._is_triton_decode = lambda tokens, paged, backend, dtype, device: (
        paged.max_seqlen_q == 1 and tokens == paged.context_lens.shape[0]
    )
    attention.paged_decode_attention = _kernel_stand_in
    try:
        yield
    finally:
        attention._is_triton_decode, attention.paged_decode_attention = saved


class _NoOpGraph:
    def replay(self) -> None:
        pass


@contextmanager
def graphs_on_cpu(*, compute: bool) -> Iterator[None]:
    """Engines capture decode steps on CPU: a stand-in graph that replays the captured step (``compute``) or does
    nothing (the step replaced by a no-op, sampling token 0: what is left is the host's work outside the graph)."""

    def capture(step: StaticDecodeStep, key: tuple[int, int]) -> None:
        step.samples[key] = step._warm_up(key) if compute else torch.zeros(3, key[0])
        graph = _NoOpGraph()
        if compute:
            graph.replay = lambda: step.samples[key].copy_(step._step(*key))
        step.graphs[key] = graph

    saved = llm_engine.graphs_unsupported, StaticDecodeStep._capture
    llm_engine.graphs_unsupported = lambda model, block_size: None
    StaticDecodeStep._capture = capture
    try:
        yield
    finally:
        llm_engine.graphs_unsupported, StaticDecodeStep._capture = saved


class SyncCounts(DispatchCounts):
    """``DispatchCounts`` plus ``.tolist()`` calls (a device-to-host copy and a wait on a GPU, which on CPU
    dispatches nothing), with their sites among ``scalar_read_sites``, and ``late_reads``: samples read one step late
    (``PendingSamples.read``, a wait on the copy's event while the next step runs)."""

    def __enter__(self):
        self._tolist, self._read = torch.Tensor.tolist, PendingSamples.read
        self.late_reads = 0
        counts = self

        def tolist(tensor):
            counts.scalar_read_sites[f"tolist at {innermost_package_line()}"] += 1
            return counts._tolist(tensor)

        def read(pending):
            counts.late_reads += 1
            return counts._read(pending)

        torch.Tensor.tolist, PendingSamples.read = tolist, read
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, PendingSamples.read = self._tolist, self._read
        return super().__exit__(*exc)


def _params(sampled: bool, steps: int) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=1.0, max_new_tokens=steps + 2, seed=1)
    return SamplingParams(temperature=0, max_new_tokens=steps + 2)


def steady_decode(
    model: DecoderLM,
    *,
    rows: int,
    steps: int,
    sampled: bool,
    mode: str,
    measure,
    max_len: int = COUNTED_MAX_LEN,
    overlap: bool = True,
    compile_layers: str = "off",
) -> None:
    """Prefill ``rows`` requests and run one decode step (which captures its bucket's graph), then the last ``steps``
    decode steps inside ``measure`` (the last one finishes every request); ``overlap``: the engine's
    ``overlap_host``; ``compile_layers``: its ``rollout.compile``."""
    engine = LLMEngine(
        model,
        eos_token_id=None,
        block_size=16,
        max_num_seqs=rows,
        decode_graphs=mode,
        max_model_len=max(max_len, len(PROMPT) + steps + 2),
        overlap_host=overlap,
        compile_layers=compile_layers,
    )
    run = engine.start([PROMPT] * rows, _params(sampled, steps))
    engine.advance(run, segment_tokens=2)
    with measure:
        engine.advance(run)
    assert engine.stats.decode_steps == steps + 1 and engine.stats.prefill_steps == 1  # stats count the whole run


class _Timer:
    """CPU time of this thread: on a shared machine wall time also counts the other tenants' turns."""

    def __enter__(self):
        self.start = time.thread_time()

    def __exit__(self, *exc):
        self.seconds = time.thread_time() - self.start


@contextmanager
def _graph_counts(counts: DispatchCounts) -> Iterator[None]:
    """``counts`` active only inside ``StaticDecodeStep._step`` (what a graph captures)."""
    step_function = StaticDecodeStep._step

    def counted(step, rows, kind):
        with counts:
            return step_function(step, rows, kind)

    StaticDecodeStep._step = counted
    try:
        yield
    finally:
        StaticDecodeStep._step = step_function


GRAPHED_STEP = "graphed decode step"
"""The profiler's mark around each captured step, so launches are counted inside it only."""


class _Profiled:
    """A CPU profile of what runs inside it (``steady_decode``'s ``measure``)."""

    def __enter__(self):
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profile.__enter__()

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)


def compiled_graph_launches(layers: int, steps: int, *, backend: str = "inductor") -> Counter[str]:
    """Launches per graphed decode step (greedy, batch 1, bf16) with what ``rollout.compile=on`` compiles (the blocks
    around attention and the greedy draw, ``engine.decode_compile``) compiled by Inductor: the profiler's view inside
    each captured step (``host_overhead._launch_name``: non-view ATen ops and Inductor's kernels, none counted inside
    another), which ``DispatchCounts`` cannot give (TorchDynamo does not run a graph under a dispatch mode).
    ``backend``: TorchDynamo's (a test counts ``aot_eager``'s ATen calls: seconds, where Inductor's C++ compilation
    takes a minute)."""
    from host_overhead import _launch_name

    model = decode_model(layers, torch.bfloat16)
    step_function, choose_backend = StaticDecodeStep._step, llm_engine.compile_backend

    def marked(step, rows, kind):
        with torch.profiler.record_function(GRAPHED_STEP):
            return step_function(step, rows, kind)

    measure = _Profiled()
    StaticDecodeStep._step = marked
    llm_engine.compile_backend = lambda setting, graphs: backend
    # Kernel names reach the profiler only from code generated with this flag, so no cached graph may serve.
    profiled_kernels = {"cpp.enable_kernel_profile": True, "force_disable_caches": True}
    try:
        with torch._inductor.config.patch(profiled_kernels), cuda_attention_path(), graphs_on_cpu(compute=True):
            steady_decode(model, rows=1, steps=steps, sampled=False, mode="auto", measure=measure, compile_layers="on")
    finally:
        StaticDecodeStep._step, llm_engine.compile_backend = step_function, choose_backend
    launches: Counter[str] = Counter()
    for event in measure.profile.events():
        name = _launch_name(event)
        parent = event.cpu_parent
        while parent is not None and parent.name != GRAPHED_STEP:
            parent = parent.cpu_parent
        if name is not None and parent is not None:
            launches[name] += 1
    return Counter({name: count / steps for name, count in launches.items()})


def _figure(name: str, value, goal: str, meets: bool | None, **details) -> dict:
    return {"figure": name, "value": value, "goal": goal, "meets_goal": meets, **details}


def decode_figures(args: argparse.Namespace) -> list[dict]:
    layers, steps = args.decode_layers, args.decode_steps
    figures = []
    with cuda_attention_path():
        bf16 = decode_model(layers, torch.bfloat16)
        eager = DispatchCounts()
        steady_decode(bf16, rows=1, steps=steps, sampled=False, mode="off", measure=eager)
        graphed, outside = {}, {}
        for sampled in (False, True):
            graphed[sampled] = DispatchCounts()
            with graphs_on_cpu(compute=True):
                measure = _graph_counts(graphed[sampled])
                steady_decode(bf16, rows=1, steps=steps, sampled=sampled, mode="auto", measure=measure)
            outside[sampled] = DispatchCounts()
            with graphs_on_cpu(compute=False):
                steady_decode(bf16, rows=1, steps=steps, sampled=sampled, mode="auto", measure=outside[sampled])
    shape = f"batch 1, {layers} layers, bf16, per decode step"
    paths = {"engine eager": eager}
    for sampled, label in ((False, "greedy"), (True, "sampled")):
        paths |= {f"graphed step, {label}": graphed[sampled], f"outside the graph, {label}": outside[sampled]}
    for path, counts in paths.items():
        details = {"by_op": {name: n / steps for name, n in sorted(counts.calls.items())}} if "outside" in path else {}
        figures.append(_figure(f"dispatcher calls per step, {path}", counts.total_calls / steps, "none", None))
        figures.append(
            _figure(f"non-view calls per step, {path}", counts.non_view_calls / steps, "none", None, **details)
        )
    for sampled, label in ((False, "greedy"), (True, "sampled")):
        kernels = (graphed[sampled].non_view_calls + outside[sampled].non_view_calls) / steps
        figures.append(
            _figure(
                f"kernels per graphed step, {label}",
                kernels,
                f"<= {KERNEL_GOAL}",
                kernels <= KERNEL_GOAL,
                shape=shape,
                note="non-view calls of the graphed step plus those outside the graph",
            )
        )
    if args.decode_compiled:
        compiled = compiled_graph_launches(layers, steps)
        kernels = sum(compiled.values()) + outside[False].non_view_calls / steps
        figures.append(
            _figure(
                "kernels per graphed step, greedy, rollout.compile=on",
                kernels,
                f"<= {KERNEL_GOAL}",
                kernels <= KERNEL_GOAL,
                shape=shape,
                by_op=dict(sorted(compiled.items())),
                note="the captured step's launches by the profiler (Inductor's kernels one each) plus the non-view "
                "calls outside the graph; rollout.compile=on",
            )
        )
    float32 = decode_model(layers, torch.float32)
    for rows in (1, args.decode_batch):
        goal = HOST_GOALS_US.get(rows)
        for sampled, label in ((False, "greedy"), (True, "sampled")):
            seconds = {True: [], False: []}
            for _ in range(HOST_TIME_REPEATS):
                for overlap in seconds:  # alternating, so both loops meet the same load on a shared machine
                    timer = _Timer()
                    with graphs_on_cpu(compute=False):
                        steady_decode(
                            float32,
                            rows=rows,
                            steps=steps,
                            sampled=sampled,
                            mode="auto",
                            measure=timer,
                            max_len=args.decode_max_len,
                            overlap=overlap,
                        )
                    seconds[overlap].append(timer.seconds)
            micros = min(seconds[True]) / steps * 1e6
            figures.append(
                _figure(
                    f"host µs per step, graph a no-op, batch {rows}, {label}",
                    round(micros, 1),
                    "none" if goal is None else f"<= {goal:g}",
                    None if goal is None else micros <= goal,
                    shape=(
                        f"batch {rows}, float32, engine prepared for rows of {args.decode_max_len} tokens, mean of "
                        f"{steps} decode steps, best of {HOST_TIME_REPEATS} runs"
                    ),
                    note=f"synchronous loop (overlap_host=False) in the same run: "
                    f"{min(seconds[False]) / steps * 1e6:.1f} µs",
                )
            )
    loops = (("off", True, "eager"), ("auto", False, "graphed, synchronous loop"), ("auto", True, "graphed"))
    for mode, overlap, label in loops:
        syncs = SyncCounts()
        with cuda_attention_path(), graphs_on_cpu(compute=True):
            steady_decode(float32, rows=4, steps=steps, sampled=True, mode=mode, measure=syncs, overlap=overlap)
        figures.append(
            _figure(
                f"syncs per step, {label}",
                syncs.scalar_reads / steps,
                "0 in steady state",
                syncs.scalar_reads == 0,
                shape="batch 4, sampled",
                sites={site: count / steps for site, count in syncs.scalar_read_sites.items()},
                late_reads=syncs.late_reads / steps,
            )
        )
    return figures


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode-layers", type=int, default=28, help="model depth of the decode counts")
    parser.add_argument("--decode-batch", type=int, default=256, help="the large batch of the host-time figure")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps measured per figure")
    parser.add_argument(
        "--no-decode-compiled",
        dest="decode_compiled",
        action="store_false",
        help="skip the compiled blocks' kernel count (Inductor's C++ compilation takes a minute on CPU)",
    )
    parser.add_argument(
        "--decode-max-len",
        type=int,
        default=2048,
        help="the longest row the engine is prepared for in the host-time figures (what the rollout sets: "
        "data.max_prompt_length + the response length); it sets the static decode step's block-table width",
    )


def decode_result(args: argparse.Namespace, figures: list[dict]) -> dict:
    return {
        "benchmark": "host_overhead --decode",
        "layers": args.decode_layers,
        "batch": args.decode_batch,
        "steps": args.decode_steps,
        "max_len": args.decode_max_len,
        "attention": (
            "the CUDA path: the Triton paged decode kernel stood in for as on an H100 (split-K at small batches, the "
            "K/V write fused)"
        ),
        "figures": figures,
    }
