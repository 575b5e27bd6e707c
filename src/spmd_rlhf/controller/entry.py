"""The command-line entry of a recipe under torchrun: ``--config``, ``key=value`` overrides, ``--help``,
``--dry-run``; then the launch, and the exit code SLURM's requeue reads."""

from __future__ import annotations

import argparse
import os

from spmd_rlhf.config import ConfigError, config_reference, load_config
from spmd_rlhf.config.derive import describe_derived
from spmd_rlhf.controller.dry_run import describe
from spmd_rlhf.controller.recipe import RLRecipe
from spmd_rlhf.runtime import (
    REQUEUE_EXIT_CODE,
    Coordinator,
    RuntimeOptions,
    end_process,
    launch,
)
from spmd_rlhf.runtime.device import select_device, visible_cuda_devices
from spmd_rlhf.runtime.host_memory import restart_with_huge_pages


def main(recipe_class: type[RLRecipe], default_config: str) -> None:
    """The torchrun entry of a recipe: ``--config FILE`` then ``key=value`` overrides; ``--help`` lists every key,
    ``--dry-run`` prints what would run (config, placement, layouts, memory per rank) and exits."""
    parser = argparse.ArgumentParser(
        description=f"The {recipe_class.name} recipe. Run it under torchrun; every key below can be set as key=value.",
        epilog="config keys (default, meaning):\n" + config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=default_config, help="YAML config (default: %(default)s)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, placement, role layouts and memory per rank, then exit",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="ranks to plan for with --dry-run (default: $WORLD_SIZE or 1)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=5")
    options = parser.parse_args()
    try:
        config = load_config(options.config, options.overrides)
        recipe_class.check_algorithm(config)
        if options.dry_run:
            if int(os.environ.get("RANK", "0")) == 0:
                print(describe(config, options.world_size), end="")
            return
        # Which device the launch will pick, by the launch's own rule (any rank's: they all see the same devices).
        on_cpu = (
            select_device(config.trainer.device, local_rank=0, cuda_devices=visible_cuda_devices())[0].type == "cpu"
        )
    except (ConfigError, ValueError) as error:
        parser.exit(2, f"{recipe_class.name}: {error}\n")
    if config.trainer.host_huge_pages and on_cpu:
        restart_with_huge_pages()
    if int(os.environ.get("RANK", "0")) == 0 and config.derived:
        print(describe_derived(config.derived), flush=True)
    trainer = config.trainer
    runtime = RuntimeOptions(
        call_timeout_s=trainer.timeout_s,
        collective_timeout_s=trainer.collective_timeout_s,
        failure_timeout_s=trainer.heartbeat_timeout_s,
        device=trainer.device,
        stop_timeout_s=trainer.stop_timeout_s,
    )

    def run(coordinator: Coordinator) -> str | None:
        recipe = recipe_class(config, coordinator)
        recipe.fit()
        return recipe.stopped_by

    stopped_by = launch(run, options=runtime)
    # RPC and the process groups are shut down and the sinks closed (seen once in ~600 recipe runs before it skipped
    # the interpreter's teardown: an abort after a finished run).
    end_process(REQUEUE_EXIT_CODE if stopped_by else 0)
