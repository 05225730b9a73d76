"""The one exception tree of stepwarden.

Every error the library raises on purpose derives from :class:`StepwardenError`, so callers can
catch ours without catching everything::

    StepwardenError
    ├── InputError            bad input from a user: the CLI maps it to exit code 2, nothing is written
    │   ├── UnknownWorkflow
    │   └── PayloadTooLarge
    ├── NotFound              a task, step or alert that does not exist
    ├── StoreError            the state store failed or has an unexpected shape
    │   ├── StoreUnreachable
    │   ├── StoreMisconfigured
    │   └── MigrationError
    ├── LostOwnership         a conditional write matched nothing: someone else owns it now
    └── OperationError        raised by agent operations to classify a failure
        ├── Transient         retried inside the attempt with back-off
        └── Permanent         not retried: the step's on-error policy applies at once
"""

from __future__ import annotations


class StepwardenError(Exception):
    """Base of every error stepwarden raises on purpose."""


class InputError(StepwardenError, ValueError):
    """Bad input from a user; the CLI prints it on one line and exits 2. Nothing was written."""


class UnknownWorkflow(InputError):
    """The workflow name is not registered (neither in the App nor in the store)."""


class PayloadTooLarge(InputError):
    """The task input is larger than the configured limit."""


class NotFound(StepwardenError, LookupError):
    """The task, step or alert asked for does not exist."""


class StoreError(StepwardenError):
    """The state store failed in a way the caller cannot fix by retrying the same call."""


class StoreUnreachable(StoreError):
    """The store did not answer while it was being opened: a PostgreSQL server that refused or
    timed out for 10 s (down, restarting), an SQLite file another process kept locked past the
    busy timeout. A command gives up (exit 1); a worker starting waits on (see Worker.run)."""


class StoreMisconfigured(StoreError):
    """The store is reached in a way it cannot work through, which no retry heals: a
    transaction-mode pooler between this process and PostgreSQL without ``?pooler=transaction`` in
    the URL. Every later transaction of the store raises it too; a worker exits on it (exit 1, one
    line) rather than wait it out as an outage, as it does the store's failures that heal."""


class MigrationError(StoreError):
    """The schema is newer than this code, or a migration failed."""


class LostOwnership(StepwardenError):
    """A conditional transition changed no row: another instance or a newer attempt owns it."""


class OperationError(StepwardenError):
    """Raised by agent operations to say how a failure must be treated."""


class Transient(OperationError):
    """A failure worth retrying inside the attempt (back-off with jitter, never past complete-by)."""


class Permanent(OperationError):
    """A failure retrying cannot fix (card declined, unknown SKU): error reply at once."""
