"""Scoring many rows with a rule: inline or in a pool of worker processes, each call under a timeout, every failure
counted, logged and handled as ``on_error`` says.

    runner = RewardRunner("math", num_workers=4, timeout_s=10, on_error="zero")
    outcomes = runner.score([RewardRow("math", response, "\\\\frac{1}{2}", {}) for response in responses])
    result = runner.summarize(outcomes)        # scores, extras, failure counts; raises under on_error=abort
    runner.close()

``score`` and ``summarize`` are separate so that a role can split its rows over several ranks, score a slice on each,
gather the outcomes and summarize them everywhere (``RewardWorker``): under ``on_error=abort`` every rank then raises
the same error, and no rank waits in a collective for one that failed.

A call fails when it raises, returns a non-finite number (score or extra) or a score beyond float32's range, or runs
longer than ``timeout_s``. Under ``on_error=zero`` a step where more than ``max_failure_fraction`` of the calls failed
still stops (``check_failure_fraction``): a reward that never works must not train a model on zeros. Worker
processes stop an over-long call with a ``SIGALRM`` timer, which interrupts Python code, sleeps and regular
expressions. If the whole batch still overruns its worst-case time by ``STUCK_GRACE_S`` (a call stuck in C code
that ignores signals), the pool is killed and replaced, and the rows it had not returned count as timeouts. Inline
calls (``num_workers=0``) run in the caller's thread, where no timer can interrupt them: they have no timeout.

Worker processes start at the first ``score`` (forkserver where there is one, else spawn) and end, with the
forkserver, within ``OWNER_POLL_S`` of the rank that made them, however it ended. Like any such pool they
import the caller's main script first (a few seconds for a recipe, once per run), which must therefore keep its
entry point under ``if __name__ == "__main__":``, as the recipes do.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from spmd_rlhf.rewards.registry import NonFiniteReward, RuleReward

ON_ERROR = ("zero", "abort")
FAILURE_METRICS = {"error": "errors", "timeout": "timeouts", "non_finite": "non_finite"}
"""Failure kind -> the count's metric name (``<role>/errors`` etc.)."""
LOGGED_FAILURES = 3
"""Failures logged in full per ``score`` call; the rest are counted in one line."""
SHOWN_CHARS = 200
"""Characters of a failed row's response, and of an exception's message, shown in messages."""
CHUNKS_PER_WORKER = 4
"""Rows go to the pool in about this many chunks per worker: few inter-process messages, still balanced."""
OWNER_POLL_S = 1.0
"""How often a worker process checks that the rank that made its pool is still alive."""
STUCK_GRACE_S = 30.0
"""Seconds past a batch's worst-case time (every call taking timeout_s) before its pool counts as stuck."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardRow:
    """One response to score, with verl's argument names."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict
    prompt: str = ""
    """The prompt's text, for a remote reward service (rules are not given it)."""


@dataclass(frozen=True)
class RewardOutcome:
    """What one call gave: its score and extras, or a failure (``"error"``, ``"timeout"`` or ``"non_finite"``)
    with a message naming the function, the row's data source, a truncated response and the cause."""

    score: float
    extras: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    message: str = ""
    retries: int = 0
    """Times the request that carried this row to a remote reward service was resent, on the request's first row only
    (0 on the others), so that a sum over outcomes counts resent requests."""


@dataclass(frozen=True)
class RewardScores:
    """What ``RewardRunner.summarize`` makes of a batch's outcomes."""

    scores: list[float]
    """One score per row; 0.0 for a failed row."""
    extras: dict[str, list[float]]
    """Each extra number over the rows that returned it."""
    failures: dict[str, int]
    """Failed rows by metric name (``errors``, ``timeouts``, ``non_finite``), all three always present."""
    retries: int = 0
    """Requests to a remote reward service that were resent (``RewardOutcome.retries`` summed)."""


class RewardError(RuntimeError):
    """A reward call failed under ``on_error=abort``."""


RULE_FIX = "Fix the reward function"
"""How a failure message tells the user to fix a rule reward; a remote reward names its service instead."""


def check_failure_fraction(
    failures: dict[str, int],
    calls: int,
    *,
    max_failure_fraction: float | None,
    name: str,
    fix: str | None = None,
) -> None:
    """Raise a ``RewardError`` when more than ``max_failure_fraction`` of ``calls`` failed, or with None when every
    call failed (``failures``: the counts by metric name, as in ``RewardScores.failures``, summed over every rank
    that scored part of the step; ``fix``: what the message tells the user to fix, by default the rule)."""
    failed = sum(failures.values())
    if not calls:
        return
    if max_failure_fraction is None:
        if failed < calls:
            return
        limit = f"every call failed ({name}.max_failure_fraction=null stops only then)"
    elif failed / calls > max_failure_fraction:
        limit = f"more than {name}.max_failure_fraction={max_failure_fraction:g}"
    else:
        return
    counts = ", ".join(f"{metric} {count}" for metric, count in failures.items())
    fix = fix or f"{RULE_FIX} (or the rows' data_source, under {name}.rule=auto)"
    raise RewardError(
        f"{name}: {failed} of {calls} calls failed at this step ({counts}), {limit}; the logged failures say why. "
        f"{fix}, or set {name}.max_failure_fraction=1 to train on zeros anyway"
    )


class _CallTimeout(BaseException):
    """Raised by the timer inside a worker process; a BaseException so that a user function's ``except Exception``
    cannot swallow it."""


def log_failures(outcomes: Sequence[RewardOutcome], name: str) -> None:
    """Log the first few failed outcomes in full and count the rest in one line (``name``: the config section)."""
    failed = [outcome for outcome in outcomes if outcome.failure]
    for outcome in failed[:LOGGED_FAILURES]:
        logger.warning("%s: %s", name, outcome.message)
    if len(failed) > LOGGED_FAILURES:
        logger.warning("%s: %d more of %d rows failed", name, len(failed) - LOGGED_FAILURES, len(outcomes))


def summarize_outcomes(outcomes: Sequence[RewardOutcome], *, on_error: str, name: str, fix: str) -> RewardScores:
    """Scores, extras, failure counts and retries of ``outcomes``; under ``on_error=abort``, a ``RewardError`` for the
    first failure instead, telling the user to ``fix`` it (``RULE_FIX``, or the remote service)."""
    failed = [outcome for outcome in outcomes if outcome.failure]
    if failed and on_error == "abort":
        others = f" ({len(failed) - 1} more of {len(outcomes)} rows failed too)" if len(failed) > 1 else ""
        raise RewardError(
            f"{name}: {failed[0].message}{others}. {fix}, or set {name}.on_error=zero to score failed rows 0 and "
            f"count them"
        )
    extras: dict[str, list[float]] = {}
    for outcome in outcomes:
        for key, value in outcome.extras.items():
            extras.setdefault(key, []).append(value)
    counts = Counter(outcome.failure for outcome in failed)
    return RewardScores(
        [outcome.score for outcome in outcomes],
        extras,
        {metric: counts[kind] for kind, metric in FAILURE_METRICS.items()},
        sum(outcome.retries for outcome in outcomes),
    )


def score_row(reward: RuleReward, row: RewardRow, *, timeout_s: float | None = None) -> RewardOutcome:
    """One call of ``reward`` on ``row``, failures caught and described; ``timeout_s`` needs the process's main thread
    (it arms ``SIGALRM``)."""
    try:
        with _alarm(timeout_s):
            score, extras = reward.score(row.data_source, row.solution_str, row.ground_truth, row.extra_info)
    except _CallTimeout:
        return _failed("timeout", f"ran longer than timeout_s={timeout_s}", reward, row)
    except NonFiniteReward as error:
        return _failed("non_finite", str(error), reward, row)
    except Exception as error:
        return _failed("error", f"raised {type(error).__name__}: {shorten(str(error))}", reward, row)
    return RewardOutcome(score, extras)


def _failed(kind: str, cause: str, reward: RuleReward, row: RewardRow) -> RewardOutcome:
    response = shorten(row.solution_str)
    message = f"{reward.describe(row.data_source)} {cause} (data_source={row.data_source!r}, response {response!r})"
    return RewardOutcome(0.0, failure=kind, message=message)


def shorten(text: str) -> str:
    return text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else "")


@contextmanager
def _alarm(timeout_s: float | None) -> Iterator[None]:
    """Raise ``_CallTimeout`` in the block after ``timeout_s`` seconds (main thread only); None: no limit."""
    if timeout_s is None:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _CallTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- inside a worker process -------------------------------------------------------------------------------------

_worker_reward: RuleReward | None = None
"""The worker process's rule, loaded once by ``_load_rule`` when the pool starts the process."""


def _load_rule(rule: str, kwargs: dict[str, Any], name: str, owner_pid: int, forked_by_server: bool) -> None:
    global _worker_reward
    _worker_reward = RuleReward(rule, kwargs, name=name)
    threading.Thread(
        target=_end_with_owner, args=(owner_pid, forked_by_server), name="spmd-reward-watchdog", daemon=True
    ).start()


def _end_with_owner(owner_pid: int, forked_by_server: bool) -> None:
    """End this worker process, and the forkserver it was forked from, once the process that made the pool is gone:
    a rank ended with ``os._exit`` (a failed job) or killed runs no cleanup, and the pool would outlive it."""
    while _alive(owner_pid):
        time.sleep(OWNER_POLL_S)
    server = os.getppid()
    if forked_by_server and server not in (1, owner_pid):
        os.kill(server, signal.SIGKILL)  # the rank's own forkserver: it serves no one else
    os._exit(1)


def _score_chunk(rows: list[RewardRow], timeout_s: float | None) -> list[RewardOutcome]:
    return [score_row(_worker_reward, row, timeout_s=timeout_s) for row in rows]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs; a zombie (ended, not yet reaped by its parent) counts as ended."""
    if not os.path.isdir("/proc/self"):  # no procfs (macOS): a zombie counts as running
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- in the caller ------------------------------------------------------------------------------------------------


class RewardRunner:
    """Scores rows with ``RuleReward(rule, rule_kwargs)`` inline (``num_workers=0``) or in a pool of ``num_workers``
    processes made once and reused; ``name`` is the config section (``reward`` or ``cost``) that messages refer to.

    The rule is loaded here first, so a missing file, function or rule name fails at once; each worker process then
    loads it again by name or path."""

    def __init__(
        self,
        rule: str = "auto",
        *,
        rule_kwargs: dict[str, Any] | None = None,
        num_workers: int = 0,
        timeout_s: float | None = None,
        on_error: str = "zero",
        name: str = "reward",
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"{name}.on_error={on_error!r}: must be one of {', '.join(ON_ERROR)}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"{name}.timeout_s={timeout_s}: must be > 0 or None")
        self.reward = RuleReward(rule, rule_kwargs, name=name)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.name = name
        self._pool: ProcessPoolExecutor | None = None

    def score(self, rows: Sequence[RewardRow]) -> list[RewardOutcome]:
        """One outcome per row, in order; failures are logged (the first few in full) and not raised here."""
        if self.num_workers and rows:
            outcomes = self._score_in_pool(list(rows))
        else:
            outcomes = [score_row(self.reward, row) for row in rows]
        log_failures(outcomes, self.name)
        return outcomes

    def summarize(self, outcomes: Sequence[RewardOutcome]) -> RewardScores:
        """Scores, extras and failure counts of ``outcomes``; under ``on_error=abort``, a ``RewardError`` for the first
        failure instead."""
        return summarize_outcomes(outcomes, on_error=self.on_error, name=self.name, fix=RULE_FIX)

    def close(self) -> None:
        """Stop the worker processes (a later ``score`` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _score_in_pool(self, rows: list[RewardRow]) -> list[RewardOutcome]:
        if self._pool is None:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            self._pool = ProcessPoolExecutor(
                self.num_workers,
                mp_context=multiprocessing.get_context(method),
                initializer=_load_rule,
                initargs=(self.reward.rule, self.reward.kwargs, self.name, os.getpid(), method == "forkserver"),
            )
        size = math.ceil(len(rows) / (self.num_workers * CHUNKS_PER_WORKER))
        chunks = {
            self._pool.submit(_score_chunk, rows[start : start + size], self.timeout_s): start
            for start in range(0, len(rows), size)
        }
        deadline = None
        if self.timeout_s is not None:
            deadline = self.timeout_s * size * math.ceil(len(chunks) / self.num_workers) + STUCK_GRACE_S
        stuck = wait(chunks, timeout=deadline).not_done
        outcomes: list[RewardOutcome] = []
        broken = bool(stuck)
        for future, start in chunks.items():
            chunk = rows[start : start + size]
            if future in stuck:
                cause = f"was stopped with its worker process after {deadline:.0f} s (stuck where no timer reaches)"
                outcomes += [_failed("timeout", cause, self.reward, row) for row in chunk]
            elif (error := future.exception()) is not None:
                # The worker process died (BrokenProcessPool: killed, crashed, or could not load the rule) or the
                # function ended it (SystemExit): the chunk's rows have no outcome of their own.
                broken = broken or isinstance(error, BrokenProcessPool)
                cause = f"was lost with its worker process's call ({type(error).__name__}: {error})"
                outcomes += [_failed("error", cause, self.reward, row) for row in chunk]
            else:
                outcomes += future.result()
        if broken:
            self._discard_pool()
        return outcomes

    def _discard_pool(self) -> None:
        """Kill the pool's processes, stuck or dead, so that the next ``score`` starts a new pool."""
        # ProcessPoolExecutor has no public way to stop a worker in the middle of a call (terminate_workers is 3.14+).
        processes = list(self._pool._processes.values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
        self._pool = None
