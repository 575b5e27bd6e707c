"""Checkpoints: the atomic directory protocol (``directory``), each trained role's sharded state through DCP
(``role_state``), checkpoints read without running code from them (``safe_load``), the run directory's lock and resume
checks (``run_directory``), and the export of a role as a Hugging Face or PEFT directory (``export``,
``peft_export``).

A run directory (``trainer.output_dir``) holds checkpoints and a pointer to the newest one:

    <run>/step_4/trainer_state.json   {"step": 4, "recipe": "grpo"}, written last, before the rename
    <run>/step_4/actor_state/         DCP shards: model, optimizer, LR schedule, each rank's RNG state
    <run>/step_4/actor_state/hf_config/   config.json, tokenizer files, role.json: what export needs besides weights
    <run>/step_4/actor/               the same weights as a Hugging Face directory (trainer.save_hf: by default
                                      only in the final checkpoint), streamed from the shards
    <run>/step_4/config.yaml          the resolved config the run had when it saved
    <run>/latest                      "step_4"

A checkpoint is written under ``step_4.tmp`` and renamed when whole; ``latest`` is replaced last. A crash at any point
leaves the previous checkpoint and ``latest`` as they were; ``*.tmp`` leftovers are never resumed from and are removed
by the next save. The small files and the run directory are fsynced, so a power loss cannot leave ``latest`` naming a
checkpoint whose rename was lost. Retention (``keep_last``) renames an old checkpoint to a ``*.tmp`` name before
deleting it, so a crash mid-delete leaves a leftover, never a half-deleted checkpoint that looks finished. Export runs
in one process, with no process group, whatever layout wrote the shards, a bucket of tensors at a time:

    spmd-rlhf export outputs/grpo hf_out --roles actor critic
"""

from spmd_rlhf.checkpoint.directory import (
    CONFIG_FILE,
    HF_CONFIG,
    LATEST,
    LORA_FILE,
    ROLE_FILE,
    ROLE_STATE_SUFFIX,
    STAGING_SUFFIX,
    TRAINER_STATE,
    checkpoint_roles,
    fsync_dir,
    hf_copy_due,
    is_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
    read_trainer_state,
    require_role_state,
    resolve_checkpoint,
    role_hf_dir,
    role_state_dir,
    save_due,
    write_checkpoint,
    write_small_file,
)
from spmd_rlhf.checkpoint.errors import CheckpointError
from spmd_rlhf.checkpoint.export import export_hf, read_role_tensors, writable_dir
from spmd_rlhf.checkpoint.role_state import TRAINED_ONLY, load_role_state, save_model_config, save_role_state
