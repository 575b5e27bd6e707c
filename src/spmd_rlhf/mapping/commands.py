"""The ``spmd-rlhf plan`` and ``spmd-rlhf calibrate`` subcommands.

spmd-rlhf plan --algo ppo --actor 7b --critic 7b --reward 7b --gpus 128 --gpus-per-node 8
spmd-rlhf plan --config recipes/configs/ppo.yaml --gpus 4 [key=value ...]
spmd-rlhf calibrate [--out ~/.cache/spmd_rlhf/device_profile.json] [--quick]
"""

from __future__ import annotations

import argparse

from spmd_rlhf.mapping.profile import default_profile_path


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="auto device mapping: the fastest placement and per-role layouts for a dataflow on N GPUs (no GPU needed)",
    )
    parser.add_argument("--gpus", type=int, required=True, help="devices in the job")
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="devices per node (tensor parallelism stays within one)"
    )
    parser.add_argument(
        "--profile", default="h100", help="h100, a100, auto or a profile file from `spmd-rlhf calibrate`"
    )
    parser.add_argument(
        "--config", default=None, help="plan this recipe config's roles and batch instead of the flags below"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="with --config: overrides")
    parser.add_argument(
        "--algo", default="ppo", help="ppo, grpo, remax, rloo, reinforce_pp, reinforce_pp_baseline or safe_rlhf"
    )
    parser.add_argument("--actor", default="7b", help="size name (0.5b 1.5b 3b 7b 8b 13b 34b 70b) or a model directory")
    parser.add_argument("--critic", default=None, help="critic model (ppo, safe_rlhf); default: the actor's")
    parser.add_argument(
        "--reference", default=None, help="reference model; default: the actor's; 'none' for no KL penalty"
    )
    parser.add_argument("--reward", default=None, help="reward model; default: none (a rule-based reward)")
    parser.add_argument("--cost", default=None, help="safe_rlhf cost model")
    parser.add_argument("--prompts", type=int, default=1024, help="prompts per step")
    parser.add_argument("--samples", type=int, default=1, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="rows per forward/backward on each data-parallel rank"
    )
    parser.add_argument("--mini-batch", type=int, default=256, help="rows per optimizer step (0: the whole batch)")
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs")
    parser.add_argument("--runners-up", type=int, default=5)


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's matmul, memory and link rates into a device profile"
    )
    parser.add_argument(
        "--out", default=str(default_profile_path()), help=f"profile file to write (default: {default_profile_path()})"
    )
    parser.add_argument("--quick", action="store_true", help="smaller measurements (seconds, less exact)")
    parser.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="network rate per device in Gb/s (not measurable from one node)",
    )


def run_plan(args: argparse.Namespace) -> str:
    """The plan's text for the parsed ``plan`` arguments."""
    from spmd_rlhf.mapping.calibrate import resolve_profile
    from spmd_rlhf.mapping.devices import Cluster
    from spmd_rlhf.mapping.placement import config_dataflow, describe_plan
    from spmd_rlhf.mapping.search import Planner
    from spmd_rlhf.mapping.workload import Batch, dataflow, model_shape

    profile = resolve_profile(args.profile)
    if args.config:
        from spmd_rlhf.config import load_config

        roles, batch = config_dataflow(load_config(args.config, args.overrides))
    else:
        if args.overrides:
            raise ValueError(f"key=value overrides {args.overrides} need --config")
        actor = model_shape(args.actor)
        reference = None if args.reference == "none" else model_shape(args.reference or args.actor)
        roles = dataflow(
            args.algo,
            actor=actor,
            critic=model_shape(args.critic or args.actor),
            reference=reference,
            reward=model_shape(args.reward) if args.reward else None,
            cost=model_shape(args.cost) if args.cost else None,
        )
        batch = Batch(
            prompts=args.prompts,
            samples=args.samples,
            prompt_length=args.prompt_length,
            response_length=args.response_length,
            micro_batch_size=args.micro_batch,
            mini_batch_size=args.mini_batch,
            ppo_epochs=args.epochs,
        )
    result = Planner(roles, Cluster(args.gpus, args.gpus_per_node, profile), batch).plan(runners_up=args.runners_up)
    return describe_plan(result, devices=args.gpus, profile=profile)


def run_calibrate(args: argparse.Namespace) -> str:
    from spmd_rlhf.mapping.calibrate import calibrate

    inter_node = args.inter_node_gbps * 1e9 / 8 if args.inter_node_gbps else None
    profile = calibrate(quick=args.quick, inter_node_bandwidth=inter_node)
    profile.save(args.out)
    return profile.to_json() + f"wrote {args.out}\n"
