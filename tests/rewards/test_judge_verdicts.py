"""A generative judge's text side (``rewards.judge``): the prompts it is given, the scores read from what it writes,
the fallback and its count, the judge settings refused when the config is read, and the judge in the dry run."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from spmd_rlhf.config import ConfigError, ScoringRoleConfig, load_config
from spmd_rlhf.controller.dry_run import describe
from spmd_rlhf.controller.vocabularies import check_role_vocabularies
from spmd_rlhf.data.retokenize import judge_tokenizer
from spmd_rlhf.rewards.judge import JudgeParser, prompt_text
from spmd_rlhf.tiny.model import make_tiny

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def parser(**keys) -> JudgeParser:
    return JudgeParser(ScoringRoleConfig(kind="generative", model_path="judge", **keys), role="reward")


def test_the_default_reads_the_last_number_and_normalises_it_over_the_range():
    judge = parser()
    assert judge.score("The answer 12 is wrong... Score: 7") == pytest.approx(0.7)
    assert judge.score("Score: 2.5") == pytest.approx(0.25)
    assert judge.score("10") == 1.0 and judge.score("0") == 0.0
    assert judge.score("no number at all") is None
    assert judge.score("Score: 11") is None  # outside [0, 10]: unparsed, not clipped
    assert judge.score("Score: -1") is None


def test_a_pattern_of_ones_own_reads_its_group_in_its_last_match():
    judge = parser(judge_score_pattern=r"Score:\s*(\d+)/10", judge_score_range=[1, 5])
    assert judge.score("Score: 3/10, no wait, Score: 5/10") == 1.0
    assert judge.score("Score: 7/10") is None  # in the pattern, out of range
    assert judge.score("I'd say 4") is None
    verdict = parser(judge_score_pattern=r"\[\[(A|B|\d)\]\]")  # a group that need not be a number
    assert verdict.score("[[3]] then [[A]]") is None and verdict.score("[[A]] then [[3]]") == pytest.approx(0.3)


def test_unparsed_verdicts_get_the_fallback_and_are_counted():
    verdicts = parser(judge_fallback_score=0.5).verdicts(["Score: 10", "gibberish", "Score: 99", "Score: 2"])
    assert verdicts.scores == pytest.approx([1.0, 0.5, 0.5, 0.2])
    assert verdicts.unparsed == 2
    assert parser().verdicts(["Score: 4"]).unparsed == 0


def test_the_template_is_filled_with_the_prompt_response_and_reference():
    judge = parser(judge_template="Q: {prompt}\nA: {response}\nRef: {reference}\n{{json}}")
    assert judge.user_message("2+2?", "4", 4) == "Q: 2+2?\nA: 4\nRef: 4\n{json}"
    assert judge.user_message([{"role": "user", "content": "hi"}], "yo", None) == "Q: hi\nA: yo\nRef: \n{json}"
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_text(conversation) == "system: be brief\nuser: hi"
    default = parser().user_message("2+2?", "4", None)  # judge_template=null: the built-in template
    assert "Prompt:\n2+2?" in default and "Response:\n4" in default and "Score: N" in default


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"judge_template": "Rate {prompt}"}, "does not name {response}"),
        ({"judge_template": "{response} {answer}"}, "names answer"),
        ({"judge_template": "{response} {"}, "literal braces"),
        ({"judge_score_pattern": r"Score: \d+"}, "has no group"),
        ({"judge_score_pattern": r"(\d+"}, "is not a regular expression"),
        ({"judge_score_range": [10, 0]}, "low < high"),
        ({"judge_score_range": [0]}, "low < high"),
        ({"judge_top_p": 0}, "judge_top_p=0"),
        ({"judge_max_new_tokens": 0}, "judge_max_new_tokens=0"),
        ({"pp": 2}, "set pp=1"),
    ],
)
def test_bad_judge_settings_are_refused_naming_the_fix(keys, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("[", r"\[")):
        ScoringRoleConfig(kind="generative", model_path="judge", **keys)


def test_a_judge_needs_a_model_and_a_chat_template():
    with pytest.raises(ConfigError, match="reward.kind=generative needs the directory of a causal LM"):
        load_config(RECIPES / "configs" / "grpo.yaml", ["reward.kind=generative"])
    untemplated = SimpleNamespace(chat_template=None, name_or_path="plain")
    with pytest.raises(ValueError, match="has no chat template.*reward.tokenizer_path"):
        judge_tokenizer(ScoringRoleConfig(kind="generative"), untemplated, role="reward")


def test_the_dry_run_counts_the_judge_as_a_replica_and_its_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tiny policy's assets are built here
    judge = make_tiny(family="llama", out_dir=str(tmp_path / "judge"), hidden_size=32, chat_template="role_colon")
    overrides = ["reward.kind=generative", f"reward.model_path={judge}", "reward.judge_max_new_tokens=48"]
    report = describe(load_config(RECIPES / "configs" / "grpo.yaml", overrides), 2)
    (line,) = [line for line in report.splitlines() if line.startswith("reward ")]
    assert "a judge replica per DP rank" in line and "up to 48 tokens per response" in line


def test_a_judge_that_cannot_read_its_prompts_is_refused_at_start(tmp_path):
    judge = make_tiny(family="llama", out_dir=str(tmp_path / "judge"), hidden_size=32, chat_template="role_colon")
    tokenizer = AutoTokenizer.from_pretrained(judge)

    def check(model_path: str, *overrides: str) -> None:
        grpo = str(RECIPES / "configs" / "grpo.yaml")
        overrides = [f"model.path={judge}", "reward.kind=generative", f"reward.model_path={model_path}", *overrides]
        check_role_vocabularies(load_config(grpo, overrides), tokenizer)

    check(judge)
    with pytest.raises(ValueError, match=r"rollout\.environment=tool .* a generative judge cannot read as text yet"):
        check(judge, "rollout.environment=tool")
    no_template = tmp_path / "no_template"
    shutil.copytree(judge, no_template)
    settings = json.loads((no_template / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(settings))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"judge's tokenizer \(\S+/no_template\) has no chat template.*tokenizer_path"):
        check(str(no_template))


def test_rows_too_long_for_the_judges_context_take_the_fallback_without_being_generated(tmp_path):
    """A real ``Judge`` on one rank, its model's context just the short row's prompt and verdict budget: the long
    row's prompt (the template, the prompt and its long response) and verdict would exceed it, so it is never
    generated, takes the fallback and is counted."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rlhf.data import Batch
    from spmd_rlhf.workers.judge import Judge

    model_dir = make_tiny(family="llama", out_dir=str(tmp_path / "judge"), hidden_size=32, chat_template="role_colon")
    config = load_config(
        RECIPES / "configs" / "grpo.yaml",
        [f"model.path={model_dir}", "reward.kind=generative", f"reward.model_path={model_dir}"],
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
        context = SimpleNamespace(name="reward", mesh=mesh, device=torch.device("cpu"))
        judge = Judge(context, config, config.reward, policy_tokenizer=tokenizer)
        short, long = (
            tokenizer("4", add_special_tokens=False)["input_ids"],
            tokenizer(" ".join(["one plus two"] * 40), add_special_tokens=False)["input_ids"],
        )
        width = max(len(short), len(long))
        responses = torch.tensor([short + [0] * (width - len(short)), long + [0] * (width - len(long))])
        mask = torch.tensor(
            [[1] * len(short) + [0] * (width - len(short)), [1] * len(long) + [0] * (width - len(long))]
        )
        batch = Batch(
            {"responses": responses, "response_mask": mask, "uid": torch.arange(2)},
            {"raw_prompt": ["2+2?", "1+2?"], "ground_truth": ["4", "3"]},
        )
        fitting, too_long = (len(ids) for ids in judge.prompt_ids(batch))
        assert too_long > fitting
        # The context holds the short row's prompt and a whole verdict, not the long one's.
        context = fitting + judge.params.max_new_tokens
        judge.model.args = dataclasses.replace(judge.model.args, max_position_embeddings=context)
        judged = judge.judge(batch)
    finally:
        if started:
            dist.destroy_process_group()
    assert judged.too_long == 1
    assert judged.scores[1] == config.reward.judge_fallback_score
    assert 0 < judged.generated_tokens <= config.reward.judge_max_new_tokens  # the short row alone was generated
