"""TRL's ``GRPOTrainer`` as the end-to-end baseline: one run as a JSON spec describes it, timed per optimizer step and
per stage, its raw timings written where the spec says. The TRL half of ``e2e_cpu.py`` (CPU) and ``gpu_grpo.py``.

    python benchmarks/trl_grpo.py SPEC.json      # under torchrun for more than one process
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

TRL_SCRIPT = Path(__file__).resolve()
"""What ``e2e_cpu.py`` and ``gpu_grpo.py`` launch, with the spec's path as its argument."""


class StepClock:
    """Wall seconds of every optimizer step (generation, scoring and update included) and the trainer's log rows:
    ``transformers.TrainerCallback``'s hooks, mixed into it where TRL runs (``trl_worker``), so the processes that only
    launch the runs never import the trainer (seconds of imports each)."""

    def __init__(self) -> None:
        self.step_seconds: list[float] = []
        self.logs: list[dict] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if logs and "completions/mean_length" in logs:
            self.logs.append(dict(logs))


def _time_method(owner: object, name: str, seconds: list[float]) -> None:
    """Wrap ``owner.name`` so that each call's wall time is appended to ``seconds``."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        result = method(*args, **kwargs)
        seconds.append(time.perf_counter() - started)
        return result

    setattr(owner, name, timed)


def trl_worker(spec_path: str) -> None:
    """One TRL GRPO run as described by the JSON file at ``spec_path``; writes its raw timings to ``spec['result']``.

    Also the TRL half of ``benchmarks/gpu_grpo.py``, whose spec adds ``device`` (cuda), ``dtype`` (bfloat16: autocast)
    and ``trl_weights`` (the dtype TRL loads the weights in); without them: CPU, float32 throughout."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from spmd_rlhf.rewards import RuleReward

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    samples = spec["prompts"] * spec["n"]
    rule = RuleReward(spec["rule"])

    def rule_reward(completions, data_source, reward_model, extra_info, **kwargs) -> list[float]:
        return [
            rule.score(source, completion[0]["content"], model["ground_truth"], extra)[0]
            for completion, source, model, extra in zip(completions, data_source, reward_model, extra_info)
        ]

    config = GRPOConfig(
        output_dir=spec["output_dir"],
        use_cpu=spec.get("device", "cpu") == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=samples // (spec["micro_batch_size"] * world),
        num_generations=spec["n"],
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_k=spec["top_k"],
        top_p=spec["top_p"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        max_grad_norm=spec["grad_clip"],
        beta=spec["kl_coef"],
        epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"],
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        bf16=spec.get("dtype") == "bfloat16",
        fp16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        # transformers' generate stops a row at any of these (its EOS and the config's stop ids, if any).
        generation_kwargs={"eos_token_id": [spec["eos_token_id"], *spec["stop_ids"]]} if spec.get("stop_ids") else None,
        model_init_kwargs={"dtype": spec.get("trl_weights", "float32"), "attn_implementation": "sdpa"},
    )
    dataset = Dataset.from_parquet(spec["train_file"])

    class TrainerStepClock(StepClock, TrainerCallback):
        """``StepClock`` as the trainer calls it back."""

    clock = TrainerStepClock()
    trainer = GRPOTrainer(
        model=spec["model_dir"], reward_funcs=rule_reward, args=config, train_dataset=dataset, callbacks=[clock]
    )
    generate_s: list[float] = []
    generate_and_score_s: list[float] = []
    _time_method(trainer, "_generate", generate_s)
    _time_method(trainer, "_generate_and_score_completions", generate_and_score_s)
    trainer.train()
    if trainer.accelerator.is_main_process:
        Path(spec["result"]).write_text(
            json.dumps(
                {
                    "world": world,
                    "step_s": clock.step_seconds,
                    "generate_s": generate_s,
                    "generate_and_score_s": generate_and_score_s,
                    "logs": clock.logs,
                }
            )
        )


if __name__ == "__main__":
    trl_worker(sys.argv[1])
