"""Vocabulary-parallel log-probs and entropies at temperatures other than 1, on two gloo ranks holding unequal slices
of the vocabulary, against the full-vocabulary float32 reference of ``logits / temperature`` (values, and each rank's
slice of the gradient). Exits non-zero on a mismatch; prints one ``ok rank N`` line per rank otherwise.

    torchrun --nproc-per-node 2 tests/models/programs/vocab_parallel_logprob.py
"""

import torch
import torch.distributed as dist

from spmd_rlhf.models import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits
from spmd_rlhf.runtime import end_process

VOCAB, SPLIT = 50, 19
"""Rank 0 holds token ids [0, 19), rank 1 [19, 50): unequal slices, so an offset mixed up between ranks shows."""


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, VOCAB, generator=generator) * 3).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (3, 7), generator=generator)
    weights = torch.randn(2, 3, 7, generator=generator)
    start, end = (0, SPLIT) if rank == 0 else (SPLIT, VOCAB)

    for temperature in (0.6, 1.7):
        reference_logits = logits.float().requires_grad_()
        log_softmax = (reference_logits / temperature).log_softmax(-1)
        reference_log_probs = log_softmax.gather(-1, labels[..., None]).squeeze(-1)
        reference_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        reference_loss = (reference_log_probs * weights[0] + reference_entropy * weights[1]).sum()
        (reference_grad,) = torch.autograd.grad(reference_loss, reference_logits)

        local = logits[..., start:end].clone().requires_grad_()
        options = dict(temperature=temperature, chunk_tokens=4, group=dist.group.WORLD)
        both = log_probs_and_entropy_from_logits(local, labels, vocab_start=start, **options)
        separate = (
            log_probs_from_logits(local, labels, vocab_start=start, **options),
            entropy_from_logits(local, **options),
        )
        for log_probs, entropy in (both, separate):
            torch.testing.assert_close(log_probs, reference_log_probs, atol=1e-5, rtol=1e-5)
            # logsumexp - mean logit cancels in float32 on sharp rows (see tests/models/test_logprob.py).
            torch.testing.assert_close(entropy, reference_entropy, atol=3e-5, rtol=1e-5)
            (grad,) = torch.autograd.grad((log_probs * weights[0] + entropy * weights[1]).sum(), local)
            assert grad.dtype == torch.bfloat16
            torch.testing.assert_close(grad.float(), reference_grad[..., start:end], atol=1e-2, rtol=1e-2)
    print(f"ok rank {rank}", flush=True)
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
