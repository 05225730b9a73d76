"""stepwarden: multi-step tasks over flaky remote services that complete, or are undone, as a whole.

The Scheduler Agent Supervisor pattern with Leader Election, on one database (SQLite embedded, or
PostgreSQL for many machines). The public API is what ``__all__`` lists; everything else is
private and may change.
"""

from .agent import Agent, Request
from .app import App, AppTransaction
from .clock import Clock, FakeClock, SystemClock
from .errors import (
    InputError,
    LostOwnership,
    NotFound,
    OperationError,
    PayloadTooLarge,
    Permanent,
    StepwardenError,
    StoreError,
    Transient,
    UnknownWorkflow,
)
from .leader import Leadership, LeaseSettings, run_while_leader
from .policies import Backoff, CircuitBreaker, Decision, Retry
from .worker import Worker, WorkerSettings
from .workflow import Step, Workflow

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "App",
    "AppTransaction",
    "Backoff",
    "CircuitBreaker",
    "Clock",
    "Decision",
    "FakeClock",
    "InputError",
    "Leadership",
    "LeaseSettings",
    "LostOwnership",
    "NotFound",
    "OperationError",
    "PayloadTooLarge",
    "Permanent",
    "Request",
    "Retry",
    "Step",
    "StepwardenError",
    "StoreError",
    "SystemClock",
    "Transient",
    "UnknownWorkflow",
    "Worker",
    "WorkerSettings",
    "Workflow",
    "__version__",
    "run_while_leader",
]
