"""The generation KV budget on a GPU: what rollout.memory_fraction leaves once the device's other tenants are
counted."""

import pytest

from spmd_rlhf.workers.generation import kv_cache_budget

GIB = 2**30


def test_the_allocator_cache_is_budget_not_use():
    # 80 GiB device, 30 GiB free: 50 GiB look used, but 20 of them are this process's cached-but-free blocks.
    budget = kv_cache_budget(fraction=0.5, total=80 * GIB, free=30 * GIB, cached=20 * GIB, role="actor")
    assert budget == 10 * GIB
    assert kv_cache_budget(fraction=0.5, total=80 * GIB, free=80 * GIB, cached=0, role="actor") == 40 * GIB


def test_a_full_device_names_the_figures_and_the_keys():
    with pytest.raises(ValueError) as error:
        kv_cache_budget(fraction=0.5, total=80 * GIB, free=30 * GIB, cached=0, role="rollout")
    message = str(error.value)
    assert "rollout.memory_fraction=0.5" in message and "50.0 GiB are in use" in message
    assert "rollout.kv_cache_blocks" in message and message.startswith("rollout generation")
