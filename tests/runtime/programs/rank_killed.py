"""A rank is SIGKILLed in the middle of a call; the job must end non-zero within the failure timeout, naming it.

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/runtime/programs/rank_killed.py PID_DIR VICTIM_RANK [SIGNAL]

With the victim a worker, the coordinator names it and stops the rest. With the victim rank 0 (the coordinator)
stopped by SIGSTOP (alive to torchrun, silent to everyone), the workers notice the silence and exit on their own.
"""

import os
import signal
import sys
import time
from pathlib import Path

from spmd_rlhf.runtime import Coordinator, ResourcePool, RuntimeOptions, Worker, launch, one_to_all


class Sleeper(Worker):
    @one_to_all
    def sleep(self, seconds: float) -> None:
        if self.context.rank == int(sys.argv[2]):
            time.sleep(1.0)
            os.kill(os.getpid(), getattr(signal, sys.argv[3] if len(sys.argv) > 3 else "SIGKILL"))
        time.sleep(seconds)


def main(coordinator: Coordinator) -> None:
    role = coordinator.spawn(Sleeper, name="sleeper", pool=ResourcePool.range(0, 4))
    role.sleep(120).result(timeout=300)
    print("NOT REACHED: the call should have failed", flush=True)


if __name__ == "__main__":
    Path(sys.argv[1], f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
    launch(main, options=RuntimeOptions(failure_timeout_s=10))
