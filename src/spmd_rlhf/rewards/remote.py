"""A reward service client (``reward.kind=remote``): rows are POSTed as JSON, ``reward.remote_batch_size`` at a time,
to ``reward.url``, a scoring service a team already runs, and its scores come back.

The protocol, one request per batch of rows::

    POST <reward.url>                      Content-Type: application/json
    {"rows": [{"data_source": "openai/gsm8k", "prompt": "...", "response": "...", "ground_truth": "42",
               "extra_info": {"index": 7}}, ...]}

    200 OK
    {"scores": [1.0, {"score": 0.5, "correct": 1.0, "format": 0.0}, ...]}

``prompt`` is the text the policy was given (chat template applied, padding removed), ``response`` its decoded answer
without special tokens; ``data_source``, ``ground_truth`` and ``extra_info`` are the dataset row's. ``scores`` holds
one entry per row, in order: a number, or an object with a ``"score"`` whose other numbers become metrics
(``reward/<key>/mean``), as a rule's dict result does.

A request fails when it runs longer than ``remote_timeout_s`` (the limit applies to connecting and to each read, as
``urllib`` sets it), cannot connect or loses its connection, is answered HTTP 5xx, 408 or 429, or is answered
something that is not a JSON object with a ``"scores"`` list as long as the request's rows. Such a request is sent
again up to ``remote_retries`` times, after 0.5 s, then 1 s, doubling up to ``MAX_BACKOFF_S``; other HTTP errors (a
4xx: the service refuses the request itself) are not retried. Once it has failed for good, each of its rows is a
failure (``timeouts`` when the last try timed out, else ``errors``). A score that is not a number, or is non-finite or
beyond float32's range, fails its row alone (``errors``, ``non_finite``), unretried: the service computed it. Failures
are then handled as a rule's are (``spmd_rlhf.rewards.runner``): logged, and scored 0 and counted under
``on_error=zero`` (a step where more than ``max_failure_fraction`` of the rows failed still stops) or raised, naming
the URL and the cause, under ``on_error=abort``. A call of ``score`` returns within
``(remote_retries + 1) * remote_timeout_s`` plus the backoff per batch, for a service that accepts the connection and
never answers.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from spmd_rlhf.rewards.registry import NonFiniteReward, parse_score
from spmd_rlhf.rewards.runner import (
    ON_ERROR,
    RewardOutcome,
    RewardRow,
    RewardScores,
    log_failures,
    shorten,
    summarize_outcomes,
)

BACKOFF_S = 0.5
"""Wait before the first resend of a failed request; each further resend waits twice as long."""
MAX_BACKOFF_S = 8.0
"""The longest wait before a resend."""
RETRIED_STATUSES = (408, 429)
"""HTTP statuses below 500 that are resent (request timeout, too many requests); every 5xx is too."""


class _RequestFailed(Exception):
    """A request that got no usable answer: ``kind`` is the failure its rows count as, ``retried`` whether sending it
    again may help."""

    def __init__(self, kind: str, cause: str, *, retried: bool = True) -> None:
        super().__init__(cause)
        self.kind = kind
        self.cause = cause
        self.retried = retried


class RemoteReward:
    """Scores rows by POSTing them to ``url`` (see the module docstring), with the same ``score`` / ``summarize``
    split as ``RewardRunner``; ``name`` is the config section (``reward`` or ``cost``) that messages refer to."""

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 64,
        timeout_s: float = 30.0,
        retries: int = 3,
        on_error: str = "zero",
        name: str = "reward",
        backoff_s: float = BACKOFF_S,
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"{name}.on_error={on_error!r}: must be one of {', '.join(ON_ERROR)}")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name}.url={url!r}: must be an http:// or https:// URL")
        if batch_size < 1 or timeout_s <= 0 or retries < 0:
            raise ValueError(
                f"{name}: remote_batch_size={batch_size}, remote_timeout_s={timeout_s}, remote_retries={retries}: "
                f"need >= 1, > 0 and >= 0"
            )
        self.url = url
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.retries = retries
        self.on_error = on_error
        self.name = name
        self.backoff_s = backoff_s
        self.fix = f"Fix the reward service at {url} (or raise {name}.remote_timeout_s, {name}.remote_retries)"
        """What failure messages tell the user to fix."""

    def score(self, rows: Sequence[RewardRow]) -> list[RewardOutcome]:
        """One outcome per row, in order, from one request per ``batch_size`` rows sent one after another; failures
        are logged (the first few in full) and not raised here."""
        outcomes: list[RewardOutcome] = []
        for start in range(0, len(rows), self.batch_size):
            outcomes += self._score_batch(rows[start : start + self.batch_size])
        log_failures(outcomes, self.name)
        return outcomes

    def summarize(self, outcomes: Sequence[RewardOutcome]) -> RewardScores:
        """Scores, extras, failure counts and resent requests of ``outcomes``; under ``on_error=abort``, a
        ``RewardError`` naming the URL and the first failure's cause instead."""
        return summarize_outcomes(outcomes, on_error=self.on_error, name=self.name, fix=self.fix)

    def close(self) -> None:
        """Nothing to release: every request opens and closes its own connection."""

    def _score_batch(self, rows: Sequence[RewardRow]) -> list[RewardOutcome]:
        payload = json.dumps({"rows": [_row_json(row) for row in rows]}, default=_json_value).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                entries = self._post(payload, len(rows))
            except _RequestFailed as error:
                failure = error
                if not error.retried:
                    break
                continue
            outcomes = [self._row_outcome(entry, row) for entry, row in zip(entries, rows)]
            outcomes[0] = replace(outcomes[0], retries=attempt)
            return outcomes
        tries = f"{attempt + 1} tries" if attempt else "1 try"
        cause = f"failed after {tries}, the last {failure.cause}"
        outcomes = [self._failed(failure.kind, cause, row) for row in rows]
        outcomes[0] = replace(outcomes[0], retries=attempt)
        return outcomes

    def _post(self, payload: bytes, rows: int) -> list[Any]:
        """The ``scores`` list of one answer; ``_RequestFailed`` when there is none."""
        request = urllib.request.Request(
            self.url, data=payload, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            status = error.code
            detail = shorten(error.read().decode(errors="replace"))
            retried = status >= 500 or status in RETRIED_STATUSES
            raise _RequestFailed(
                "error", f"answered HTTP {status} {error.reason}: {detail!r}", retried=retried
            ) from None
        except TimeoutError:
            raise _RequestFailed(
                "timeout", f"timed out: no answer within {self.name}.remote_timeout_s={self.timeout_s:g}"
            ) from None
        except urllib.error.URLError as error:
            if isinstance(error.reason, TimeoutError):
                raise _RequestFailed("timeout", f"timed out: could not connect within {self.timeout_s:g} s") from None
            raise _RequestFailed("error", f"could not connect ({error.reason})") from None
        except (http.client.HTTPException, OSError) as error:
            raise _RequestFailed("error", f"lost the connection ({type(error).__name__}: {error})") from None
        try:
            answer = json.loads(body)
        except ValueError:
            raise _RequestFailed(
                "error", f"was answered {shorten(body.decode(errors='replace'))!r}, not JSON"
            ) from None
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise _RequestFailed("error", f"was answered {shorten(str(answer))!r}, which has no 'scores' list")
        if len(scores) != rows:
            raise _RequestFailed("error", f"was answered {len(scores)} scores for {rows} rows")
        return scores

    def _row_outcome(self, entry: Any, row: RewardRow) -> RewardOutcome:
        try:
            score, extras = parse_score(entry)
        except NonFiniteReward as error:
            return self._failed("non_finite", f"scored this row badly: the service {error}", row)
        except (TypeError, ValueError) as error:
            answer = shorten(repr(entry))
            return self._failed("error", f"answered {answer} for this row, not a score ({error})", row)
        return RewardOutcome(score, extras)

    def _failed(self, kind: str, cause: str, row: RewardRow) -> RewardOutcome:
        response = shorten(row.solution_str)
        message = f"POST {self.url} {cause} (data_source={row.data_source!r}, response {response!r})"
        return RewardOutcome(0.0, failure=kind, message=message)


def _row_json(row: RewardRow) -> dict[str, Any]:
    return {
        "data_source": row.data_source,
        "prompt": row.prompt,
        "response": row.solution_str,
        "ground_truth": row.ground_truth,
        "extra_info": row.extra_info,
    }


def _json_value(value: Any) -> Any:
    """What JSON cannot hold as it is: numpy arrays and numbers (from a parquet dataset) as lists and numbers, anything
    else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
