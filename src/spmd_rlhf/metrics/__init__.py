"""Metrics: stage timers, throughput and MFU (``step_metrics``), the sinks a run logs to (console, JSONL,
TensorBoard, wandb), and the plots ``spmd-rlhf plot`` draws from a run's JSONL."""
