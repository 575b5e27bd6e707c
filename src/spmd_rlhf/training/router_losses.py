"""The routers' auxiliary losses and expert-load metrics of a mixture-of-experts model in training.

Per MoE layer ``l`` with router probabilities ``p = softmax(logits)`` over ``E`` experts and the top-k choices of the
micro-batch's ``T`` real tokens (padding excluded):

    load balancing (Switch, Mixtral):  L_aux,l = E * sum_e f_e * P_e,   f_e = (token choices of e) / T,
                                                                          P_e = mean_t p_t,e
    z-loss (ST-MoE):                    L_z,l   = mean_t logsumexp(logits_t)^2

each averaged over the MoE layers. For one layer ``L_aux`` is transformers' ``load_balancing_loss_func`` (which, over
several layers, pools the layers' tokens before the product instead). Uniform routing gives ``L_aux = k``.

``RouterLosses`` sees each router's ``Routing`` through a forward hook (the model stays free of training logic) and
turns the routings of one micro-batch forward into its share of these losses, weighted by the role's
``router_aux_loss_coef`` / ``router_z_loss_coef``, and into device metrics: nothing is read back to the host.

Under context parallelism each rank of a ``cp`` group routes one chunk of the micro-batch's row. The losses are then
the whole row's: one all-reduce over the group adds up every layer's token choices per expert, the probability and
squared log-sum-exp sums and the real tokens (``_layer_sums``); each rank back-propagates its own tokens' terms
against those totals (``E * sum_e f_e * P_e,local`` and ``sum_local lse^2 / T``: the counts ``f`` being constants,
the ranks' terms add up to the losses above, and each rank's gradient is its own tokens'), and the metrics are the
whole row's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from spmd_rlhf.config import TrainableRoleConfig
from spmd_rlhf.models.args import DecoderArgs
from spmd_rlhf.models.moe import Routing, TopKRouter


def load_balancing_loss(routing: Routing, num_experts: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the tokens where ``token_mask`` ``[tokens]`` is set (all without one); float32,
    differentiable through the router probabilities (the counts ``f`` are constants, as in Switch). What
    ``RouterLosses.take`` computes per layer (from the same ``_layer_sums``)."""
    choices, probabilities, _ = _layer_sums(routing, num_experts, token_mask)
    tokens = _tokens(routing, token_mask)
    return num_experts * (choices / tokens * probabilities / tokens).sum()


def z_loss(routing: Routing, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` over the tokens where ``token_mask`` is set; float32."""
    return _layer_sums(routing, routing.logits.shape[-1], token_mask)[2] / _tokens(routing, token_mask)


def _tokens(routing: Routing, token_mask: torch.Tensor | None) -> torch.Tensor:
    """The tokens that count (``token_mask``'s set ones, else all), at least 1, as a float32 0-dim tensor."""
    device = routing.logits.device
    if token_mask is None:
        # Filled on the device (a tensor made from a host value would be a blocking copy to a GPU: a wait per call).
        return torch.full((), float(max(routing.logits.shape[0], 1)), device=device)
    return token_mask.to(device, torch.float32).sum().clamp(min=1.0)


def router_coefficients(role: str, role_config: TrainableRoleConfig, args: DecoderArgs) -> tuple[float, float]:
    """The role's (load-balancing, z-loss) coefficients for the model ``args``: ``router_aux_loss_coef`` null takes
    the model config's own. A nonzero one on a dense model is refused, naming the key."""
    aux, z = role_config.router_aux_loss_coef, role_config.router_z_loss_coef
    if args.moe is None:
        for key, value in (("router_aux_loss_coef", aux), ("router_z_loss_coef", z)):
            if value:
                raise ValueError(
                    f"{role}.{key}={value} needs a mixture-of-experts model, but {args.family} is dense; remove it"
                )
        return 0.0, 0.0
    return (args.moe.router_aux_loss_coef if aux is None else aux), z


class RouterLosses:
    """Forward hooks on every ``TopKRouter`` of ``model`` that keep the routings of the current training forward
    (cleared when the decoder's next forward starts, whether through the root or, under context parallelism, through
    ``hidden_states``; ``take`` stops the recording, so an activation-checkpointing recompute in the backward is never
    counted), and the micro-batch's router loss and metrics from them."""

    def __init__(self, model: nn.Module, num_experts: int, *, aux_coef: float, z_coef: float) -> None:
        self.num_experts, self.aux_coef, self.z_coef = num_experts, aux_coef, z_coef
        self.routings: list[Routing] = []
        self._recording = False
        model.model.register_forward_pre_hook(self._start)
        self.layers: list[str] = []
        """Each router's decoder layer index, in the order the forward meets them."""
        for index, layer in model.model.layers.items():
            for module in layer.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._record)
                    self.layers.append(index)

    def _start(self, module: nn.Module, inputs: object) -> None:
        self.routings.clear()
        self._recording = module.training

    def _record(self, module: nn.Module, inputs: object, routing: Routing) -> None:
        if self._recording:
            self.routings.append(routing)

    def take(
        self,
        share: float,
        prefix: str,
        *,
        token_mask: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
        """From the last forward's routings: the loss to back-propagate, ``share * (aux_coef * L_aux + z_coef *
        L_z)`` (None when both coefficients are 0), its whole value (detached; the same without ``group``), and the
        metrics ``<prefix>/router_aux_loss``, ``<prefix>/router_z_loss`` (unweighted, layer means),
        ``<prefix>/expert_load_max_over_mean`` (the worst layer) and ``<prefix>/expert_load_max_over_mean/layer_<i>``
        (MoE layer ``i``'s: the most token choices any of its experts got over the mean per expert), as 0-dim device
        tensors. ``share``: the micro-batch's part of the mini-batch (its rows over the mini-batch's rows on all DP
        ranks). ``token_mask`` ``[tokens]``: the routed tokens that count (padding excluded). ``group``: the
        context-parallel group whose ranks routed the other chunks of the row (module docstring); every rank of it
        calls ``take`` together."""
        routings, self.routings = self.routings, []
        self._recording = False
        if not routings:  # a pipeline stage without MoE layers
            return None, None, {}
        sums = [_layer_sums(routing, self.num_experts, token_mask) for routing in routings]
        choices, probabilities, squares = (torch.stack(parts) for parts in zip(*sums))  # [L, E], [L, E], [L]
        tokens = _tokens(routings[0], token_mask)
        totals = torch.cat([choices.flatten(), probabilities.detach().flatten(), squares.detach(), tokens[None]])
        if group is not None:
            dist.all_reduce(totals, group=group)
        layers, experts = choices.shape
        all_choices = totals[: layers * experts].view(layers, experts)
        all_probabilities = totals[layers * experts : 2 * layers * experts].view(layers, experts)
        all_squares, all_tokens = totals[2 * layers * experts : -1], totals[-1].clamp(min=1.0)
        fraction = all_choices / all_tokens
        aux = (self.num_experts * (fraction * all_probabilities / all_tokens).sum(-1)).mean()
        z = (all_squares / all_tokens).mean()
        loads = all_choices.amax(-1) / all_choices.mean(-1).clamp(min=1e-9)
        metrics = {
            f"{prefix}/router_aux_loss": aux,
            f"{prefix}/router_z_loss": z,
            f"{prefix}/expert_load_max_over_mean": loads.max(),
            **{f"{prefix}/expert_load_max_over_mean/layer_{index}": load for index, load in zip(self.layers, loads)},
        }
        if not (self.aux_coef or self.z_coef):
            return None, None, metrics
        # This rank's tokens' terms against the totals (the whole loss without a group).
        local_aux = (self.num_experts * (fraction * probabilities / all_tokens).sum(-1)).mean()
        local_z = (squares / all_tokens).mean()
        whole = share * (self.aux_coef * aux + self.z_coef * z)
        return share * (self.aux_coef * local_aux + self.z_coef * local_z), whole, metrics


def _layer_sums(
    routing: Routing, num_experts: int, token_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's sums over the tokens where ``token_mask`` is set (all without one), in float32: the token choices
    per expert ``[E]``, the router probabilities per expert ``[E]`` and the squared log-sum-exps (these two
    differentiable)."""
    logits = routing.logits.float()
    weights = torch.ones(logits.shape[0], device=logits.device)
    if token_mask is not None:
        weights = token_mask.to(logits.device, torch.float32)
    choices = torch.zeros(num_experts, device=logits.device).index_add_(
        0, routing.experts.flatten(), weights.repeat_interleave(routing.experts.shape[1])
    )
    probabilities = (logits.softmax(-1) * weights[:, None]).sum(0)
    return choices, probabilities, (logits.logsumexp(-1).square() * weights).sum()
