"""The actor's stop ids: ``rollout.stop_token_ids`` joined with the eos_token_id(s) of the model's
generation_config.json; an id past the vocabulary is an error naming where it came from."""

from __future__ import annotations

import json

import pytest

from spmd_rlhf.workers.generation import stop_token_ids


def test_configured_ids_join_the_generation_config_eos_list(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert stop_token_ids([3, 7], str(tmp_path), vocab_size=10) == {3, 7, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_token_ids([], str(tmp_path), vocab_size=10) == {5}


def test_without_a_generation_config_only_the_configured_ids(tmp_path):
    assert stop_token_ids([2], str(tmp_path), vocab_size=10) == {2}


def test_an_id_past_the_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"stop token ids \[12\].*rollout.stop_token_ids"):
        stop_token_ids([12], str(tmp_path), vocab_size=10)
