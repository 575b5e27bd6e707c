"""pass@k against hand-computed values."""

import torch

from spmd_rlhf.algos import pass_at_k


def test_pass_at_k_is_the_unbiased_estimator():
    passed = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # n = 4: pass@1 = c / 4; pass@2 = 1 - C(4-c, 2) / C(4, 2)
    torch.testing.assert_close(pass_at_k(passed, 1), torch.tensor([0.25, 0.0, 1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(passed, 2), torch.tensor([0.5, 0.0, 1.0, 5 / 6], dtype=torch.float64))
    torch.testing.assert_close(pass_at_k(passed, 4), torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64))
