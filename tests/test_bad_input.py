"""Bad input through the real entry points: the recipes (as users start them) and the ``spmd-rlhf`` CLI.

Every case must end with one output line that names the cause and what to change, and a non-zero exit, or, where
the design counts and carries on (reward failures under ``on_error=zero``, over-long prompts under ``skip``), a
finished run with the count in its metrics. No case may leave a partial checkpoint behind: no ``step_N`` without
``trainer_state.json``, no ``latest`` naming an unfinished one, no ``*.tmp``.

The cases are independent jobs on the tiny model and task. One module fixture runs the selected ones two at a time
(the CPU budget of this suite) before their tests look at the results; a resume case runs after the run whose
checkpoint it resumes. A one-rank case runs as ``python <recipe>.py`` (a one-process job needs no torchrun), forked
from an interpreter that has imported the package (``preloaded.py``), as do the ranks of a job of more; the cases
that kill a rank run under torchrun, whose agent takes part in how such a job ends; independent cases
that each finish their run share one job. The recipe started by a fresh interpreter is tested by
``tests/recipes/test_recipe_cli.py`` (a config error) and below (a locked output directory, under torchrun).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

import pytest
from preloaded import PreloadedPython
from torchrun_helpers import RECIPES, alive, environment, torchrun

from spmd_rlhf import checkpoint
from spmd_rlhf.checkpoint.run_directory import RunLock
from spmd_rlhf.data.dataset import DatasetError, PromptDataset
from spmd_rlhf.data.retokenize import TOKENIZER_FILES
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.tiny.task import make_task

TIMEOUT_S = 60
"""``trainer.timeout_s`` of every case: a lost rank must end its job within it."""
PARALLEL_JOBS = 2
RESPONSES_PER_STEP = 8 * 16
"""data.batch_size x rollout.n of recipes/configs/grpo.yaml."""


@dataclass(frozen=True)
class Case:
    expected: str | tuple[str, ...] | None
    """Regex of the output line that names the cause and what to change (a tuple: one run with several causes, each
    named); None: the run must finish."""
    overrides: tuple[str, ...] = ()
    """Recipe overrides; ``{assets}`` is the shared inputs' directory and ``{runs}/<case>`` another case's directory."""
    nproc: int = 1
    recipe: str = "grpo"
    kill: str | None = None
    """Run through ``killed_mid_stage.py``, whose rank ``victim`` kills itself at this ``STAGE@CALL``."""
    victim: int = 1
    checkpoints: tuple[str, ...] = ()
    """The finished checkpoints the run leaves."""


def case(expected: str | tuple[str, ...] | None, *overrides: str, **options) -> Case:
    return Case(expected, overrides, **options)


CASES = {
    # Config errors: the recipe's entry stops before the ranks meet.
    "unknown_key": case(
        r"actor\.micro_batch_szie: unknown key; did you mean actor\.micro_batch_size\?", "actor.micro_batch_szie=4"
    ),
    "wrong_type": case(r"actor\.lr=fast: expected a number", "actor.lr=fast"),
    "kv_cache_too_small_for_one_sequence": case(
        r"rollout\.kv_cache_blocks=4: holds 64 tokens, fewer than one sequence of data\.max_prompt_length \+ "
        r"rollout\.max_new_tokens = 68; set it to at least 5",
        "rollout.kv_cache_blocks=4",
    ),
    # At start, on the coordinator or while a role is built.
    "tp_not_dividing_the_ranks": case(
        r"actor\.pp=1 x actor\.tp=2 does not divide the 1 ranks of its pool; choose sizes", "actor.tp=2"
    ),
    "model_dir_missing": case(
        r"no_such_model: no such directory; expected a Hugging Face model directory",
        "model.path={assets}/no_such_model",
    ),
    "corrupt_safetensors": case(
        r"truncated/model\.safetensors is not a readable safetensors file .*; it is truncated or corrupt: download "
        r"or save the model again",
        "model.path={assets}/truncated",
    ),
    "tokenizer_beyond_the_model_vocab": case(
        r"the tokenizer at \S+/tiny/model has \d+ tokens but the actor's model at \S+/small_vocab has "
        r"vocab_size=\d+; point model\.tokenizer_path at the model's own tokenizer",
        "model.path={assets}/small_vocab",
        "model.tokenizer_path={assets}/tiny/model",
    ),
    "empty_dataset": case(
        r"no usable prompts in \[\S+/empty\.jsonl'\]: the files hold no rows; check data\.train_files",
        "data.train_files=[{assets}/empty.jsonl]",
    ),
    "missing_prompt_column": case(
        r"no_prompt\.jsonl row 0 has no 'prompt' field \(data\.prompt_key\); fields: \[.*'question'",
        "data.train_files=[{assets}/no_prompt.jsonl]",
    ),
    "every_prompt_overlong_skipped": case(
        r"no usable prompts in .*: all \d+ are over data\.max_prompt_length=4 tokens and were skipped; raise it",
        "data.max_prompt_length=4",
        "data.overlong_prompts=skip",
    ),
    "overlong_prompt_error": case(
        r"row 0 has 12 prompt tokens, over data\.max_prompt_length=4; raise it or set data\.overlong_prompts=skip",
        "data.max_prompt_length=4",
    ),
    "reward_file_missing": case(
        r"reward\.rule='\S+/no_such_reward\.py:score': \S+/no_such_reward\.py does not exist",
        "reward.rule={assets}/no_such_reward.py:score",
    ),
    "output_dir_under_a_file": case(
        r"trainer\.output_dir: cannot write to \S+/a_file/out: Not a directory",
        "trainer.output_dir={assets}/a_file/out",
    ),
    # In the middle of a run.
    "reward_raises_abort": case(
        r"reward: \S+/raises\.py:score raised RuntimeError: no score today .*Fix the reward function, or set "
        r"reward\.on_error=zero",
        "reward.rule={assets}/raises.py:score",
        "reward.on_error=abort",
        nproc=2,
    ),
    "reward_beyond_float32_abort": case(
        r"reward: \S+/beyond_float32\.py:score returned 1e\+39 as 'score', beyond float32's range \(±3\.403e\+38\)",
        "reward.rule={assets}/beyond_float32.py:score",
        "reward.on_error=abort",
    ),
    "reward_unknown_data_source_every_call_fails": case(
        r"reward: 128 of 128 calls failed at this step \(errors 128, timeouts 0, non_finite 0\), every call failed "
        r"\(reward\.max_failure_fraction=null stops only then\); .*Fix the reward function \(or the rows' data_source",
        "data.train_files=[{assets}/unknown_source.jsonl]",
        nproc=2,
    ),
    "non_finite_gradients_abort": case(
        r"actor: non-finite gradient norm \(nan\) at training step 1 in actor\.update_actor, 1 consecutive optimizer "
        r"step\(s\) skipped, more than trainer\.max_skipped_steps=0; .*or raise trainer\.max_skipped_steps",
        "reward.rule={assets}/overflowing.py:score",
        "trainer.max_skipped_steps=0",
    ),
    "reward_nan_abort": case(
        r"reward: \S+/nan\.py:score returned nan as 'score' .*Fix the reward function, or set reward\.on_error=zero",
        "reward.rule={assets}/nan.py:score",
        "reward.on_error=abort",
    ),
    "rank_killed_in_generation": case(
        r"rank 1 \(.*\) was lost: no answer to actor\.generate_sequences", kill="generate@1", nproc=2
    ),
    "rank_killed_in_update": case(
        r"rank 1 \(.*\) was lost: no answer to actor\.update_actor",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        kill="update@2",
        nproc=2,
        checkpoints=("step_1",),
    ),
    # A rollout replica (ranks 2-3 beside the reward; the actor on 0-1) dies generating the second batch, ahead of
    # the step that trains on it (max_staleness=1): the job ends naming it (the call the coordinator is waiting for
    # on it then is the generation, the moving of its rows or the scoring of the first batch by the reward beside
    # it, whichever the timing makes first). Or the replica beside it, in a collective with the dead rank, reports
    # the reset connection first.
    "rollout_rank_killed": case(
        r"(rank 3 \(.*\) was lost: no answer to "
        r"(rollout\.generate_sequences|runtime\.Exchanges|reward\.compute_rewards)"
        r"|rollout\.generate_sequences failed on rank 2: a rank in its collective was lost)",
        "trainer.total_steps=2",
        "placement=split",
        "rollout.enabled=true",
        "rollout.n_ranks=2",
        "algorithm.max_staleness=1",
        "rollout.recompute_log_probs=true",
        kill="rollout@2",
        victim=3,
        nproc=4,
    ),
    # Counted and carried on.
    # Every call fails: counted only because max_failure_fraction=1 says so (the default stops the run).
    "reward_raises_zero": case(
        None,
        "reward.rule={assets}/raises.py:score",
        "reward.on_error=zero",
        "reward.max_failure_fraction=1",
        checkpoints=("step_1",),
    ),
    "reward_nan_zero": case(
        None,
        "reward.rule={assets}/nan.py:score",
        "reward.on_error=zero",
        "reward.max_failure_fraction=1",
        checkpoints=("step_1",),
    ),
    "non_finite_gradients_skipped": case(None, "reward.rule={assets}/overflowing.py:score", checkpoints=("step_1",)),
    # Three independent cases in one run: verl rows in the shapes other exporters write (read as documented in
    # docs/recipes.md), three of them over data.max_prompt_length (skipped and counted), and a KV cache of a few
    # sequences (generation preempts and finishes).
    "verl_rows_some_overlong_small_kv_cache": case(
        None,
        "data.train_files=[{assets}/variants_some_long.json]",
        "data.max_prompt_length=16",
        "data.overlong_prompts=skip",
        "rollout.kv_cache_blocks=5",
        "rollout.kv_block_size=4",
        checkpoints=("step_1",),
    ),
    "chat_prompts_without_a_chat_template": case(
        r"train\.parquet row 0: the prompt is chat messages but the tokenizer \(\S+/no_template\) "
        r"has no chat template; "
        r"point model\.tokenizer_path at a tokenizer with one",
        "model.tokenizer_path={assets}/no_template",
    ),
    "empty_prompt": case(
        r"empty_prompt\.jsonl row 1: the prompt is empty; give it text or remove the row",
        "data.train_files=[{assets}/empty_prompt.jsonl]",
        "data.prompt_key=question",
    ),
    "reference_of_another_vocabulary": case(
        r"reference\.model_path=\S+/small_vocab has vocab_size=300, fewer than the \d+ tokens of the policy's "
        r"tokenizer \(tiny/model\); reference reads the actor's token ids, so it must be a model of the same tokenizer",
        "reference.model_path={assets}/small_vocab",
    ),
    # A reward model with a tokenizer of its own scores rebuilt text (data.retokenize); one without must fit the ids.
    "reward_model_of_another_vocabulary": case(
        r"reward\.model_path=\S+/small_vocab_untokenized has vocab_size=300, fewer than the \d+ tokens of the "
        r"policy's tokenizer .*, or reward\.tokenizer_path at the tokenizer it was trained with",
        "reward.kind=model",
        "reward.model_path={assets}/small_vocab_untokenized",
        recipe="ppo",
    ),
    # Resuming a checkpoint that does not fit the run.
    "resume_crafted_metadata": case(
        r"crafted/step_1/actor_state/\.metadata references (posix|os)\.system, which DCP checkpoint metadata never "
        r"holds; .* Resume or export only checkpoints your own jobs wrote",
        "trainer.resume={assets}/crafted",
        "trainer.total_steps=2",
    ),
    "ppo_checkpoint": case(None, recipe="ppo", checkpoints=("step_1",)),
    "resume_another_recipe": case(
        r"ppo_checkpoint/out/step_1 was written by the ppo recipe, not grpo; resume it with that recipe, or start "
        r"fresh with trainer\.resume=null",
        "trainer.resume={runs}/ppo_checkpoint/out",
    ),
    "resume_another_model_size": case(  # past the config check (resume_allow_changes): the shapes are checked too
        r"step_1/actor_state holds another model \(model\.embed_tokens\.weight \[\d+, 64\] saved, \[\d+, 128\] here.*"
        r"; resume with the model it was trained from \(model\.path\)",
        "trainer.resume={runs}/ppo_checkpoint/out",
        "model.path={assets}/wide",
        "trainer.resume_allow_changes=true",
        "trainer.total_steps=2",
        recipe="ppo",
    ),
    # Two keys a resume must keep, changed in one run: its line names both.
    "resume_another_model_path_and_data_order": case(
        (
            r"ppo_checkpoint/out/step_1 was trained with another data order or model \(.*model\.path: 'tiny/model' "
            r"saved, '\S+/wide' now.*\); resume with the saved values, start a new run with another "
            r"trainer\.output_dir, or set trainer\.resume_allow_changes=true",
            r"step_1 was trained with another data order or model \(.*data\.seed: 0 saved, 5 now.*\)",
        ),
        "trainer.resume={runs}/ppo_checkpoint/out",
        "model.path={assets}/wide",
        "data.seed=5",
        "trainer.total_steps=2",
        recipe="ppo",
    ),
    # A new experiment in a finished run's directory: said, not zero steps and exit 0, nor the old weights resumed.
    "output_dir_of_a_finished_run": case(
        r"ppo_checkpoint/out/step_1 already reached step 1 and trainer\.total_steps=1: nothing to run\. To train on "
        r"from it raise trainer\.total_steps above 1; to start a new run use another trainer\.output_dir",
        "trainer.output_dir={runs}/ppo_checkpoint/out",
        recipe="ppo",
    ),
    "fresh_start_in_a_used_output_dir": case(  # another case's directory than above: each locks the one it is given
        r"trainer\.resume=null, but trainer\.output_dir=\S+/reward_nan_zero/out holds an earlier run's checkpoints "
        r"\(latest step_1\); use another trainer\.output_dir",
        "trainer.output_dir={runs}/reward_nan_zero/out",
        "trainer.resume=null",
    ),
}
FAILING = [name for name, entry in CASES.items() if entry.expected is not None]
CONFIG_ERRORS = {
    **{name: CASES[name] for name in ("unknown_key", "wrong_type", "kv_cache_too_small_for_one_sequence")},
    # Known before the ranks meet only when the role's size is given; tp_not_dividing_the_ranks is the usual case.
    "tp_not_dividing_n_ranks": case(r"actor\.tp=3: must divide actor\.n_ranks=2", "actor.n_ranks=2", "actor.tp=3"),
    "group_baseline_with_greedy_decoding": case(
        r"rollout\.temperature=0(\.0)?: algorithm\.name=grpo compares a prompt's responses with each other, and greedy "
        r"decoding makes them all the same \(every advantage 0\); set a sampling temperature > 0",
        "rollout.temperature=0",
    ),
}
"""Cases the ``spmd-rlhf config`` check catches too, with the same line."""

SIGNATURE = "def score(data_source, solution_str, ground_truth, extra_info):\n"
USER_REWARDS = {
    "raises.py": SIGNATURE + "    raise RuntimeError('no score today')\n",
    "nan.py": SIGNATURE + "    return float('nan')\n",
    "beyond_float32.py": SIGNATURE + "    return 1e39\n",
    # Within float32's range, but a group's sum is not: NaN advantages, so a non-finite loss and gradient.
    "overflowing.py": SIGNATURE + "    return 3e38\n",
}
"""User reward files (verl's signature) that fail on every call."""


def build_assets(root: Path) -> Path:
    """The tiny model and task, and broken or mismatched variants of them."""
    make_tiny(family="qwen2", out_dir=str(root / "tiny" / "model"))
    make_task(task="arithmetic", out_dir=str(root / "tiny" / "task"))
    make_tiny(family="qwen2", out_dir=str(root / "small_vocab"), vocab_size=300)
    shutil.copytree(root / "small_vocab", root / "small_vocab_untokenized")
    for file in (*TOKENIZER_FILES, "chat_template.jinja"):
        (root / "small_vocab_untokenized" / file).unlink(missing_ok=True)
    make_tiny(family="qwen2", out_dir=str(root / "wide"), hidden_size=128)
    shutil.copytree(root / "tiny" / "model", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "empty.jsonl").write_text("")
    rows = [json.loads(line) for line in (root / "tiny" / "task" / "train.jsonl").read_text().splitlines()[:16]]
    renamed = [{("question" if key == "prompt" else key): value for key, value in row.items()} for row in rows]
    (root / "no_prompt.jsonl").write_text("".join(json.dumps(row) + "\n" for row in renamed))
    overlong = [{**row, "prompt": [{"role": "user", "content": "1+" * 40 + "1="}]} for row in rows[:3]]
    (root / "empty_prompt.jsonl").write_text(
        json.dumps({"question": "1+1="}) + "\n" + json.dumps({"question": ""}) + "\n"
    )
    (root / "variants.json").write_text(json.dumps(verl_row_variants(rows)))
    (root / "variants_some_long.json").write_text(json.dumps(verl_row_variants(rows + overlong)))
    shutil.copytree(root / "tiny" / "model", root / "no_template")
    settings = json.loads((root / "no_template" / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (root / "no_template" / "tokenizer_config.json").write_text(json.dumps(settings))
    (root / "no_template" / "chat_template.jinja").unlink(missing_ok=True)
    unknown = [{**row, "data_source": "my_task"} for row in rows]
    (root / "unknown_source.jsonl").write_text("".join(json.dumps(row) + "\n" for row in unknown))
    for name, source in USER_REWARDS.items():
        (root / name).write_text(source)
    (root / "a_file").write_text("a regular file, not a directory\n")
    write_crafted_checkpoint(root / "crafted", model_dir=root / "tiny" / "model", marker=root / CRAFTED_MARKER)
    return root


def verl_row_variants(rows: list[dict]) -> list[dict]:
    """``rows`` as one JSON array with ``reward_model`` as a JSON string and each message's content as text parts."""
    return [
        {
            **row,
            "reward_model": json.dumps(row["reward_model"]),
            "prompt": [
                {**message, "content": [{"type": "text", "text": message["content"]}]} for message in row["prompt"]
            ],
        }
        for row in rows
    ]


CRAFTED_MARKER = "the_crafted_checkpoint_ran_a_command"


class _RunsCommand:
    """Pickles as a call of ``os.system``: what a crafted ``.metadata`` would run under full pickle."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def write_crafted_checkpoint(run_dir: Path, *, model_dir: Path, marker: Path) -> None:
    """A GRPO checkpoint whose actor's DCP ``.metadata`` would create ``marker`` when unpickled."""
    state_dir = checkpoint.role_state_dir(run_dir / "step_1", "actor")
    (state_dir / checkpoint.HF_CONFIG).mkdir(parents=True)
    shutil.copy(model_dir / "config.json", state_dir / checkpoint.HF_CONFIG / "config.json")
    (state_dir / checkpoint.HF_CONFIG / checkpoint.ROLE_FILE).write_text(json.dumps({"head": "lm"}))
    (state_dir / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    (run_dir / "step_1" / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": 1, "recipe": "grpo"}))
    (run_dir / checkpoint.LATEST).write_text("step_1")


@dataclass(frozen=True)
class Run:
    finished: subprocess.CompletedProcess
    workdir: Path
    ended_at: float
    """``time.time()`` when the job had ended."""

    @property
    def output(self) -> str:
        return self.finished.stdout

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def run_case(name: str, assets: Path, runs: Path, preloaded: Queue[PreloadedPython]) -> Run:
    entry = CASES[name]
    workdir = runs / name
    workdir.mkdir()
    (workdir / "tiny").symlink_to(assets / "tiny")
    arguments = [
        "--config",
        str(RECIPES / "configs" / f"{entry.recipe}.yaml"),
        "trainer.output_dir=out",
        "trainer.total_steps=1",
        "trainer.val_every=0",
        f"trainer.timeout_s={TIMEOUT_S}",
        *(override.format(assets=assets, runs=runs) for override in entry.overrides),
    ]
    if entry.kill:
        program, arguments = "killed_mid_stage.py", [entry.kill, str(entry.victim), str(workdir), *arguments]
    else:
        program = str(RECIPES / f"{entry.recipe}.py")
    if not entry.kill:
        # A one-rank job as a user starts it without torchrun (launch() sets up the one-process group itself), as a
        # fork of an interpreter that has imported the package: the same recipe entry in a process of its own,
        # without the agent's process nor the ~2.5 s of imports each (over 30 cases). A job of more ranks: forks
        # with torchrun's variables for one node (the killed-rank cases need the agent: how the job ends is tested).
        python = preloaded.get()
        try:
            finished = python.run(
                [program, *arguments], cwd=workdir, timeout=240, nproc=entry.nproc if entry.nproc > 1 else 0
            )
        finally:
            preloaded.put(python)
    else:
        finished = torchrun(
            program,
            *arguments,
            nproc=entry.nproc,
            timeout=240,
            cwd=str(workdir),
            monitor_interval_s=3.0 if entry.kill else None,
            recipe=True,
        )
    return Run(finished, workdir, time.time())


def dependencies(name: str) -> set[str]:
    return {found for override in CASES[name].overrides for found in re.findall(r"\{runs\}/(\w+)", override)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return build_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, assets) -> dict[str, Run]:
    """The cases this session selected (and the runs they resume), run two at a time, by name."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        if item.module.__name__ == __name__ and "name" in getattr(getattr(item, "callspec", None), "params", {})
    }
    selected |= {dependency for name in selected for dependency in dependencies(name)}
    root = tmp_path_factory.mktemp("runs")
    resumed = {dependency for name in selected for dependency in dependencies(name)}
    # The runs others resume start first, the killed-rank cases (which wait out a lost rank) next, and the resuming
    # cases last, each once its own dependencies are done: no slot idles at a phase boundary.
    order = sorted(
        (name for name in CASES if name in selected),
        key=lambda name: (name not in resumed, CASES[name].kill is None, bool(dependencies(name))),
    )
    futures: dict[str, Future] = {}

    preloaded: Queue[PreloadedPython] = Queue()
    for _ in range(PARALLEL_JOBS):
        preloaded.put(PreloadedPython())

    def run_after_dependencies(name: str) -> Run:
        for dependency in dependencies(name):  # submitted ahead of it, so already running or done
            futures[dependency].result()
        return run_case(name, assets, root, preloaded)

    try:
        with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
            for name in order:
                futures[name] = pool.submit(run_after_dependencies, name)
            return {name: future.result() for name, future in futures.items()}
    finally:
        while not preloaded.empty():
            preloaded.get().close()


def finished_checkpoints(run_dir: Path) -> list[str]:
    """The finished checkpoints of a run directory, after checking that it holds no partial one."""
    if not run_dir.is_dir():
        return []
    leftovers = sorted(str(path.relative_to(run_dir)) for path in run_dir.rglob("*" + checkpoint.STAGING_SUFFIX))
    assert leftovers == [], f"staging leftovers in {run_dir}"
    steps = sorted(path.name for path in run_dir.glob("step_*"))
    unfinished = [step for step in steps if not checkpoint.is_checkpoint(run_dir / step)]
    assert unfinished == [], f"checkpoints without {checkpoint.TRAINER_STATE} in {run_dir}"
    latest = run_dir / checkpoint.LATEST
    if latest.exists():
        assert latest.read_text() in steps, f"{latest} names {latest.read_text()!r}, not a finished checkpoint"
    else:
        assert steps == [], f"{run_dir} has checkpoints but no {checkpoint.LATEST}"
    return steps


@pytest.mark.parametrize("name", FAILING)
def test_bad_input_fails_with_one_line_naming_the_fix(runs, name):
    run, entry = runs[name], CASES[name]
    assert run.finished.returncode != 0, run.output[-4000:]
    for expected in (entry.expected,) if isinstance(entry.expected, str) else entry.expected:
        assert re.search(expected, run.output), run.output[-4000:]
    assert finished_checkpoints(run.workdir / "out") == list(entry.checkpoints)
    for dependency in dependencies(name):  # the checkpoint that did not fit is left as it was
        assert finished_checkpoints(runs[dependency].workdir / "out") == list(CASES[dependency].checkpoints)


@pytest.mark.parametrize("name", ["rank_killed_in_generation", "rank_killed_in_update", "rollout_rank_killed"])
def test_a_killed_rank_ends_the_job_within_the_timeout_and_no_process_is_left(runs, name):
    run = runs[name]
    killed_at = float((run.workdir / "killed_at").read_text())
    assert run.ended_at - killed_at < TIMEOUT_S
    pids = [int(path.read_text()) for path in run.workdir.glob("pid.*")]
    assert len(pids) == CASES[name].nproc
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.parametrize(
    ("name", "counter", "logged"),
    [
        ("reward_raises_zero", "reward/errors", r"reward: \S+/raises\.py:score raised RuntimeError: no score today"),
        ("reward_nan_zero", "reward/non_finite", r"reward: \S+/nan\.py:score returned nan as 'score'"),
    ],
)
def test_reward_failures_under_on_error_zero_score_zero_and_are_counted(runs, name, counter, logged):
    run = runs[name]
    assert run.finished.returncode == 0, run.output[-4000:]
    assert re.search(logged, run.output), run.output[-4000:]
    (record,) = run.metrics()
    assert record[counter] == RESPONSES_PER_STEP
    assert record["reward/mean"] == 0.0
    assert finished_checkpoints(run.workdir / "out") == list(CASES[name].checkpoints)


@pytest.mark.parametrize("name", ["non_finite_gradients_skipped"])
def test_a_non_finite_gradient_skips_the_step_and_counts_it(runs, name):
    run = runs[name]
    assert run.finished.returncode == 0, run.output[-4000:]
    (record,) = run.metrics()
    assert record["actor/skipped_steps"] == 1
    assert finished_checkpoints(run.workdir / "out") == list(CASES[name].checkpoints)


@pytest.mark.parametrize("name", ["verl_rows_some_overlong_small_kv_cache"])
def test_overlong_prompts_under_skip_are_dropped_and_counted(runs, name):
    run = runs[name]
    assert run.finished.returncode == 0, run.output[-4000:]
    (record,) = run.metrics()
    assert record["data/skipped_prompts"] == 3
    assert finished_checkpoints(run.workdir / "out") == list(CASES[name].checkpoints)


@pytest.mark.parametrize("name", ["verl_rows_some_overlong_small_kv_cache"])
def test_a_kv_cache_of_a_few_sequences_preempts_and_finishes(runs, name):
    run = runs[name]
    assert run.finished.returncode == 0, run.output[-4000:]
    (record,) = run.metrics()
    assert record["rollout/preemptions"] > 0  # the budget was used: far fewer blocks than the requests wanted
    assert finished_checkpoints(run.workdir / "out") == list(CASES[name].checkpoints)


@pytest.mark.parametrize("config_error", CONFIG_ERRORS)
def test_cli_config_check_names_the_bad_key(config_error, capsys):
    """``spmd-rlhf config --show``'s entry function, in this process (tests/config runs the console command)."""
    from spmd_rlhf import cli

    entry = CONFIG_ERRORS[config_error]
    code = cli.main(["config", "--show", str(RECIPES / "configs" / "grpo.yaml"), *entry.overrides])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    assert re.search(entry.expected, captured.err), captured.err


def test_a_second_job_on_a_locked_output_dir_fails_naming_the_holder_and_touches_nothing(tmp_path):
    """The first job (here this test process) holds the lock and is mid-save; the second stops before any model loads,
    and its cleanup of staging leftovers never runs."""
    holder = RunLock(tmp_path / "out")
    holder.acquire()
    saving = tmp_path / "out" / "step_3.tmp"
    saving.mkdir()
    try:
        finished = torchrun(
            str(RECIPES / "grpo.py"),
            "--config",
            str(RECIPES / "configs" / "grpo.yaml"),
            "trainer.output_dir=out",
            "trainer.total_steps=1",
            nproc=1,
            timeout=120,
            cwd=str(tmp_path),
            recipe=True,
        )
    finally:
        holder.release()
    assert finished.returncode != 0, finished.stdout[-4000:]
    expected = rf"trainer\.output_dir=out is in use by host \S+, pid {os.getpid()}; wait for that run to end"
    assert re.search(expected, finished.stdout), finished.stdout[-4000:]
    assert saving.is_dir() and not (tmp_path / "tiny").exists()  # nothing touched, nothing built


def test_a_command_a_rank_cannot_decode_fails_at_once_naming_the_rank_and_the_cause(tmp_path):
    (tmp_path / "only_on_rank_zero.py").write_text(
        "from spmd_rlhf.runtime import Worker\n\n\nclass Greeter(Worker):\n    pass\n"
    )
    start = time.monotonic()
    finished = torchrun("rank_zero_only_module.py", str(tmp_path), nproc=2, timeout=120)
    output = finished.stdout
    assert finished.returncode != 0, output[-4000:]
    assert "NOT REACHED" not in output
    assert re.search(
        r"runtime\.decode failed on rank 1: could not decode the command from the coordinator \(ModuleNotFoundError: "
        r"No module named 'only_on_rank_zero'\); every node must import the same code",
        output,
    ), output[-4000:]
    assert time.monotonic() - start < 60  # failure_timeout_s is 120: the heartbeat did not end it


def test_export_refuses_a_crafted_metadata_file_without_running_it(tmp_path):
    assets = tmp_path / "assets"
    make_tiny(family="qwen2", out_dir=str(assets / "model"))
    marker = tmp_path / CRAFTED_MARKER
    write_crafted_checkpoint(tmp_path / "crafted", model_dir=assets / "model", marker=marker)
    finished = subprocess.run(
        [sys.executable, "-m", "spmd_rlhf.cli", "export", str(tmp_path / "crafted"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
    )
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert re.search(
        r"export error: \S+/crafted/step_1/actor_state/\.metadata references (posix|os)\.system", finished.stderr
    ), finished.stderr
    assert not marker.exists()


def test_resume_refuses_a_crafted_metadata_file_without_running_it(runs, assets):
    assert runs["resume_crafted_metadata"].finished.returncode != 0
    assert not (assets / CRAFTED_MARKER).exists()


@pytest.mark.parametrize("name", ["ppo_checkpoint"])
def test_export_refuses_a_non_empty_target_and_overwrite_empties_it_first(runs, name, tmp_path, capsys):
    """Through the command's entry in this process (as tests/checkpoint's export errors)."""
    from spmd_rlhf.cli import main

    target = tmp_path / "hf"
    stale = target / "actor" / "model-00002-of-00002.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_text("a shard of an earlier export")
    command = ["export", str(runs[name].workdir / "out"), str(target)]
    assert main(command) == 2
    refused = capsys.readouterr().err
    assert re.search(
        r"export error: \S+/hf is not empty; export into a new or empty directory, or pass --overwrite", refused
    ), refused
    assert stale.is_file()
    assert main([*command, "--overwrite"]) == 0, capsys.readouterr()
    assert not stale.exists() and (target / "actor" / "model.safetensors").is_file()
    assert finished_checkpoints(runs[name].workdir / "out") == ["step_1"]


POOL_OWNER = """
import os, sys, time
from spmd_rlhf.rewards import RewardRow, RewardRunner

if __name__ == "__main__":
    runner = RewardRunner(sys.argv[2], num_workers=2, timeout_s=60)
    runner.score([RewardRow("synthetic/arithmetic", "1", "1", {})] * 4)
    workers = list(runner._pool._processes)
    servers = {int(open(f"/proc/{pid}/stat").read().split(")")[-1].split()[1]) for pid in workers}
    runner._pool.submit(time.sleep, 600)  # a call still running when the rank ends
    time.sleep(1)
    open(sys.argv[1], "w").write(" ".join(map(str, [*workers, *servers - {os.getpid()}])))
    os._exit(1)  # how a failed job ends its ranks: no cleanup runs
"""


def test_reward_pool_processes_and_their_forkserver_end_with_the_rank(tmp_path):
    program, pids = tmp_path / "pool_owner.py", tmp_path / "pids"
    program.write_text(POOL_OWNER)
    finished = subprocess.run(
        [sys.executable, str(program), str(pids), "synthetic/arithmetic"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
    )
    assert finished.returncode == 1, finished.stderr[-4000:]
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3  # two workers and the forkserver
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in started if alive(pid)] == []


def test_verl_row_variants_read_as_the_plain_rows(assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tiny" / "model"))
    plain = PromptDataset([str(assets / "no_prompt.jsonl")], tokenizer, prompt_key="question", max_prompt_length=64)
    variants = PromptDataset([str(assets / "variants.json")], tokenizer, max_prompt_length=64)
    assert variants.prompts == plain.prompts and len(plain.prompts) == 16


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "1+1=", "reward_model": "42"}, r"row 0: reward_model is 42; it must be an object such as"),
        (
            {"prompt": [{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]},
            r"row 0: a message's content must be text or a list of \{type: text, text\} parts",
        ),
        ({"prompt": [{"role": "user", "content": "1+1="}]}, None),
    ],
)
def test_row_fields_in_unusable_shapes_name_the_file_and_row(tmp_path, assets, row, expected):
    from transformers import AutoTokenizer

    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(assets / "tiny" / "model"))
    if expected is None:
        assert len(PromptDataset([str(tmp_path / "rows.jsonl")], tokenizer, max_prompt_length=64)) == 1
        return
    with pytest.raises(DatasetError, match=r"\S+/rows\.jsonl " + expected):
        PromptDataset([str(tmp_path / "rows.jsonl")], tokenizer, max_prompt_length=64)


@pytest.mark.parametrize("name", ["verl_rows_some_overlong_small_kv_cache"])
def test_a_json_array_of_verl_row_variants_trains(runs, name):
    run = runs[name]
    assert run.finished.returncode == 0, run.output[-4000:]
    (record,) = run.metrics()
    assert record["reward/errors"] == 0  # every row's ground truth was read from its reward_model string
    assert finished_checkpoints(run.workdir / "out") == list(CASES[name].checkpoints)


def test_a_role_model_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, assets):
    from transformers import AutoTokenizer

    from spmd_rlhf.config import load_config
    from spmd_rlhf.controller.vocabularies import check_role_vocabularies

    other = tmp_path / "other_tokenizer"
    shutil.copytree(assets / "tiny" / "model", other)
    settings = json.loads((other / "tokenizer.json").read_text())
    vocabulary = settings["model"]["vocab"]
    first, second = list(vocabulary)[-2:]  # the same tokens, two of them swapped: every id no longer means the same
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (other / "tokenizer.json").write_text(json.dumps(settings))
    model = str(assets / "tiny" / "model")
    config = load_config(
        str(RECIPES / "configs" / "grpo.yaml"), [f"model.path={model}", f"reference.model_path={other}"]
    )
    with pytest.raises(
        ValueError,
        match=r"reference\.model_path=\S+/other_tokenizer has a tokenizer with another "
        r"vocabulary than the policy's",
    ):
        check_role_vocabularies(config, AutoTokenizer.from_pretrained(model))
    shutil.copytree(assets / "tiny" / "model", tmp_path / "copy")
    same = load_config(
        str(RECIPES / "configs" / "grpo.yaml"), [f"model.path={model}", f"reference.model_path={tmp_path / 'copy'}"]
    )
    check_role_vocabularies(same, AutoTokenizer.from_pretrained(model))  # the same tokenizer elsewhere is fine
