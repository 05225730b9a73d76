"""How the agent side of a worker is tuned, and the bounds of its stop.

Its own module because three read it: the agent role (``agent_role.py``), the instance's health
(``agent_health.py``) and the worker, which carries it in ``WorkerSettings`` and waits
``stop_within`` for the role to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError
from .policies import check_count, check_seconds, is_number, show
from .workflow import DEFAULT_MAX_INPUT_BYTES, MAX_INPUT_LIMIT

# What a graceful stop waits for once its grace is over, each step bounded: the cancelled calls to
# end, the replies already made to commit, and each of its own writes (the release of the
# unfinished attempts, the instances' stop record; the worker's stop record too).
CANCELLED_WAIT = 1.0
REPLIES_WAIT = 5.0
STOP_WRITE_WAIT = 5.0
# A try of an operation starts only with at least this long left before complete-by (and, for a
# second or later try, at least as long as the previous try took): a call started with a few
# milliseconds left cannot answer in time, and would only hang to complete-by and count as a
# failure of the service. The attempt replies `retry` at once instead (or, for a first try, ends
# silent: see docs/concepts.md, "A step's attempt, end to end").
MIN_TRY_LEFT = 0.01


@dataclass(frozen=True)
class AgentSettings:
    """How the agent role of a worker polls, reports and stops.

    Every duration is a finite number of seconds (not a bool or text) up to 10**9 (about
    31 years, :data:`~stepwarden.policies.MAX_SECONDS`): ``poll_interval``, ``idle_poll_max``,
    ``instance_stale``, ``trial_ttl`` and ``report_timeout`` more than 0, ``shutdown_grace`` and
    ``success_every`` from 0, ``reply_linger`` from 0 to 1; ``unhealthy_after`` is an int from 1
    to 2**31-1, ``max_result_bytes`` an int from 1 to 10**9. Anything else raises
    :class:`~stepwarden.errors.InputError` naming the field.
    """

    poll_interval: float = 0.05
    idle_poll_max: float = 0.25
    shutdown_grace: float = 5.0
    # Apply replies in the transaction that records them (set when the process is a scheduler too).
    apply_replies: bool = False
    # Instance health (AGT6): failures in a row, while another instance succeeds, that make this
    # instance unhealthy; an instance silent for `instance_stale` seconds is not counted as live.
    # 5: with independent transient failures at rate r, a healthy instance misjudges itself with
    # probability r**5 per streak (3e-6 at the demo's 8%), and any success heals it at once.
    unhealthy_after: int = 5
    instance_stale: float = 30.0
    success_every: float = 1.0  # write successes at most this often when nothing depends on them
    # A half-open trial's claim, renewed while its call runs: one not renewed for this long (its
    # instance died, stalled or lost the store) is open to others again.
    trial_ttl: float = 60.0
    report_timeout: float = 5.0  # give up waiting for the store to record a call's outcome
    # Before a reply batch goes out, wait up to this long (real time) for the calls started
    # since the last batch to answer, so that they share its transaction. Without it, slots
    # refilled at different moments keep answering in separate groups, one transaction each, for
    # good: with 8 slots and no-op calls, W2 on PostgreSQL fell into a 6 + 2 split in about one
    # run in three, at two transactions per cycle (~350 workflows/s against ~520). A call that
    # takes longer is not waited for (nor again by later batches): a batch waits at most this.
    reply_linger: float = 0.002
    # The largest result an operation may return, as UTF-8 JSON: a larger one is that step's error
    # (it would be carried in every later step's payload). The default is SUB4's input limit.
    max_result_bytes: int = DEFAULT_MAX_INPUT_BYTES

    def __post_init__(self) -> None:
        for name in ("poll_interval", "idle_poll_max", "instance_stale", "trial_ttl", "report_timeout"):
            check_seconds(f"AgentSettings.{name}", getattr(self, name), above=True)
        for name in ("shutdown_grace", "success_every"):
            check_seconds(f"AgentSettings.{name}", getattr(self, name))
        count = check_count("AgentSettings.unhealthy_after", self.unhealthy_after)
        object.__setattr__(self, "unhealthy_after", count)
        limit = check_count(
            "AgentSettings.max_result_bytes", self.max_result_bytes, high=MAX_INPUT_LIMIT, unit=" of bytes"
        )
        object.__setattr__(self, "max_result_bytes", limit)
        if not is_number(self.reply_linger) or not 0 <= self.reply_linger <= 1:
            raise InputError(
                f"AgentSettings.reply_linger must be between 0 and 1 s, not {show(self.reply_linger)}"
            )

    @property
    def stop_within(self) -> float:
        """The longest the agent role takes to stop: its drain, then its instances' stop record."""
        return self.shutdown_grace + CANCELLED_WAIT + REPLIES_WAIT + 2 * STOP_WRITE_WAIT
