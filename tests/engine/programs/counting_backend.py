"""A TorchDynamo backend for tests: runs each FX graph as traced (what ``aot_eager`` checks, without Inductor's code
generation, which needs minutes of C++ compilation on CPU), counting the graphs compiled and the calls made through
them, and noting which graphs hold collectives and which functions and methods the graphs call (``targets``, over
all graphs)."""

from __future__ import annotations

from collections import Counter

import torch


class CountingBackend:
    def __init__(self) -> None:
        self.graphs, self.calls, self.collective_graphs = 0, 0, 0
        self.targets: Counter[str] = Counter()

    def __call__(self, graph: torch.fx.GraphModule, example_inputs) -> callable:
        self.graphs += 1
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        self.targets.update(
            str(node.target) for node in graph.graph.nodes if node.op in ("call_function", "call_method")
        )
        self.collective_graphs += any("_c10d_functional" in target for target in targets)

        def run(*inputs):
            self.calls += 1
            return graph.forward(*inputs)

        return run
