"""How the agent side of a worker is tuned, and the bounds of its stop.

Its own module because three read it: the agent role (``agent_role.py``), the instance's health
(``agent_health.py``) and the worker, which carries it in ``WorkerSettings`` and waits
``stop_within`` for the role to stop.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

# What a graceful stop waits for once its grace is over, each step bounded: the cancelled calls to
# end, the replies already made to commit, and each of its own writes (the release of the
# unfinished attempts, the instances' stop record; the worker's stop record too).
CANCELLED_WAIT = 1.0
REPLIES_WAIT = 5.0
STOP_WRITE_WAIT = 5.0


@dataclass(frozen=True)
class AgentSettings:
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
    trial_ttl: float = 60.0  # a half-open trial not reported within this is open to others again
    report_timeout: float = 5.0  # give up waiting for the store to record a call's outcome
    # Before a reply batch goes out, wait up to this long (real time) for the calls started
    # since the last batch to answer, so that they share its transaction. Without it, slots
    # refilled at different moments keep answering in separate groups, one transaction each, for
    # good: with 8 slots and no-op calls, W2 on PostgreSQL fell into a 6 + 2 split in about one
    # run in three, at two transactions per cycle (~350 workflows/s against ~520). A call that
    # takes longer is not waited for (nor again by later batches): a batch waits at most this.
    reply_linger: float = 0.002

    def __post_init__(self) -> None:
        if not 0 <= self.reply_linger <= 1:
            raise InputError(f"reply_linger must be between 0 and 1 s, not {self.reply_linger!r}")

    @property
    def stop_within(self) -> float:
        """The longest the agent role takes to stop: its drain, then its instances' stop record."""
        return self.shutdown_grace + CANCELLED_WAIT + REPLIES_WAIT + 2 * STOP_WRITE_WAIT
