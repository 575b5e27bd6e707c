"""The reward service client against a local HTTP server started in a thread: scores and extras come back in order,
requests that time out, drop the connection, fail with 5xx or answer garbage are resent a bounded number of times and
then count as failures under on_error, bad single scores fail their row alone, and the reward worker sends the
prompt's and the response's text and reports the resends."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.rewards import RemoteReward, RewardError, RewardRow, check_failure_fraction
from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import train_tokenizer
from spmd_rlhf.workers.reward import RewardWorker

HANG = object()
"""An answer that never comes: the handler waits until the server stops."""
DROP = object()
"""No answer: the handler closes the connection."""

Reply = tuple[int, object] | object


class Service:
    """A scoring service on a free local port; ``answer(request_number, rows)`` decides each reply: (status, JSON
    value or raw bytes), ``HANG`` or ``DROP``. ``requests`` keeps every request's rows."""

    def __init__(self, answer: Callable[[int, list[dict]], Reply]) -> None:
        self.requests: list[list[dict]] = []
        self.release = threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                rows = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["rows"]
                service.requests.append(rows)
                reply = answer(len(service.requests), rows)
                if reply is HANG:
                    service.release.wait()
                    return
                if reply is DROP:
                    self.close_connection = True
                    return
                status, body = reply
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"


@contextmanager
def serving(answer: Callable[[int, list[dict]], Reply]) -> Iterator[Service]:
    service = Service(answer)
    thread = threading.Thread(target=service.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.release.set()
        service.server.shutdown()
        service.server.server_close()


def computed(row: dict) -> float | dict:
    """The good service's score: the response's length plus the extra_info index / 100; odd rows with extras."""
    score = len(row["response"]) + row["extra_info"]["index"] / 100
    if row["extra_info"]["index"] % 2:
        return {"score": score, "length": float(len(row["response"])), "label": "odd"}
    return score


def good(request: int, rows: list[dict]) -> Reply:
    return 200, {"scores": [computed(row) for row in rows]}


ROWS = [
    RewardRow("my/source", "x" * index, str(index), {"index": index}, prompt=f"What is {index}?") for index in range(5)
]


def client(url: str, **options: object) -> RemoteReward:
    settings = {"batch_size": 2, "timeout_s": 2.0, "retries": 2, "backoff_s": 0.05} | options
    return RemoteReward(url, **settings)


def test_scores_and_extras_come_back_in_order_in_batches() -> None:
    with serving(good) as service:
        remote = client(service.url)
        outcomes = remote.score(ROWS)
    assert [len(rows) for rows in service.requests] == [2, 2, 1]
    sent = [row for rows in service.requests for row in rows]
    assert sent[3] == {
        "data_source": "my/source",
        "prompt": "What is 3?",
        "response": "xxx",
        "ground_truth": "3",
        "extra_info": {"index": 3},
    }
    result = remote.summarize(outcomes)
    assert result.scores == [index + index / 100 for index in range(5)]
    assert result.extras == {"length": [1.0, 3.0]}  # numbers only: the "label" string is left out
    assert result.failures == {"errors": 0, "timeouts": 0, "non_finite": 0}
    assert result.retries == 0


def test_a_hanging_service_times_out_is_retried_then_counted_within_the_bound() -> None:
    timeout_s, retries, backoff_s = 0.3, 2, 0.05
    with serving(lambda request, rows: HANG) as service:
        remote = client(service.url, batch_size=8, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        started = time.monotonic()
        outcomes = remote.score(ROWS)
        elapsed = time.monotonic() - started
    assert len(service.requests) == retries + 1
    backoff = backoff_s + 2 * backoff_s
    assert timeout_s * (retries + 1) <= elapsed < timeout_s * (retries + 1) + backoff + 1.0
    result = remote.summarize(outcomes)
    assert result.scores == [0.0] * 5
    assert result.failures == {"errors": 0, "timeouts": 5, "non_finite": 0}
    assert result.retries == retries
    assert "failed after 3 tries, the last timed out" in outcomes[0].message


GARBAGE = {
    "not JSON": (200, b"<html>oops</html>"),
    "no scores list": (200, {"score": [1.0]}),
    "a JSON list": (200, [1.0, 2.0]),
    "wrong length": (200, {"scores": [1.0]}),
    "dropped connection": DROP,
    "HTTP 503": (503, b"overloaded"),
}


@pytest.mark.parametrize("reply", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_and_lost_requests_are_retried_then_counted_as_errors(reply: Reply) -> None:
    with serving(lambda request, rows: reply) as service:
        remote = client(service.url)
        result = remote.summarize(remote.score(ROWS[:2]))
    assert len(service.requests) == 3
    assert result.scores == [0.0, 0.0]
    assert result.failures == {"errors": 2, "timeouts": 0, "non_finite": 0}
    assert result.retries == 2


def test_a_server_error_then_success_recovers() -> None:
    with serving(lambda request, rows: (500, b"busy") if request == 1 else good(request, rows)) as service:
        remote = client(service.url, batch_size=8)
        result = remote.summarize(remote.score(ROWS))
    assert len(service.requests) == 2
    assert result.scores == [index + index / 100 for index in range(5)]
    assert result.failures == {"errors": 0, "timeouts": 0, "non_finite": 0}
    assert result.retries == 1


def test_a_client_error_is_not_retried() -> None:
    with serving(lambda request, rows: (400, b"rows need a 'question' field")) as service:
        remote = client(service.url)
        outcomes = remote.score(ROWS[:2])
    assert len(service.requests) == 1
    assert [outcome.failure for outcome in outcomes] == ["error", "error"]
    assert "HTTP 400" in outcomes[0].message and "rows need a 'question' field" in outcomes[0].message


def test_a_refused_connection_counts_as_errors() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    remote = client(f"http://127.0.0.1:{port}/score", retries=1)
    outcomes = remote.score(ROWS[:1])
    assert outcomes[0].failure == "error" and "could not connect" in outcomes[0].message


def test_a_bad_single_score_fails_its_row_alone_unretried() -> None:
    with serving(lambda request, rows: (200, b'{"scores": [1.5, NaN, "high", {"value": 2}]}')) as service:
        remote = client(service.url, batch_size=8)
        outcomes = remote.score(ROWS[:4])
    assert len(service.requests) == 1
    assert [outcome.failure for outcome in outcomes] == [None, "non_finite", "error", "error"]
    assert outcomes[0].score == 1.5
    assert "nan" in outcomes[1].message and "'high'" in outcomes[2].message and "'score'" in outcomes[3].message


def test_abort_raises_naming_the_url_and_the_cause_while_zero_counts() -> None:
    def half_garbage(request: int, rows: list[dict]) -> Reply:
        return (200, b"garbage") if rows[0]["extra_info"]["index"] == 0 else good(request, rows)

    with serving(half_garbage) as service:
        zero = client(service.url, retries=0)
        result = zero.summarize(zero.score(ROWS))
        assert result.scores == [0.0, 0.0] + [index + index / 100 for index in range(2, 5)]
        assert result.failures["errors"] == 2
        abort = client(service.url, retries=0, on_error="abort")
        outcomes = abort.score(ROWS)
    with pytest.raises(RewardError) as caught:
        abort.summarize(outcomes)
    message = str(caught.value)
    assert f"POST {service.url} failed after 1 try, the last was answered 'garbage', not JSON" in message
    assert "1 more of 5 rows failed too" in message and f"Fix the reward service at {service.url}" in message
    with pytest.raises(RewardError, match=f"2 of 5 calls failed.*Fix the reward service at {service.url}"):
        check_failure_fraction(result.failures, 5, max_failure_fraction=0.2, name="reward", fix=zero.fix)


def test_backoff_doubles_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr("spmd_rlhf.rewards.remote.time.sleep", waits.append)
    with serving(lambda request, rows: (502, b"bad gateway")) as service:
        RemoteReward(service.url, retries=6).score(ROWS[:1])
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="reward.url='ftp://host': must be an http"):
        RemoteReward("ftp://host")
    with pytest.raises(ValueError, match="reward.on_error='skip'"):
        RemoteReward("http://host", on_error="skip")


def test_the_reward_worker_sends_prompt_and_response_text_and_reports_retries() -> None:
    # The worker's remote path on one rank, without a process group: its context and reducer are stand-ins (the
    # split over a replica's ranks is the rule path's, tested with torchrun in test_reward_worker.py).
    tokenizer = train_tokenizer(task_corpus("arithmetic"), vocab_size=300)
    prompts = [tokenizer(text)["input_ids"] for text in ("1+2=", "13+4=")]
    responses = [tokenizer(text)["input_ids"] for text in ("3", "17")]
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses)) + 1
    tensors = {
        "prompts": torch.zeros(2, prompt_width, dtype=torch.long),
        "responses": torch.zeros(2, response_width, dtype=torch.long),
        "response_mask": torch.zeros(2, response_width, dtype=torch.long),
        "attention_mask": torch.zeros(2, prompt_width + response_width, dtype=torch.long),
    }
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        tensors["prompts"][row, prompt_width - len(prompt) :] = torch.tensor(prompt)  # left-padded, as generated
        tensors["attention_mask"][row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
        tensors["responses"][row, : len(response)] = torch.tensor(response)
        tensors["response_mask"][row, : len(response)] = 1
    non_tensors = {"data_source": ["a", "b"], "ground_truth": ["3", "17"], "extra_info": [{"index": 0}, {"index": 1}]}
    batch = Batch(tensors, non_tensors, {}, group_size=1)
    with serving(lambda request, rows: (503, b"busy") if request == 1 else good(request, rows)) as service:
        worker = RewardWorker.__new__(RewardWorker)
        worker.context = SimpleNamespace(
            name="reward", dims=SimpleNamespace(tp=1, pp=1), coordinates=SimpleNamespace(tp=0, pp=0)
        )
        worker.role_config = load_config(None, ["reward.kind=remote", f"reward.url={service.url}"]).reward
        worker.output_key, worker.scorer, worker.judge, worker.tokenizer = "scores", None, None, tokenizer
        worker.runner = client(service.url)
        worker.reducer = SimpleNamespace(gather_objects=lambda value: [value])
        scored = worker.compute_rewards(batch)
    assert [(row["prompt"], row["response"]) for row in service.requests[-1]] == [("1+2=", "3"), ("13+4=", "17")]
    torch.testing.assert_close(scored["scores"], torch.tensor([1.0, 2.01]))
    metrics = scored.meta["metrics"]
    assert metrics["reward/remote_retries"] == 1.0 and metrics["reward/errors"] == 0.0
    assert metrics["reward/length/mean"] == 2.0
