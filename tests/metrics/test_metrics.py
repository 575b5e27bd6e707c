"""Tests for step metrics and their sinks: JSONL records, the console progress line and stage-timing table,
TensorBoard event files, wandb offline runs and the errors for missing packages, per-rank averaging, stage timers,
and the model-FLOP / MFU accounting."""

from __future__ import annotations

import io
import json
import sys

import pytest
from transformers import Qwen2Config

from spmd_rlhf.config import ConfigError, FrameworkConfig, RolloutConfig, TrainerConfig
from spmd_rlhf.metrics.sinks import SINKS, ConsoleSink, build_sinks
from spmd_rlhf.metrics.step_metrics import (
    MatmulParameters,
    MetricsLogger,
    ModelPasses,
    StageTimer,
    matmul_parameters,
    mean_over_ranks,
    step_flops,
    step_passes,
    throughput_metrics,
)


def run_config(tmp_path, **trainer) -> FrameworkConfig:
    return FrameworkConfig(trainer=TrainerConfig(output_dir=str(tmp_path / "run"), **trainer))


def test_jsonl_gets_one_object_per_step_and_console_a_progress_line(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(run_config(tmp_path, total_steps=4, loggers=["console", "jsonl"]), stream=stream)
    logger.log(0, {"reward/mean": 0.25, "response_length/mean": 3.0})
    logger.log(1, {"reward/mean": 0.5, "kl/mean": 0.01, "perf/mfu": 0.125})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records == [
        {"step": 0, "reward/mean": 0.25, "response_length/mean": 3.0},
        {"step": 1, "reward/mean": 0.5, "kl/mean": 0.01, "perf/mfu": 0.125},
    ]
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("step 2/4 [##########----------]  50% | reward 0.5 | kl 0.01 | mfu 0.125 |")
    assert "ETA 0:00:0" in lines[1]


def test_timing_table_averages_the_stages_since_the_last_table():
    stream = io.StringIO()
    console = ConsoleSink(total_steps=5, timing_every=2, stream=stream)
    for step, (generate, update) in enumerate([(3.0, 1.0), (1.0, 1.0), (2.0, 2.0), (2.0, 2.0), (1.0, 0.5)]):
        console.log(
            step, {"time/generate": generate, "time/update_actor": update, "time/step": generate + update + 1.0}
        )
    tables: list[list[str]] = []
    for line in stream.getvalue().splitlines():
        if line.startswith("stage times"):
            tables.append([line])
        elif line.startswith("  "):
            tables[-1].append(line)
    # Tables after steps 2 and 4 (every 2) and 5 (the last), each over the steps logged since the one before.
    assert [table[0] for table in tables] == [
        "stage times, mean of 2 logged steps 1-2:",
        "stage times, mean of 2 logged steps 3-4:",
        "stage times, mean of 1 logged step 5:",
    ]
    assert [line.split() for line in tables[0][1:]] == [
        ["generate", "2.000", "s", "50.0%"],
        ["update_actor", "1.000", "s", "25.0%"],
        ["step", "4.000", "s", "100.0%"],
    ]
    assert tables[2][1].split() == ["generate", "1.000", "s", "40.0%"]


def test_timing_table_comes_when_logged_steps_skip_the_boundary():
    stream = io.StringIO()
    console = ConsoleSink(total_steps=100, timing_every=4, stream=stream)
    for step in (0, 3, 5, 9):  # steps 1, 4 (due), 6, 10 (past the boundary of 8)
        console.log(step, {"time/step": 1.0})
    headers = [line for line in stream.getvalue().splitlines() if line.startswith("stage times")]
    assert headers == ["stage times, mean of 2 logged steps 1-4:", "stage times, mean of 2 logged steps 6-10:"]
    silent = io.StringIO()
    ConsoleSink(total_steps=2, timing_every=0, stream=silent).log(1, {"time/step": 1.0})
    assert "stage times" not in silent.getvalue()


def test_logger_names_match_the_config_check(tmp_path):
    with pytest.raises(ConfigError, match="loggers.*allowed: " + ", ".join(SINKS)):
        TrainerConfig(loggers=["console", "slack"])
    trainer = TrainerConfig(output_dir=str(tmp_path), loggers=["jsonl"])
    trainer.loggers = ["slack"]  # a config changed after validation is checked again
    with pytest.raises(ValueError, match="slack"):
        build_sinks(trainer)


def test_tensorboard_sink_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(run_config(tmp_path, loggers=["tensorboard"]))
    logger.log(0, {"reward/mean": 0.25, "time/step": 1.5})
    logger.log(1, {"reward/mean": 0.75, "time/step": 1.0})
    logger.close()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # jsonl is written always
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "time/step"]
    assert [(event.step, event.value) for event in events.Scalars("reward/mean")] == [(0, 0.25), (1, 0.75)]


@pytest.mark.parametrize(
    "logger,module,package", [("wandb", "wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard", "tensorboard")]
)
def test_missing_package_is_named_with_its_install(tmp_path, monkeypatch, logger, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=f"trainer.loggers has {logger}.*pip install {package}"):
        MetricsLogger(run_config(tmp_path, loggers=["console", logger]))


def test_wandb_offline_run_writes_its_local_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(run_config(tmp_path, loggers=["wandb"], wandb_project="tests"))
    run = logger.sinks[-1].run  # after metrics.jsonl
    logger.log(0, {"reward/mean": 0.25})
    logger.log(1, {"reward/mean": 0.75})
    assert (run.project, run.name) == ("tests", "run")
    assert run.config["trainer"]["output_dir"] == str(tmp_path / "run")
    logger.close()
    [stream] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    assert stream.stat().st_size > 0


def test_mean_over_ranks_and_timer():
    assert mean_over_ranks([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}
    timer = StageTimer()
    with timer("generate"):
        pass
    with timer("generate"):
        pass
    assert list(timer.metrics()) == ["time/generate"] and timer.metrics()["time/generate"] >= 0


def test_step_flops_formula():
    actor, critic = MatmulParameters(body=8, head=2), MatmulParameters(body=3, head=1)
    passes = ModelPasses(generate=actor, train=(actor, actor, critic), forward=(actor, critic))
    # Training and forward passes: bodies at all 100 tokens, heads at the 30 response tokens; generation: both at
    # every generated token. 6 * (100 * 19 + 30 * 5) + 2 * (100 * 11 + 30 * 3) + 2 * 30 * 10.
    assert step_flops(passes, sequence_tokens=100, response_tokens=30, generated_tokens=30) == 12_300 + 2_380 + 600
    # The head at every token would overstate the step: that is where the logits are not computed.
    everywhere = step_flops(passes, sequence_tokens=100, response_tokens=100, generated_tokens=30)
    assert everywhere - 12_300 - 2_380 - 600 == 6 * 70 * 5 + 2 * 70 * 3


def write_model_config(path, *, tied: bool) -> None:
    Qwen2Config(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    ).save_pretrained(path)


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_parameters_leave_out_the_embedding_lookup(tmp_path, tied):
    write_model_config(tmp_path, tied=tied)
    # Per layer: q 16x16 + k, v 8x16 each (GQA: 2 of 4 heads of 4 dims) with biases, o 16x16, MLP 3 x 16x32, 2 norms.
    layer = (16 * 16 + 16) + 2 * (8 * 16 + 8) + 16 * 16 + 3 * 16 * 32 + 2 * 16
    lm_head = 100 * 16  # a matmul even when tied to the embedding
    assert matmul_parameters(str(tmp_path), head="lm") == MatmulParameters(body=2 * layer + 16, head=lm_head)
    assert matmul_parameters(str(tmp_path), head="value") == MatmulParameters(body=2 * layer + 16, head=16 + 1)


def test_step_passes_follow_the_config(tmp_path):
    write_model_config(tmp_path, tied=True)
    config = FrameworkConfig(trainer=TrainerConfig(output_dir=str(tmp_path / "run")))
    config.model.path = str(tmp_path)
    config.actor.ppo_epochs = 2
    actor, critic = matmul_parameters(str(tmp_path), head="lm"), matmul_parameters(str(tmp_path), head="value")
    # PPO: actor x 2 epochs and critic trained; reference and critic values forward-only; the rule reward is free.
    assert step_passes(config) == ModelPasses(generate=actor, train=(actor, actor, critic), forward=(actor, critic))
    config.rollout = RolloutConfig(recompute_log_probs=True)
    assert step_passes(config).forward == (actor, actor, critic)


def test_throughput_metrics():
    model = MatmulParameters(body=900, head=100)
    passes = ModelPasses(generate=model, train=(model,), forward=(model,))
    metrics = {
        "time/step": 2.0,
        "time/generate": 0.5,
        "rollout/prompt_tokens": 300.0,
        "rollout/generated_tokens": 100.0,
    }
    result = throughput_metrics(metrics, world_size=4, passes=passes, peak_flops_per_device=1e6)
    # 8 * (400 tokens * 900 + 100 response tokens * 100) + 2 * 100 generated tokens * 1000.
    flops = 3.16e6
    assert step_flops(passes, sequence_tokens=400, response_tokens=100, generated_tokens=100) == flops
    assert result == pytest.approx(
        {
            "throughput/tokens_per_s": 200.0,
            "throughput/tokens_per_s_per_device": 50.0,
            "throughput/generated_tokens_per_s": 200.0,
            "throughput/tflops_per_device": flops / 2.0 / 4 / 1e12,
            "perf/mfu": flops / (2.0 * 4 * 1e6),
        }
    )
    assert "perf/mfu" not in throughput_metrics(metrics, world_size=4, passes=passes, peak_flops_per_device=0.0)


def test_step_memory_metrics_empty_without_cuda_and_resets_the_peak_on_cuda(monkeypatch):
    from spmd_rlhf.metrics import peak_memory

    monkeypatch.setattr(peak_memory.torch.cuda, "is_initialized", lambda: False)
    assert peak_memory.step_memory_metrics() == {}
    resets = []
    monkeypatch.setattr(peak_memory.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(peak_memory.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(peak_memory.torch.cuda, "max_memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(peak_memory.torch.cuda, "max_memory_reserved", lambda device: 4 * 2**30)
    monkeypatch.setattr(peak_memory.torch.cuda, "memory_reserved", lambda device: 2**29)
    monkeypatch.setattr(peak_memory.torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(peak_memory.torch.cuda, "reset_accumulated_memory_stats", lambda device: resets.append(-device))
    monkeypatch.setattr(
        peak_memory.torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 2, "num_device_alloc": 7}
    )
    assert peak_memory.step_memory_metrics() == {
        "memory/peak_allocated_gib": 3.0,
        "memory/peak_reserved_gib": 4.0,
        "memory/reserved_gib": 0.5,
        "memory/alloc_retries": 2.0,
        "memory/device_mallocs": 7.0,
    }
    assert resets == [3, -3]


def test_compile_counts_give_each_steps_graphs_and_warn_after_the_settling_steps(caplog):
    import torch

    from spmd_rlhf.metrics.compile_counts import SETTLING_STEPS, CompileCounts

    torch._dynamo.reset()
    counts = CompileCounts()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="eager", dynamic=False)
    compiled(torch.ones(3))
    first = counts.step_metrics()
    assert first["compile/graphs"] == 1 and first["compile/seconds"] > 0
    compiled(torch.ones(3))  # a replay compiles nothing
    assert counts.step_metrics() == {"compile/graphs": 0.0, "compile/seconds": 0.0}
    with caplog.at_level("WARNING", logger="spmd_rlhf.metrics.compile_counts"):
        for step in range(SETTLING_STEPS, SETTLING_STEPS + 2):
            compiled(torch.ones(step + 5))  # a new static shape: a recompile
            assert counts.step_metrics()["compile/graphs"] == 1
    assert caplog.text.count("TORCH_LOGS=recompiles") == 2 and f"in step {SETTLING_STEPS}," in caplog.text
