"""The code-execution reward: programs with known outcomes across the three test schemas, and hostile programs
(endless loops and output, forks, huge allocations, secrets in the environment, writes outside the directory), each
ending as a failed test within its time budget."""

from __future__ import annotations

import json
import time

import pytest

from spmd_rlhf.rewards import RULES, RewardRow, RewardRunner, RuleReward
from spmd_rlhf.rewards.code import CODE_DATA_SOURCES, STARTUP_S, code_score, extract_program, parse_tests

LIMIT_S = 1.0
BUDGET_S = LIMIT_S + STARTUP_S + 2.0
"""Wall time one test may take here: its limits, the interpreter's start, and slack for a loaded machine."""

STDIO = {"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3\n", "12\n", "7\n"]}
CALL = {"fn_name": "add", "inputs": [[1, 2], [5, 7], [10, -3]], "outputs": [3, 12, 7]}
ASSERT = {
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 7) == 12\n",
    "entry_point": "add",
}
MBPP = {"test": ["assert add(1, 2) == 3", "assert add(5, 7) == 12", "assert add(10, -3) == 7"]}


def fenced(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}\n```\nIt adds the numbers."


def score(program: str, tests, **kwargs) -> dict[str, float]:
    return code_score("code", fenced(program), tests, {}, time_limit_s=LIMIT_S, **kwargs)


def failures(result: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in result.items() if key != "score" and value}


READ_SUM = "a, b = map(int, input().split())\nprint(a + b)"
DEFINE_ADD = "def add(a, b):\n    return a + b"


@pytest.mark.parametrize(
    ("program", "tests"),
    [(READ_SUM, STDIO), (DEFINE_ADD, CALL), (DEFINE_ADD, ASSERT), (DEFINE_ADD, MBPP)],
    ids=["stdio", "call", "assert", "mbpp"],
)
def test_correct_program_scores_one(program, tests):
    result = score(program, json.dumps(tests))
    assert result["score"] == 1.0
    assert failures(result) == {"passed": len(parse_tests(tests))}


@pytest.mark.parametrize(
    ("program", "tests", "passed"),
    [
        ("a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)", STDIO, 1),
        ("def add(a, b):\n    return a + b if a < 5 else 0", CALL, 1),
        ("def add(a, b):\n    return a + b if a < 5 else 0", ASSERT, 0),  # one check(): all or nothing
        ("def add(a, b):\n    return a + b if a < 5 else 0", MBPP, 1),
    ],
    ids=["stdio", "call", "assert", "mbpp"],
)
def test_wrong_program_scores_its_share(program, tests, passed):
    result = score(program, tests)
    total = len(parse_tests(tests))
    assert result["score"] == pytest.approx(passed / total)
    assert failures(result) == ({"passed": passed, "wrong_answer": total - passed} if passed else {"wrong_answer": 1})


def test_all_or_nothing_stops_at_the_first_failure():
    result = score("a, b = map(int, input().split())\nprint(0 if a == 5 else a + b)", STDIO, all_or_nothing=True)
    assert result["score"] == 0.0
    assert failures(result) == {"passed": 1, "wrong_answer": 1}  # the third test was not run


HOSTILE = {
    "timeout": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(600)",
    "crash": "raise RuntimeError('boom')",
    "syntax": "def add(a, b) return a + b",
    "memory": "hoard = bytearray(64 * 1024**3)",
    "memory_growing": "hoard = []\nwhile True:\n    hoard.append(bytearray(10**6))",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "ctypes_fork": "import ctypes\nctypes.CDLL(None).fork()",
    "endless_print": "while True:\n    print('spam' * 1000)",
    "endless_write": "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
    "exit_early": "import os\nos._exit(0)",
}
EXPECTED = {
    "timeout": "timeout",
    "sleep": "timeout",
    "crash": "runtime_error",
    "syntax": "syntax_error",
    "memory": "memory",
    "memory_growing": "memory",
    "fork_bomb": "runtime_error",
    "subprocess": "runtime_error",
    "ctypes_fork": "runtime_error",
    "endless_print": "output_limit",
    "endless_write": "output_limit",
    "exit_early": "runtime_error",
}


@pytest.mark.parametrize("tests", [STDIO, CALL, ASSERT], ids=["stdio", "call", "assert"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_program_fails_within_its_budget(case, tests):
    if case == "exit_early" and tests is STDIO:
        pytest.skip("an stdio program may exit early; its output is what counts")
    tests = {**tests, "inputs": tests["inputs"][:1], "outputs": tests["outputs"][:1]} if "inputs" in tests else tests
    start = time.monotonic()
    result = score(HOSTILE[case], tests)
    assert time.monotonic() - start < BUDGET_S
    assert result["score"] == 0.0
    assert failures(result) == {EXPECTED[case]: 1}


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("SPMD_RLHF_TEST_SECRET", "hunter2")
    program = "import os\nprint(os.environ.get('SPMD_RLHF_TEST_SECRET', 'no secret'))"
    assert failures(score(program, {"inputs": [""], "outputs": ["hunter2"]})) == {"wrong_answer": 1}
    assert failures(score(program, {"inputs": [""], "outputs": ["no secret"]})) == {"passed": 1}


def test_other_processes_are_not_readable():
    program = "import os\nopen(f'/proc/{os.getppid()}/environ', 'rb').read()\nprint('read')"
    assert failures(score(program, {"inputs": [""], "outputs": ["read"]})) == {"runtime_error": 1}


def test_writes_stay_in_the_working_directory(tmp_path):
    outside = tmp_path / "written.txt"
    program = f"open({str(outside)!r}, 'w').write('x')\nprint('written')"
    assert failures(score(program, {"inputs": [""], "outputs": ["written"]})) == {"runtime_error": 1}
    assert not outside.exists()
    inside = "open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())"
    assert failures(score(inside, {"inputs": [""], "outputs": ["x"]})) == {"passed": 1}


def test_outputs_compare_by_tokens_and_numbers():
    program = "print('3.0000000001  ')\nprint()"
    assert score(program, {"inputs": [""], "outputs": [["3"]]})["score"] == 1.0  # APPS's list of lines
    assert score("print('3 4')", [{"input": "", "output": "3\n4\n"}])["score"] == 1.0
    assert score("print('3 4 5')", [{"input": "", "output": "3 4"}])["score"] == 0.0


def test_call_based_forms():
    leetcode = "class Solution:\n    def add(self, a, b):\n        return [a + b]"
    assert score(leetcode, {**CALL, "outputs": [[3], [12], [[7]]]})["score"] == 1.0
    assert failures(score("def other(a, b):\n    return 0", CALL)) == {"runtime_error": 3}
    assert failures(score("def add(a, b):\n    return object()", CALL)) == {"wrong_answer": 3}


def test_program_extraction():
    assert extract_program("```python\nfirst\n```\ntext\n```py\nsecond\n```") == "second\n"
    assert extract_program("print(1)") == "print(1)"
    assert extract_program("```python\nunfinished") == "```python\nunfinished"


def test_bad_ground_truth_names_the_schemas():
    with pytest.raises(ValueError, match="inputs"):
        code_score("code", "print(1)", {"inputs": [], "outputs": []})
    with pytest.raises(ValueError, match="max_tests"):
        code_score("code", "print(1)", STDIO, max_tests=0)


def test_parquet_columns_and_max_tests():
    numpy = pytest.importorskip("numpy")
    tests = {"fn_name": "add", "inputs": numpy.array([[1, 2], [5, 7]]), "outputs": numpy.array([3, 12])}
    assert failures(score(DEFINE_ADD, tests)) == {"passed": 2}
    assert failures(score(READ_SUM, STDIO, max_tests=2)) == {"passed": 2}


def test_registered_and_configurable():
    assert all(RULES[name] is code_score for name in CODE_DATA_SOURCES)
    RuleReward("code", {"time_limit_s": 2, "memory_mb": 256, "all_or_nothing": True})
    with pytest.raises(ValueError, match="does not take"):
        RuleReward("code", {"time_limit": 2})


def test_scores_in_worker_processes():
    runner = RewardRunner("auto", rule_kwargs={"time_limit_s": LIMIT_S}, num_workers=2, timeout_s=30)
    try:
        rows = [
            RewardRow("apps", fenced(READ_SUM), json.dumps(STDIO), {}),
            RewardRow("taco", fenced(HOSTILE["fork_bomb"]), STDIO, {}),
            RewardRow("codecontests", fenced(HOSTILE["timeout"]), {**STDIO, "inputs": ["1 2"], "outputs": ["3"]}, {}),
        ]
        result = runner.summarize(runner.score(rows))
    finally:
        runner.close()
    assert result.scores == [1.0, 0.0, 0.0]
    assert result.extras["runtime_error"] == [0, 3, 0] and result.extras["timeout"] == [0, 0, 1]
    assert sum(result.failures.values()) == 0
