"""The SQLite store's file and its -wal and -shm files, as the file system sees them: what keeps
this user from using a store, said in words (sqlite3's own text names neither the file nor the
cause), and a refusal to open a store in a way that would lock its owner out."""

from __future__ import annotations

import contextlib
import os
import sqlite3

from ..errors import StoreError
from .base import shorten


def shown(path: str) -> str:
    """A path inside an error line: quoted, escaped, shortened."""
    return shorten(repr(path))


def primary_code(e: sqlite3.Error) -> int | None:
    """SQLite's primary result code (``SQLITE_BUSY``, ``SQLITE_READONLY``...), without the extended
    bits: the message text is for people and may change between SQLite versions."""
    code = getattr(e, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _owner(path: str) -> str:
    """Who owns ``path``, for an error line: ``uid 1000 (alice)``, or ``uid 1000`` without a name."""
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return "another user"
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):  # no pwd module (Windows), or a uid with no name
        return f"uid {uid}"


def _can(path: str, mode: int) -> bool:
    """``os.access`` for the user SQLite opens files as (the effective one, where the OS says)."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def _is_wal_file(path: str) -> bool:
    """Whether ``path`` is a SQLite database in WAL mode, read from its header (bytes 18 and 19 are
    2 for WAL), without opening it through SQLite: opening is what creates the -wal and -shm files."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"


def refuse_foreign_read(path: str) -> None:
    """Refuse, before any connection, to open a WAL store that this user cannot write and that no
    process has open (no ``-shm`` file), with :class:`StoreError`.

    A reader of a WAL database needs its ``-shm`` file (and opens a ``-wal``). If none exists,
    SQLite creates both, owned by the reader, even on a read-only connection; and since the reader
    cannot write the database it cannot check them out again on closing, so they stay. The store's
    owner then cannot write those files: every write fails with "attempt to write a readonly
    database" until someone with the rights removes them. Where the folder is not writable either,
    SQLite cannot create the ``-shm`` file and cannot read the store at all. While a process has
    the store open its ``-shm`` file exists, and SQLite reads the store through it without
    writing it (checked in tests/acceptance/test_sqlite_permissions.py): that is left to work."""
    if (
        not os.path.isfile(path)
        or _can(path, os.W_OK)
        or os.path.exists(path + "-shm")
        or not _is_wal_file(path)
    ):
        return
    where = shown(path)
    folder = os.path.dirname(os.path.abspath(path))
    remedy = "run as the store's owner, or while a worker has it open"
    if _can(folder, os.W_OK | os.X_OK):
        raise StoreError(
            f"cannot open the SQLite store {where} as this user: it is not writable by you and no"
            " process has it open (it has no -shm file), so opening it, even to read, would create"
            f" its -wal and -shm files owned by you and lock its owner ({_owner(path)}) out of"
            f" writing; {remedy}"
        )
    raise StoreError(
        f"cannot open the SQLite store {where} as this user: no process has it open (it has no -shm"
        " file), and SQLite must then create its -wal and -shm files to read it, but neither the"
        f" file nor its folder is writable by you; {remedy}"
    )


def _permission_causes(path: str) -> list[str]:
    """What in the file system keeps this user from using the store at ``path``, each cause as a
    clause that is true now (empty if none is found): sqlite3's own message says only "attempt to
    write a readonly database" or "unable to open database file", whichever file is at fault."""
    causes: list[str] = []
    real = os.path.abspath(path)
    if os.path.exists(real):
        if not _can(real, os.R_OK):
            causes.append("the file is not readable by this user")
        if not _can(real, os.W_OK):
            causes.append("the file is not writable by this user")
    if not causes:  # the file is fine: its -wal and -shm files may not be (left by another user)
        for suffix in ("-wal", "-shm"):
            side = real + suffix
            if os.path.exists(side) and not _can(side, os.R_OK | os.W_OK):
                causes.append(f"its {suffix} file belongs to {_owner(side)} and is not writable by this user")
    folder = os.path.dirname(real)
    no_shm = os.path.exists(real) and not os.path.exists(real + "-shm")
    if no_shm and not _can(folder, os.W_OK | os.X_OK):
        causes.append(
            f"its folder {shown(folder)} is not writable by this user, and with no -shm file there"
            " (no process has the store open) SQLite must create its -wal and -shm files to use it"
        )
    return causes


def sqlite_why(path: str, e: sqlite3.Error) -> str:
    """sqlite3's error about the store at ``path`` with the cause it leaves out (a directory, a
    name too long, the permissions of the file, its -wal and -shm files or its folder) and, for a
    store of another user, who can use it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a directory"
    if len(os.path.basename(path)) > 255:
        return "the file name is longer than file systems allow (255 bytes)"
    if not os.path.exists(path) and not _can(folder, os.W_OK):
        return f"{e} (cannot create a file in {shown(folder)})"
    causes = _permission_causes(path)
    if not causes:
        return str(e)
    text = f"{e}: {'; '.join(causes)}"
    with contextlib.suppress(OSError):
        if os.stat(path).st_uid != os.geteuid():
            text += f"; run as the store's owner ({_owner(path)})"
    return text


# Less free space than this, for this user, beside the store: SQLite's "disk I/O error" there is
# the disk being full (it cannot grow its -shm file, or its log), which SQLite does not say.
FULL_BELOW = 64 * 1024


def disk_full(path: str) -> bool:
    """Whether the file system holding ``path`` has (next to) no space left for this user."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW


def can_write(path: str) -> bool:
    """Whether this user may write the store at ``path`` as SQLite needs: the file, its folder (for
    the -wal and -shm files) and those files where they exist."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    sides = [path + x for x in ("-wal", "-shm") if os.path.exists(path + x)]
    return all(os.access(p, os.W_OK) for p in [path, folder, *sides])


def damaged_text(where: str, finding: object) -> str:
    """The one line for a damaged store (``where`` already shown as the line shows it), said the
    same whether its opening, a transaction or ``init``'s check found it."""
    return (
        f"the SQLite store {where} is damaged ({finding}): check it with"
        f" `sqlite3 {where} 'PRAGMA integrity_check'` and restore a backup"
    )
