"""The ``spmd-rlhf`` command line.

    spmd-rlhf make-tiny --family qwen2 --out tiny/model
    spmd-rlhf make-task --task arithmetic --out tiny/task
    spmd-rlhf config --show recipes/configs/ppo.yaml actor.lr=1e-6
    spmd-rlhf config --keys
    spmd-rlhf forward --model tiny/model --prompt "2+3="
    spmd-rlhf export outputs/grpo hf_out --roles actor
    spmd-rlhf export outputs/grpo hf_out --merge        # a LoRA actor as a full model (default: a PEFT adapter)
    spmd-rlhf plot outputs/grpo
    spmd-rlhf plan --algo ppo --actor 7b --critic 7b --reward 7b --gpus 128 --gpus-per-node 8
    spmd-rlhf calibrate

Each subcommand imports its module only when chosen, so ``spmd-rlhf --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _add_make_tiny(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny", help="write a random-init model in Hugging Face format plus a locally trained tokenizer"
    )
    parser.add_argument(
        "--family", required=True, choices=["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral"]
    )
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--layers", type=int, default=2, help="number of decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA when fewer than --heads)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 4 x hidden)")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer vocabulary to train (an upper bound)")
    parser.add_argument(
        "--model-vocab-size",
        type=int,
        default=None,
        help="the model's vocabulary rows, past the tokenizer's (151936 for Qwen2.5's shape); default: the tokenizer's",
    )
    parser.add_argument(
        "--head", default="lm", choices=["lm", "score"], help="lm: *ForCausalLM; score: *ForSequenceClassification"
    )
    parser.add_argument(
        "--tokenizer-tasks",
        nargs="+",
        default=["arithmetic"],
        choices=["arithmetic", "tool_products"],
        help="tasks whose text trains the tokenizer (tool_products: calculator calls in about 30 tokens)",
    )
    parser.add_argument(
        "--chat-template",
        default="chatml",
        choices=["chatml", "role_colon"],
        help="the tokenizer's chat template (role_colon: 'User: ...', for a reward model of another family)",
    )
    parser.add_argument("--seed", type=int, default=0)


def _add_make_task(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("make-task", help="write a synthetic prompt dataset in verl's row schema")
    parser.add_argument("--task", required=True, choices=["arithmetic", "tool_products"])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--val-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)


def _add_config(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config", help="validate a config file and print the resolved config, or list every key"
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument(
        "--show", metavar="FILE", help="YAML config file to resolve (with key=value overrides) and print"
    )
    action.add_argument("--keys", action="store_true", help="list every config key with its default and docstring")
    parser.add_argument(
        "--markdown", action="store_true", help="with --keys: Markdown tables (docs/config.md's reference)"
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def _add_forward(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "forward", help="load a model and tokenizer, run one forward pass, print greedy next tokens"
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompt", default="1+2=", help="prompt text")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write trained roles' weights from a checkpoint's sharded state as Hugging Face directories"
    )
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="a checkpoint (step_N) or a run directory (its latest)")
    parser.add_argument(
        "out", metavar="OUT_DIR", help="output directory: one Hugging Face directory per role, OUT_DIR/<role>"
    )
    parser.add_argument("--roles", nargs="+", default=["actor"], help="roles to export (default: actor)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the written weights (default: float32, the trained master weights unrounded)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="empty a non-empty OUT_DIR first "
        "(without it, a non-empty OUT_DIR is refused: stale shards would be loaded)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a role trained with LoRA: write a full model with the adapters merged into its base (default: a PEFT "
        "adapter directory for peft.PeftModel.from_pretrained); other roles are always full models",
    )


def _add_plot(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot", help="draw PNG charts (reward, KL, entropy, length, stage times) of a run's metrics.jsonl"
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's trainer.output_dir (or its metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    parser.add_argument(
        "--keys",
        nargs="+",
        default=None,
        help="one chart per metric key or pattern (e.g. 'critic/*') instead of the default charts",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spmd-rlhf", description=__doc__.split("\n")[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    from spmd_rlhf.mapping.commands import add_calibrate_parser, add_plan_parser

    for add in (
        _add_make_tiny,
        _add_make_task,
        _add_config,
        _add_forward,
        _add_export,
        _add_plot,
        add_plan_parser,
        add_calibrate_parser,
    ):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "make-tiny":
        from spmd_rlhf.tiny.model import make_tiny

        try:
            make_tiny(
                family=args.family,
                out_dir=args.out,
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                intermediate_size=args.intermediate,
                vocab_size=args.vocab_size,
                model_vocab_size=args.model_vocab_size,
                head=args.head,
                tokenizer_tasks=tuple(args.tokenizer_tasks),
                chat_template=args.chat_template,
                seed=args.seed,
            )
        except ValueError as error:
            print(f"make-tiny error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {args.family} model and tokenizer to {args.out}")
        return 0
    if args.command == "make-task":
        from spmd_rlhf.tiny.task import make_task

        paths = make_task(
            task=args.task, out_dir=args.out, train_size=args.train_size, val_size=args.val_size, seed=args.seed
        )
        print("\n".join(f"wrote {path}" for path in paths))
        return 0
    if args.command == "config":
        from spmd_rlhf.config import ConfigError, config_reference, format_value, load_config, to_yaml

        if args.keys:
            print(config_reference(markdown=args.markdown), end="")
            return 0
        try:
            config = load_config(args.show, args.overrides)
        except ConfigError as error:
            print(f"config error: {error}", file=sys.stderr)
            return 2
        for key, (value, why) in config.derived.items():
            print(f"# derived: {key}={format_value(value)} ({why})")
        print(to_yaml(config), end="")
        return 0
    if args.command == "forward":
        from spmd_rlhf.models.demo import run_forward

        run_forward(args.model, prompt=args.prompt, dtype=args.dtype)
        return 0
    if args.command == "export":
        import torch

        from spmd_rlhf.checkpoint import CheckpointError, export_hf

        try:
            written = export_hf(
                args.checkpoint,
                args.out,
                roles=args.roles,
                dtype=getattr(torch, args.dtype),
                overwrite=args.overwrite,
                merge=args.merge,
            )
        except CheckpointError as error:
            print(f"export error: {error}", file=sys.stderr)
            return 2
        print("\n".join(f"wrote {role} to {path}" for role, path in written.items()))
        return 0
    if args.command == "plot":
        from spmd_rlhf.metrics.plot import PlotError, plot_run

        try:
            written = plot_run(args.run_dir, out_dir=args.out, keys=args.keys)
        except PlotError as error:
            print(f"plot error: {error}", file=sys.stderr)
            return 2
        print("\n".join(f"wrote {path}" for path in written))
        return 0
    if args.command in ("plan", "calibrate"):
        from spmd_rlhf.mapping.commands import run_calibrate, run_plan

        try:
            print(run_plan(args) if args.command == "plan" else run_calibrate(args), end="")
        except (ValueError, FileNotFoundError) as error:
            print(f"{args.command} error: {error}", file=sys.stderr)
            return 2
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
