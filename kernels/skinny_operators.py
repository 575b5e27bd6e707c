"""The skinny-linear functions (``kernels.skinny_linear``) as ``torch.ops.spmd_rlhf`` operators, which TorchDynamo and
Inductor leave opaque: a compiled decoder block calls each as one call and a CUDA graph captures it. Importing this
module registers them; ``engine.decode_matmul``, which points a model's projections at them, imports it. ``tiling``:
``SkinnyConfig.as_tiling()``. The functions are looked up on their module at each call (tests wrap them there to
count the calls)."""

from __future__ import annotations

import torch

import spmd_rlhf.kernels.skinny_linear as functions


@torch.library.custom_op("spmd_rlhf::skinny_linear", mutates_args=())
def skinny_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str, tiling: list[int]
) -> torch.Tensor:
    return functions.skinny_linear(x, weight, bias, backend=backend, config=functions.config_of(tiling))


@skinny_linear_op.register_fake
def _(x, weight, bias, backend, tiling) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("spmd_rlhf::skinny_norm_linear", mutates_args=())
def skinny_norm_linear_op(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    tiling: list[int],
) -> torch.Tensor:
    return functions.skinny_norm_linear(
        x, norm_weight, eps, weight, bias, backend=backend, config=functions.config_of(tiling)
    )[1]


@skinny_norm_linear_op.register_fake
def _(x, norm_weight, eps, weight, bias, backend, tiling) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("spmd_rlhf::skinny_residual_norm_linear", mutates_args=())
def skinny_residual_norm_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: str,
    tiling: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return functions.skinny_norm_linear(
        x, norm_weight, eps, weight, bias, residual=residual, backend=backend, config=functions.config_of(tiling)
    )


@skinny_residual_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight, bias, backend, tiling) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("spmd_rlhf::skinny_silu_mul_linear", mutates_args=())
def skinny_silu_mul_linear_op(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str, tiling: list[int]
) -> torch.Tensor:
    return functions.skinny_silu_mul_linear(gate_up, weight, bias, backend=backend, config=functions.config_of(tiling))


@skinny_silu_mul_linear_op.register_fake
def _(gate_up, weight, bias, backend, tiling) -> torch.Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))
