"""Workflows (ordered steps) and the validation of every name and input a user can send."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError, PayloadTooLarge
from .policies import ESCALATIONS, MAX_INT, Escalation, Retry, is_number, show, whole

# Names end up in SQL parameters, log lines, URLs and file names; a conservative alphabet keeps
# every one of those safe without escaping and makes typos fail loudly.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
DEFAULT_MAX_INPUT_BYTES = 1024 * 1024
# The largest size limit a task input (App.max_input_bytes) or an operation's result
# (AgentSettings.max_result_bytes) may be given: about the largest text a store keeps in one value
# (SQLite's default SQLITE_MAX_LENGTH is 10**9 bytes, a PostgreSQL field holds at most 1 GiB).
MAX_INPUT_LIMIT = 10**9
# How deeply a task input or an operation's result may nest. The store's readers decode it inside
# their own call stacks: an input Python could still parse at ~990 levels made every scheduler
# round fail with RecursionError, holding up every other task with it.
MAX_JSON_DEPTH = 100
MAX_KEY_LEN = 255
log = logging.getLogger("stepwarden.workflow")

MAX_COMPLETE_BY = 86400 * 7  # one attempt's budget, in seconds
# The least budget an attempt can use: it covers the request's pickup by an agent (a few ms, more
# on a busy machine), the call and the reply. Below it (0.005 s was accepted) no call was ever
# made: the agent took the request with less than a try needs (MIN_TRY_LEFT), and the task ended
# "passed complete-by", which reads as a service that hung.
MIN_COMPLETE_BY = 0.1
# The most steps a workflow may have: a request carries the input and every earlier result, and
# each step's dispatch reads the task's steps, so a task costs the square of its steps (300 steps
# ran at 4.7 ms a step, 3,000 at 21.6 ms; 40,000 took 25 s just to define, found by review).
MAX_STEPS = 1000


def check_name(kind: str, value: object) -> str:
    """A workflow, queue or worker name: letters, digits, ``_ . : -``, up to 128 characters."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InputError(
            f"invalid {kind} {show(value)}: use 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


def check_ident(kind: str, value: object) -> str:
    """An agent or operation name: a Python-identifier-like word (dashes allowed), up to 64 characters."""
    if not isinstance(value, str) or not IDENT_RE.fullmatch(value):
        raise InputError(
            f"invalid {kind} {show(value)}: use 1-64 letters, digits, '_' or '-', not starting with a digit"
        )
    return value


def check_key(kind: str, value: object) -> str:
    """A correlation id or idempotency key: any printable text up to 255 characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_KEY_LEN or not value.isprintable():
        raise InputError(f"invalid {kind} {show(value)}: use 1-{MAX_KEY_LEN} printable characters")
    return value


def encode_input(value: Any, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> str:
    """Serialise a task input to JSON text, refusing what is not JSON or is over the size limit.
    A dict key that is not text (``{1: "x"}``) is refused as an operation's result is (see
    :func:`encode_result`), naming where it is."""
    try:
        text, size = _compact(value)
    except UnicodeEncodeError:
        raise InputError("task input is not valid Unicode (a lone surrogate or undecodable bytes)") from None
    except (TypeError, ValueError) as e:
        # json's own word for a key it refuses ("keys must be str, int, float, bool or None")
        # would say that an int key is fine: the key's own error says it is not.
        raise InputError(f"task input is not JSON-serialisable: {_bad_key(value) or e}") from None
    except RecursionError:
        raise InputError("task input is nested too deeply") from None
    _check_size(size, max_bytes, "task input is {} bytes")
    depth, keyed = _shape(value)
    if depth > MAX_JSON_DEPTH:
        raise InputError(f"task input is nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    if not keyed:
        raise InputError(f"task input is not JSON-serialisable: {_bad_key(value)}")
    return text


def _compact(value: Any) -> tuple[str, int]:
    """The one JSON encoding of what the store keeps, task inputs and results alike: compact (no
    spaces after separators), no NaN, Unicode as it is. Returns the text and its size in UTF-8
    (a lone surrogate raises UnicodeEncodeError); what ``json.dumps`` raises is the caller's."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text, len(text.encode("utf-8"))


def _check_size(size: int, max_bytes: int | None, said: str) -> None:
    """PayloadTooLarge if ``size`` (UTF-8 bytes) is over ``max_bytes``; ``said`` names the size."""
    if max_bytes is not None and size > max_bytes:
        raise PayloadTooLarge(f"{said.format(size)}, over the limit of {max_bytes} bytes")


def _shape(value: Any) -> tuple[int, bool]:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), and whether every dict key
    in it is text: one walk, without recursing, for both checks (a result's, on the path of every
    reply). Past ``MAX_JSON_DEPTH`` levels it stops: deep enough to refuse.

    A key that is not text is refused rather than written as JSON's text for it: ``json.dumps``
    turns ``{1: "x"}`` into ``{"1": "x"}``, which reads back with another key (the next step
    finds ``"1"``, not ``1``), and ``{1: "a", "1": "b"}`` into an object with the same key
    twice, of which a reader keeps one."""
    deepest, keyed, stack = 0, True, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            if keyed:
                for k in v:
                    if not isinstance(k, str):
                        keyed = False
                        break
            items: Iterable[Any] = v.values()
        elif isinstance(v, list | tuple):
            items = v
        else:
            continue
        deepest = max(deepest, d)
        if d > MAX_JSON_DEPTH:
            return d, keyed  # deep enough to refuse: no need to walk the rest
        stack.extend((x, d + 1) for x in items)
    return deepest, keyed


def _bad_key(value: Any) -> str | None:
    """Where the first dict key that is not text is in ``value`` (in document order, within
    ``MAX_JSON_DEPTH`` levels), as an error message says it: ``key 1 (int) at ["orders"][2] is
    not text``. None if there is none. Only walked once a value is refused: the path costs."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        v, path, d = stack.pop()
        if d > MAX_JSON_DEPTH:
            continue
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    where = path or "the top level"
                    return (
                        f"key {_key_shown(k)} ({type(k).__name__}) at {where} is not text: JSON object"
                        " keys are text, and nothing is turned into text for you"
                    )
            inner = [(x, f"{path}[{_cut(json.dumps(k, ensure_ascii=False))}]", d + 1) for k, x in v.items()]
        elif isinstance(v, list | tuple):
            inner = [(x, f"{path}[{i}]", d + 1) for i, x in enumerate(v)]
        else:
            continue
        stack.extend(reversed(inner))  # the first key or item on top: document order
    return None


def _key_shown(key: object) -> str:
    """A key as an error message shows it: its repr, cut (and a note if even that fails: an
    object's repr may raise)."""
    try:
        return _cut(repr(key))
    except Exception:
        return f"<a {type(key).__name__}>"


def _cut(text: str) -> str:
    """``text`` cut at 40 characters, for one key in an error message: a path of long keys stays
    one readable line."""
    return text if len(text) <= 40 else text[:37] + "..."


class JsonText(str):
    """A result already encoded by :func:`encode_result`: stored as it is, not encoded again."""


def encode_result(result: Any, max_bytes: int | None = None) -> JsonText | None:
    """An operation's result as a reply stores it: JSON text, or None for None; InputError says
    why a result cannot be stored (not JSON, NaN, a lone surrogate, nested too deeply, over
    ``max_bytes`` of UTF-8). The agent encodes each result once, as it gets it, so that such a
    result is that step's error, not a failure of the whole batch of replies it would have gone
    in; the store keeps the text.

    Nothing is turned into text behind the author's back (no ``default=str``): a set, bytes or an
    object would otherwise complete the step with ``"{1, 2}"`` or ``"<object at 0x...>"`` as its
    result, and the next step would read that text as if it were the data. Nor is a dict key
    (``{1: "x"}`` would be read back as ``{"1": "x"}``): a key that is not text is refused,
    named with where it is. The size limit keeps one result from being carried in every later
    step's payload and reply (the agent passes ``AgentSettings.max_result_bytes``, 1 MiB by
    default, the same as the input limit of SUB4)."""
    if result is None or isinstance(result, JsonText):
        return result
    depth, keyed = _shape(result)
    if depth > MAX_JSON_DEPTH:
        raise InputError(f"nested too deeply (more than {MAX_JSON_DEPTH} levels)")
    if not keyed:
        raise InputError(storable_text(f"not JSON ({_bad_key(result)})")[:300])
    try:
        text, size = _compact(result)
    except UnicodeEncodeError:
        raise InputError("not valid Unicode (a lone surrogate)") from None
    except RecursionError:
        raise InputError("nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise InputError(storable_text(f"not JSON ({e})")[:300]) from None
    _check_size(size, max_bytes, "{} bytes of JSON")
    return JsonText(text)


def storable_text(text: str) -> str:
    """Error text as the store can keep it: a lone surrogate (from an exception's message) is
    written as its escape (``\\udc80``), and so is a NUL character (``\\x00``), which PostgreSQL
    refuses in text: either one made the database refuse the whole batch of replies it was in,
    on every try, dropping the other replies with it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def parse_input(text: str, max_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> Any:
    """Parse JSON text given on the command line or read from a file, with the same limits."""
    size = _utf8_size(text)
    if size > max_bytes:
        raise PayloadTooLarge(f"task input is {size} bytes, over the limit of {max_bytes} bytes")
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputError("task input is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise InputError(
            f"task input is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise InputError(f"task input is not acceptable JSON: {e}"[:300]) from None
    return value  # a lone surrogate from a \uD800 escape is refused by encode_input at submission


def _utf8_size(text: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        raise InputError("task input is not valid Unicode (a lone surrogate or undecodable bytes)") from None


def split_operation(ref: str) -> tuple[str, str]:
    """``"inventory.reserve"`` -> ``("inventory", "reserve")``."""
    if not isinstance(ref, str):
        raise InputError(f"invalid operation reference {show(ref)}: expected the text AGENT.OPERATION")
    agent, sep, op = ref.partition(".")
    if not sep:
        raise InputError(f"invalid operation reference {show(ref)}: expected AGENT.OPERATION")
    return check_ident("agent name", agent), check_ident("operation name", op)


@dataclass(frozen=True)
class Step:
    """One step of a workflow: one agent operation with its deadline, retries and undo.

    ``complete_by`` is the budget in seconds for one attempt; the absolute complete-by is set by
    the database clock when the attempt is dispatched: a number (not a bool), from 0.1 s (the
    request's pickup, the call and the reply must fit in it) to 7 days. ``retry`` is the step's
    :class:`~stepwarden.policies.Retry`; ``None`` (or leaving it out) means the default
    ``Retry()``, not "no retries": for a single try that is never retried, give
    ``Retry(max_failures=1, tries=1)``. ``on_error`` says what a permanent error does:
    ``"error"`` (task error + alert, an operator resubmits) or ``"compensate"``. A bad value raises
    :class:`~stepwarden.errors.InputError` naming the step and the parameter.
    """

    name: str
    operation: str
    complete_by: float = 30.0
    retry: Retry = field(default_factory=Retry)
    compensate: str | None = None
    on_error: Escalation = "error"

    def __post_init__(self) -> None:
        check_ident("step name", self.name)
        split_operation(self.operation)
        if self.compensate is not None:
            split_operation(self.compensate)
        if not is_number(self.complete_by) or not MIN_COMPLETE_BY <= self.complete_by <= MAX_COMPLETE_BY:
            raise InputError(
                f"step {self.name!r}: complete_by must be between 0.1 seconds and 7 days, in seconds"
                f" (at least {MIN_COMPLETE_BY}: it covers the request's pickup, the call and the"
                f" reply; at most {MAX_COMPLETE_BY}), not {show(self.complete_by)}"
            )
        if self.retry is None:
            object.__setattr__(self, "retry", Retry())
        elif not isinstance(self.retry, Retry):
            raise InputError(f"step {self.name!r}: retry must be a Retry or None, not {show(self.retry)}")
        if not isinstance(self.on_error, str) or self.on_error not in ESCALATIONS or self.on_error == "wait":
            raise InputError(
                f"step {self.name!r}: on_error must be 'error' or 'compensate', not {show(self.on_error)}"
            )

    @property
    def agent(self) -> str:
        return split_operation(self.operation)[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "operation": self.operation,
            "complete_by": self.complete_by,
            "retry": self.retry.to_dict(),
            "compensate": self.compensate,
            "on_error": self.on_error,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        """A step of a definition read back from the store. A budget under today's floor, which
        an older version registered, is read as the floor, with a warning, as a stored policy's
        refused value is (found by review: submission by name was refused)."""
        complete_by = float(d["complete_by"])
        if 0 < complete_by < MIN_COMPLETE_BY:
            log.warning(
                "step %r: its stored complete_by %g is under %g s, the least a step may have now; read as %g",
                d["name"],
                complete_by,
                MIN_COMPLETE_BY,
                MIN_COMPLETE_BY,
            )
            complete_by = MIN_COMPLETE_BY
        return cls(
            name=d["name"],
            operation=d["operation"],
            complete_by=complete_by,
            retry=Retry.from_dict(dict(d.get("retry") or {})),
            compensate=d.get("compensate"),
            on_error=d.get("on_error", "error"),
        )


@dataclass(frozen=True)
class Workflow:
    """A named, versioned pipeline of steps.

    ``steps`` is a list or tuple (any iterable but a string or a mapping) of :class:`Step`
    objects, kept as a tuple; ``version`` is an int from 1 (not a bool, not ``"2"`` or ``1.5``).
    A bad value raises :class:`~stepwarden.errors.InputError` naming the workflow.
    """

    name: str
    steps: tuple[Step, ...]
    version: int = 1

    def __post_init__(self) -> None:
        check_name("workflow name", self.name)
        object.__setattr__(self, "steps", _steps_of(self.name, self.steps))
        if not self.steps:
            raise InputError(f"workflow {self.name!r} has no steps")
        for i, s in enumerate(self.steps, 1):
            if not isinstance(s, Step):
                hint = " (build it with Step(name, operation, ...))" if isinstance(s, Mapping) else ""
                raise InputError(f"workflow {self.name!r}: step {i} must be a Step, not {show(s)}{hint}")
        dup = {n for n, k in Counter(s.name for s in self.steps).items() if k > 1}
        if dup:
            raise InputError(f"workflow {self.name!r} has duplicate step names: {sorted(dup)}")
        version = whole(self.version)
        if version is None or not 1 <= version <= MAX_INT:
            raise InputError(
                f"workflow {self.name!r}: version must be a whole number from 1 to {MAX_INT}, "
                f"not {show(self.version)}"
            )
        object.__setattr__(self, "version", version)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Workflow:
        return cls(
            name=d["name"],
            version=int(d.get("version", 1)),
            steps=tuple(Step.from_dict(s) for s in d["steps"]),
        )

    @classmethod
    def of(cls, name: str, steps: Iterable[Step], version: int = 1) -> Workflow:
        """A definition (``app.workflow``): checked as any Workflow, and for its number of steps,
        which a definition an older version registered may exceed (read back by ``from_dict``)."""
        check_name("workflow name", name)
        listed = _steps_of(name, steps)
        if len(listed) > MAX_STEPS:
            raise InputError(
                f"workflow {name!r} has {len(listed)} steps, more than {MAX_STEPS}: each request"
                " carries the results of the steps before it, so a task's cost grows with the"
                " square of its steps; split it into workflows that submit one another"
            )
        wf = cls(name=name, steps=listed, version=version)
        for step in wf.steps:
            _check_policy(name, step)
        return wf


# The least wait of the "wait" escalation at definition: the step is retried after it again and
# again until an operator cancels, so 0 retried a failing service back to back for as long as
# its breaker stayed closed (found by review). Checked by Workflow.of only: a stored definition
# an older version allowed is read as it was written.
MIN_ESCALATION_WAIT = 1.0


def _check_policy(workflow: str, step: Step) -> None:
    """What a definition's policy may not say, that each of its values alone may (so
    :class:`~stepwarden.policies.Retry` and :class:`~stepwarden.policies.Backoff`, which read
    stored policies field by field, cannot refuse it)."""
    where = f"workflow {workflow!r}, step {step.name!r}"
    retry = step.retry
    for field_name in ("backoff", "in_attempt"):
        b = getattr(retry, field_name)
        if b.initial > b.maximum:
            raise InputError(
                f"{where}: Retry.{field_name} starts at {b.initial:g} s, above its maximum of"
                f" {b.maximum:g} s, so every delay would be the maximum: swap them, or raise the maximum"
            )
    if retry.escalation == "wait" and retry.escalation_wait < MIN_ESCALATION_WAIT:
        raise InputError(
            f"{where}: Retry.escalation_wait of {retry.escalation_wait:g} s retries the failing step"
            f" back to back until an operator cancels it: give it at least {MIN_ESCALATION_WAIT:g} s"
        )


def _steps_of(workflow: object, steps: object) -> tuple[Step, ...]:
    """The steps as a tuple; refused unless they are a list, tuple or other iterable of items."""
    if isinstance(steps, tuple):
        return steps
    if isinstance(steps, str | bytes | Mapping) or not isinstance(steps, Iterable):
        raise InputError(
            f"workflow {show(workflow)}: steps must be a list of Step objects, not {show(steps)}"
        )
    if isinstance(steps, Set):  # no order: the steps would run in whatever order hashing gives
        raise InputError(f"workflow {show(workflow)}: steps must be in order (a list), not a set")
    return tuple(steps)
