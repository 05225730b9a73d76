"""stepwarden: multi-step tasks over flaky remote services that complete, or are undone, as a whole.

The Scheduler Agent Supervisor pattern with Leader Election, on one database (SQLite embedded, or
PostgreSQL for many machines). The public API is what ``__all__`` lists; everything else is
private and may change.
"""

from .agent import Agent, Request
from .alerts import Alert, CallableSink, LogSink, WebhookSink
from .app import App
from .app_transaction import AppTransaction
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
    StoreMisconfigured,
    StoreUnreachable,
    Transient,
    UnknownWorkflow,
)
from .leader import Leadership, LeaseSettings, run_while_leader
from .policies import Backoff, CircuitBreaker, Decision, Retry
from .replies import ReplyMessage, TaskResult
from .worker import Worker, WorkerSettings
from .workflow import Step, Workflow

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "Alert",
    "App",
    "AppTransaction",
    "Backoff",
    "CallableSink",
    "CircuitBreaker",
    "Clock",
    "Decision",
    "FakeClock",
    "InputError",
    "Leadership",
    "LeaseSettings",
    "LogSink",
    "LostOwnership",
    "NotFound",
    "OperationError",
    "PayloadTooLarge",
    "Permanent",
    "ReplyMessage",
    "Request",
    "Retry",
    "Step",
    "StepwardenError",
    "StoreError",
    "StoreMisconfigured",
    "StoreUnreachable",
    "SystemClock",
    "TaskResult",
    "Transient",
    "UnknownWorkflow",
    "WebhookSink",
    "Worker",
    "WorkerSettings",
    "Workflow",
    "__version__",
    "run_while_leader",
]
