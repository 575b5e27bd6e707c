import os
import sys

import pytest

from spmd_rlhf.engine import llm_engine
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep

# The Hugging Face checkpoint fixtures live in tests/models; make them importable whatever directory pytest starts in.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "models"))


class ReplayGraph:
    """A stand-in CUDA graph on CPU: replay runs the captured step (trunk, LM head, sampler) of ``key`` (rows,
    sampling kind) on whatever the buffers hold then, into the output the capture made."""

    def __init__(self, step: StaticDecodeStep, key: tuple[int, int]) -> None:
        self.step, self.key = step, key
        step.samples[key] = step._warm_up(key)

    def replay(self) -> None:
        self.step.samples[self.key].copy_(self.step._step(*self.key))


@pytest.fixture
def replayed_graphs(monkeypatch):
    """Engines with ``decode_graphs="auto"`` capture ``ReplayGraph``s on CPU: the path of CUDA graphs."""
    monkeypatch.setattr(llm_engine, "graphs_unsupported", lambda model, block_size: None)
    monkeypatch.setattr(
        StaticDecodeStep, "_capture", lambda step, key: step.graphs.__setitem__(key, ReplayGraph(step, key))
    )
