"""Which log-probs ``workers.advantages`` hands the losses: π_old of the PPO ratio and μ of the importance
correction."""

import torch

from spmd_rlhf.algos import Correction, correct
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.workers.advantages import behaviour_log_probs, old_log_probs


def test_the_behaviour_policy_is_the_distribution_the_tokens_were_drawn_from():
    sampled = torch.tensor([[-0.5, -1.0, 0.0]])
    log_support_mass = torch.tensor([[-0.2, -0.3, 0.0]])  # top-p kept e^-0.2 of the mass at the first token
    unfiltered = sampled + log_support_mass
    rollout = Batch({"rollout_log_probs": unfiltered, "sampling_log_probs": sampled})
    assert behaviour_log_probs(rollout) is sampled and old_log_probs(rollout) is unfiltered
    assert behaviour_log_probs(Batch({"rollout_log_probs": unfiltered})) is unfiltered  # a batch built without it
    # On the sampling weights π_old is the unfiltered policy, so a token's weight π_old / μ is its support's mass Z.
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    corrected = correct(old_log_probs(rollout), behaviour_log_probs(rollout), mask, Correction())
    torch.testing.assert_close(corrected.weights, log_support_mass.exp() * mask)
