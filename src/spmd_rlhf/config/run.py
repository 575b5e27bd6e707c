"""``data``, ``trainer`` and ``mapping``: prompt data and batching; steps, checkpoints, logging and the run's
directory; how placement=auto models the devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_rlhf.config.choices import (
    DEVICE_SETTINGS,
)
from spmd_rlhf.config.errors import at_least, one_of, require


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["tiny/task/train.parquet"])
    """Training prompt files, parquet or JSONL, in verl's row schema."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files; empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages (a list of {role, content}) or plain text."""
    max_prompt_length: int = 64
    """Most prompt tokens, chat template included; longer prompts are handled as overlong_prompts says."""
    overlong_prompts: str = "error"
    """A prompt over max_prompt_length: error (stop, naming the row), skip (drop it, counted as data/skipped_prompts)
    or truncate (keep its last max_prompt_length tokens, counted as data/truncated_prompts)."""
    batch_size: int = 8
    """Prompts per training step over all ranks; the step trains on batch_size * rollout.n responses."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch."""
    seed: int = 0
    """Seed of the shuffling order."""

    def __post_init__(self) -> None:
        require(self, "train_files", bool(self.train_files), "must list at least one file")
        require(self, "prompt_key", self.prompt_key != "", "must name a column")
        at_least(self, 1, "max_prompt_length", "batch_size")
        one_of(self, "overlong_prompts", ("error", "skip", "truncate"))


@dataclass
class TrainerConfig:
    total_steps: int = 20
    """Training steps to run, each one rollout batch and its updates."""
    output_dir: str = "outputs/run"
    """Directory for checkpoints, metrics and the resolved config."""
    seed: int = 0
    """Seed of initialization and sampling."""
    save_every: int | None = None
    """Save a checkpoint every this many steps and after the last; null: every tenth of total_steps (at least every
    step); 0: only after the last step (and on save_every_minutes and signals)."""
    save_every_minutes: float = 30.0
    """Also save after the first step that ends this many minutes after the previous save (or the run's start), so a
    crash loses at most about this much work; 0: no time-based saves."""
    keep_last: int = 3
    """Keep this many checkpoints of highest step in output_dir, deleting older ones after each save (never the one
    latest names); 0: keep every checkpoint."""
    stop_timeout_s: float = 100.0
    """On SIGTERM or SIGUSR1 the run finishes the step in flight, saves and exits with code 75 (recipes/slurm requeues
    on it); a stop that takes longer than this exits with code 75 without saving (the last checkpoint stands). Keep it
    below the grace the launcher gives (torchrun --shutdown-timeout, SLURM --signal=B:USR1@SECONDS)."""
    save_hf: str = "final"
    """Which checkpoints also hold each trained role's weights as a Hugging Face directory (<step>/<role>, streamed
    from the shards; resume only needs the sharded state): final (the save after the last step), every or never
    (spmd-rlhf export writes one from any checkpoint later)."""
    save_hf_dtype: str | None = None
    """Dtype of those Hugging Face copies: null (model.dtype), float32 (the trained roles' float32 master weights,
    unrounded, at twice the bytes of bfloat16), bfloat16 or float16."""
    log_every: int = 1
    """Log metrics every this many steps."""
    max_skipped_steps: int = 10
    """A trained role skips an optimizer step whose gradient norm is not finite (counted in <role>/skipped_steps);
    more than this many consecutive skipped steps stop the run, naming the step and the role's update."""
    val_every: int = 0
    """Validate every this many steps (needs data.val_files): a greedy response per prompt; 0: never."""
    val_samples: int = 0
    """Validation also samples this many responses per prompt (rollout temperature): val/sampled/reward/mean and
    val/pass@k (k = val_samples, unbiased estimator); 0: greedy only."""
    val_pass_score: float = 1.0
    """A sampled validation response passes (for pass@k) when its score is at least this."""
    resume: str | None = "auto"
    """auto: continue from output_dir's latest checkpoint if there is one; null: start fresh (refused when output_dir
    holds checkpoints); else a checkpoint dir. A checkpoint that already reached total_steps is refused."""
    resume_allow_changes: bool = False
    """Resume even when the config changes the data order (data.train_files, shuffle, seed, batch_size, prompt_key) or
    the models (model.path, tokenizer_path, critic/cost_critic.model_path) from the checkpoint's saved config."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks, any of: console (progress line), jsonl (<output_dir>/metrics.jsonl, read by spmd-rlhf plot;
    written whether listed or not), tensorboard (<output_dir>/tensorboard; pip install tensorboard) and wandb
    (pip install wandb; WANDB_MODE=offline works)."""
    timing_every: int = 50
    """Print a table of each stage's mean seconds and share of the step every this many steps and after the last
    (console logger); 0: never."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps (counted from 0) run under torch.profiler in the controller's process, each writing
    <output_dir>/profile/step_<n>.txt: the ops' self host times and, on a GPU, self device times (every kernel the
    process launched; with one rank that is every role's work) and where the host waited for the device, by line.
    Empty: none."""
    profile_trace: bool = False
    """Also write each profiled step's timeline, <output_dir>/profile/step_<n>.json.gz (Chrome's trace format, which
    Perfetto opens; tens of MB for a GPU step)."""
    peak_flops_per_device: float = 0.0
    """Peak FLOP/s of one device at the training dtype, for the perf/mfu metric, e.g. 989e12 for an H100 SXM in dense
    bf16; 0: unknown, perf/mfu is not logged."""
    wandb_project: str = "spmd_rlhf"
    """wandb project of the run (wandb logger)."""
    wandb_run_name: str | None = None
    """wandb run name (wandb logger); null: the name of output_dir."""
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda (one GPU per rank, NCCL; an error without CUDA) or cpu
    (gloo only, even on a GPU machine)."""
    host_huge_pages: bool = True
    """On CPU, each rank restarts itself once at start with glibc's glibc.malloc.hugetlb=1 tunable where the kernel's
    transparent huge pages are in madvise mode (runtime/host_memory.py): large transient tensors are then faulted in
    2 MiB pages instead of 4 KiB ones (docs/benchmarks.md measures the gain). No effect on GPU ranks."""
    timeout_s: float = 600.0
    """Seconds the controller waits for a remote call (and for a step's calls together) before the job fails, naming
    the call still running; collectives have their own collective_timeout_s."""
    collective_timeout_s: float = 600.0
    """Seconds a collective (or point-to-point transfer) may wait for its peers before it fails on the ranks in it."""
    heartbeat_timeout_s: float = 60.0
    """Seconds a rank may leave the coordinator's heartbeat unanswered (a frozen process, an unreachable host), or a
    worker hear nothing from the coordinator, before the job ends with code 1 (then torchrun's --max-restarts or
    SLURM's requeue start it again); raise it where a host can stall for longer without being lost."""

    def __post_init__(self) -> None:
        at_least(self, 1, "total_steps", "log_every")
        at_least(self, 0, "val_samples", "max_skipped_steps")
        require(
            self,
            "profile_steps",
            all(0 <= step < self.total_steps for step in self.profile_steps),
            f"steps count from 0 and end before trainer.total_steps={self.total_steps}",
        )
        require(self, "profile_trace", self.profile_steps or not self.profile_trace, "needs trainer.profile_steps")
        at_least(self, 0, "val_every", "timing_every", "peak_flops_per_device", "save_every_minutes", "keep_last")
        require(self, "save_every", self.save_every is None or self.save_every >= 0, "must be >= 0 or null")
        require(self, "stop_timeout_s", self.stop_timeout_s > 0, "must be > 0")
        require(self, "output_dir", self.output_dir != "", "must name a directory")
        require(self, "wandb_project", self.wandb_project != "", "must name a wandb project")
        require(self, "resume", self.resume != "", "must be auto, null or a checkpoint directory")
        loggers = ("console", "jsonl", "tensorboard", "wandb")
        require(self, "loggers", set(self.loggers) <= set(loggers), "allowed: " + ", ".join(loggers))
        one_of(self, "device", DEVICE_SETTINGS)
        one_of(self, "save_hf", ("final", "every", "never"))
        require(
            self,
            "save_hf_dtype",
            self.save_hf_dtype in (None, "float32", "bfloat16", "float16"),
            "must be null (model.dtype), float32, bfloat16 or float16",
        )
        require(self, "timeout_s", self.timeout_s > 0, "must be > 0")
        require(self, "collective_timeout_s", self.collective_timeout_s > 0, "must be > 0")
        require(self, "heartbeat_timeout_s", self.heartbeat_timeout_s > 0, "must be > 0")

    def steps_between_saves(self) -> int:
        """``save_every`` resolved: null becomes a tenth of ``total_steps`` (at least 1); 0 stays 0."""
        return max(1, self.total_steps // 10) if self.save_every is None else self.save_every


@dataclass
class MappingConfig:
    profile: str = "auto"
    """Device profile for placement=auto: h100, a100, a JSON file written by `spmd-rlhf calibrate`, or auto (the
    calibrated profile at ~/.cache/spmd_rlhf/device_profile.json or $SPMD_RLHF_PROFILE, else the built-in one named in
    the GPU's name, else a quick calibration of this machine)."""
    gpus_per_node: int = 0
    """Devices per node for placement=auto; 0: torchrun's LOCAL_WORLD_SIZE (every rank when it is not set)."""

    def __post_init__(self) -> None:
        require(self, "profile", self.profile != "", "must be auto, a built-in profile name or a profile file")
        at_least(self, 0, "gpus_per_node")
