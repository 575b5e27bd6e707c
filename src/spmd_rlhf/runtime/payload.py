"""Control-plane payloads: pickled, counted, and kept small.

Everything the coordinator sends or receives over RPC goes through ``dumps``, which refuses tensors above
``MAX_TENSOR_BYTES``: per-token data belongs on the data plane (a ``Batch`` through a data-parallel method, or
``Coordinator.put``), never in an RPC message.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

MAX_TENSOR_BYTES = 4096


class PayloadError(ValueError):
    pass


class _SmallTensorPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, what: str) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._what = what

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > MAX_TENSOR_BYTES:
            raise PayloadError(
                f"{self._what} carries a tensor of shape {list(obj.shape)} ({obj.numel() * obj.element_size()} bytes); "
                f"RPC messages take tensors up to {MAX_TENSOR_BYTES} bytes. Put per-row data in a Batch and pass it "
                f"through a data-parallel method (or Coordinator.put) so it moves on the data plane"
            )
        return NotImplemented


def dumps(obj: Any, *, what: str) -> bytes:
    """Pickle ``obj`` for an RPC message; ``what`` names it in the error if it carries a large tensor."""
    buffer = io.BytesIO()
    _SmallTensorPickler(buffer, what).dump(obj)
    return buffer.getvalue()
