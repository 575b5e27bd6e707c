import os
import sys

# Shared helpers (torchrun_helpers) live in tests/; make them importable whatever directory pytest starts in.
sys.path.insert(0, os.path.dirname(__file__))


# The longest modules first: under pytest-xdist (``-n 2 --dist loadfile --no-loadscope-reorder`` in pytest.ini) each
# module runs whole on one worker, in collection order, so a long module collected last would leave the other worker
# idle at the end. (Without --no-loadscope-reorder xdist orders modules by their number of tests instead, which put
# the long modules of a few tests last.) The order is the modules' times in one run of the whole suite, the slowest
# first (module names are unique across tests/); two modules made short since are left to collection order, and four
# long ones added later are placed by their times in session 39's run.
LONGEST_FIRST = (
    "test_gpu_benchmarks.py",
    "test_learning.py",
    "test_bad_input.py",
    "test_algorithm_zoo.py",
    "test_async_learning.py",
    "test_checkpoint.py",
    "test_stop_on_signal.py",
    "test_multiturn_grpo.py",
    "test_moe_learning.py",
    "test_context_parallel_roles.py",
    "test_tool_learning.py",
    "test_compiled_blocks.py",
    "test_expert_parallel.py",
    "test_logprob.py",
    "test_moe.py",
    "test_launch.py",
    "test_parallel_parity.py",
    "test_reward_kinds_grpo.py",
    "test_hybrid_engine.py",
    "test_context_parallel_moe.py",
    "test_save_memory.py",
    "test_partial_rollouts.py",
    "test_placement.py",
    "test_slurm.py",
    "test_context_parallel.py",
    "test_rollout_log_probs.py",
    "test_dp_parity.py",
    "test_config.py",
    "test_weight_sync.py",
    "test_tp_schedule_agreement.py",
    "test_load_memory.py",
    "test_lora_parity.py",
    "test_lora_learning.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = os.path.basename(str(item.fspath))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within each module is kept
