"""A role class from a module only rank 0 can import: the other ranks cannot decode its spawn command, and the job
must end within seconds with an error naming a rank and the missing module (not wait out the heartbeat timeout).

    torchrun --nproc-per-node 2 tests/runtime/programs/rank_zero_only_module.py MODULE_DIR
"""

import os
import sys

from spmd_rlhf.runtime import Coordinator, ResourcePool, RuntimeOptions, launch


def main(coordinator: Coordinator) -> None:
    from only_on_rank_zero import Greeter

    role = coordinator.spawn(Greeter, name="greeter", pool=ResourcePool.range(0, coordinator.world_size))
    role.ready.result(timeout=120)
    print("NOT REACHED: the spawn should have failed", flush=True)


if __name__ == "__main__":
    if os.environ["RANK"] == "0":
        sys.path.insert(0, sys.argv[1])
    launch(main, options=RuntimeOptions(failure_timeout_s=120))
