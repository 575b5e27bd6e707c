"""The rule that picks a kernel's Triton or torch path, and the errors when Triton is asked for and cannot run."""

from __future__ import annotations

import pytest
import torch

import spmd_rlhf.kernels.triton_support as triton_support
from spmd_rlhf.kernels.triton_support import use_triton

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_takes_triton_for_cuda_tensors_only_and_torch_never(monkeypatch):
    monkeypatch.setattr(triton_support, "triton", object())
    assert use_triton(CUDA, "auto") and not use_triton(CPU, "auto")
    assert not use_triton(CUDA, "torch")
    monkeypatch.setattr(triton_support, "triton", None)
    assert not use_triton(CUDA, "auto"), "without triton every wrapper falls back to its torch reference"


def test_forcing_triton_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(triton_support, "triton", object())
    monkeypatch.setattr(triton_support, "INTERPRETING", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton(CPU, "triton")
    assert use_triton(CUDA, "triton")
    monkeypatch.setattr(triton_support, "INTERPRETING", True)
    assert use_triton(CPU, "triton")
    monkeypatch.setattr(triton_support, "triton", None)
    with pytest.raises(ValueError, match="pip install triton"):
        use_triton(CUDA, "triton")


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="kernel backend 'cuda' is unknown; choose one of auto, triton, torch"):
        use_triton(CPU, "cuda")


def test_dependent_launch_is_a_launch_option_on_cuda_and_refused_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_support, "INTERPRETING", False)
    assert triton_support.dependent_launch_option(True) == {"launch_pdl": True}
    assert triton_support.dependent_launch_option(False) == {}
    monkeypatch.setattr(triton_support, "INTERPRETING", True)
    assert triton_support.dependent_launch_option(False) == {}
    with pytest.raises(ValueError, match="dependent_launch needs CUDA"):
        triton_support.dependent_launch_option(True)
