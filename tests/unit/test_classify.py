"""The default failure classifier (AGT5): which exceptions an operation raises are retried inside
the attempt ("transient") and which are replied as an error at once ("permanent").

Before, only builtin timeouts and connection errors, :class:`Transient` and httpx's errors were
transient, so an operation using the standard library (a DNS blip, a refused connect through
urllib, no route to host) or requests/aiohttp/urllib3 sent its task to ``error`` on one network
hiccup. Every exception here is a real one, built as the library raises it; no test looks up a
name or leaves the loopback interface.
"""

from __future__ import annotations

import asyncio
import email.message
import errno
import http.client
import random
import socket
import urllib.error
import urllib.request
from collections.abc import Callable

import psycopg
import pytest

from stepwarden.agent import Agent, AgentRole, Request, default_classify
from stepwarden.errors import Permanent
from stepwarden.policies import Backoff, Retry
from stepwarden.store import Store
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow, encode_input


def raised_from(exc: BaseException, cause: BaseException | None) -> BaseException:
    """``exc`` as ``raise exc from cause`` leaves it."""
    try:
        raise exc from cause
    except BaseException as e:
        return e


def chain(links: int, last: BaseException) -> BaseException:
    """A RuntimeError raised from a RuntimeError ... ``links`` links above ``last``."""
    exc = last
    for i in range(links):
        exc = raised_from(RuntimeError(f"wrapper {i}"), exc)
    return exc


def http_error(code: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://svc/charge", code, "status", email.message.Message(), None)


def cycle() -> BaseException:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    return a


def self_reason() -> BaseException:
    u = urllib.error.URLError("x")
    u.reason = u
    return u


def refused_url_error() -> urllib.error.URLError:
    """What urllib raises when nothing listens: the port is bound (so no one else takes it) and
    never listened on, so the connect is refused on loopback at once."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
        except urllib.error.URLError as e:
            return e
    raise AssertionError("connected to a port nobody listens on")


# Third-party clients' classes, named and derived as in their libraries, defined here (outside
# builtins) as the libraries define them: the classifier imports none of them.
class Requests:
    class RequestException(IOError): ...

    class ConnectionError(RequestException): ...

    class Timeout(RequestException): ...

    class ConnectTimeout(ConnectionError, Timeout): ...

    class ReadTimeout(Timeout): ...

    class InvalidURL(RequestException, ValueError): ...

    class HTTPError(RequestException):
        """``response.raise_for_status()``'s error: the response rides on it."""

        def __init__(self, status: int | None) -> None:
            super().__init__(f"{status} Server Error")
            self.response = None if status is None else Response(status)


class Response:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class Urllib3:
    class HTTPError(Exception): ...

    class TimeoutError(HTTPError): ...

    class ConnectTimeoutError(TimeoutError): ...

    class NewConnectionError(ConnectTimeoutError): ...

    class LocationParseError(HTTPError): ...


class Aiohttp:
    class ClientError(Exception): ...

    class ClientConnectionError(ClientError): ...

    class ServerDisconnectedError(ClientConnectionError): ...

    class ClientResponseError(ClientError):
        def __init__(self, status: int | None = None) -> None:
            super().__init__(f"{status}, message='Service Unavailable'")
            if status is not None:
                self.status = status


class APIStatusError(Exception):
    """An OpenAI-style SDK's error for an HTTP status."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"Error code: {status_code}")
        self.status_code = status_code


class Redis:
    class ConnectionError(Exception):
        """A client library's own ConnectionError, not derived from the builtin nor from OSError."""


class Psycopg2:
    class Error(Exception):
        def __init__(self, text: str, pgcode: str | None = None) -> None:
            super().__init__(text)
            self.pgcode = pgcode

    class OperationalError(Error): ...

    class IntegrityError(Error): ...


for _cls in (Psycopg2.Error, Psycopg2.OperationalError, Psycopg2.IntegrityError):
    _cls.__module__ = "psycopg2.extensions"


class Sqlite3OperationalError(Exception):
    """Another driver's OperationalError ("no such table" is one): no rule of its own."""


Sqlite3OperationalError.__name__ = "OperationalError"


class FakeBuiltinTimeout(Exception):
    """A class claiming to be a builtin: the name rule is for third-party classes only."""

    __module__ = "builtins"


FakeBuiltinTimeout.__name__ = "Timeout"


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        # what was covered before, unchanged
        pytest.param(Permanent("declined"), "permanent", id="permanent"),
        pytest.param(TimeoutError(), "transient", id="timeout-error"),
        pytest.param(ConnectionResetError(), "transient", id="builtin-connection-reset"),
        pytest.param(ValueError("a bug"), "permanent", id="value-error"),
        # DNS
        pytest.param(
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "transient", id="gaierror"
        ),
        pytest.param(
            socket.gaierror(socket.EAI_AGAIN, "Temporary failure"), "transient", id="gaierror-again"
        ),
        # OSError by errno: the ones Python raises as a bare OSError or a non-network subclass
        pytest.param(OSError(errno.EHOSTUNREACH, "No route to host"), "transient", id="errno-ehostunreach"),
        pytest.param(
            OSError(errno.ENETUNREACH, "Network is unreachable"), "transient", id="errno-enetunreach"
        ),
        pytest.param(OSError(errno.ENETDOWN, "Network is down"), "transient", id="errno-enetdown"),
        pytest.param(OSError(errno.EHOSTDOWN, "Host is down"), "transient", id="errno-ehostdown"),
        pytest.param(
            OSError(errno.ENETRESET, "Network dropped connection"), "transient", id="errno-enetreset"
        ),
        pytest.param(OSError(errno.ENOBUFS, "No buffer space"), "transient", id="errno-enobufs"),
        pytest.param(OSError(errno.EAGAIN, "Try again"), "transient", id="errno-eagain"),
        pytest.param(OSError(errno.ETIMEDOUT, "Timed out"), "transient", id="errno-etimedout"),
        pytest.param(OSError(errno.ECONNREFUSED, "Refused"), "transient", id="errno-econnrefused"),
        pytest.param(OSError(errno.EPIPE, "Broken pipe"), "transient", id="errno-epipe"),
        # file and other OS errors stay permanent
        pytest.param(FileNotFoundError(errno.ENOENT, "No such file"), "permanent", id="file-not-found"),
        pytest.param(PermissionError(errno.EACCES, "Permission denied"), "permanent", id="permission"),
        pytest.param(IsADirectoryError(errno.EISDIR, "Is a directory"), "permanent", id="is-a-directory"),
        pytest.param(OSError("boom"), "permanent", id="oserror-errno-none"),
        # urllib: URLError by its reason
        pytest.param(urllib.error.URLError(ConnectionRefusedError()), "transient", id="urlerror-refused"),
        # socket.timeout is TimeoutError since Python 3.10
        pytest.param(urllib.error.URLError(TimeoutError("timed out")), "transient", id="urlerror-timeout"),
        pytest.param(
            urllib.error.URLError(socket.gaierror(socket.EAI_NONAME, "unknown")),
            "transient",
            id="urlerror-dns",
        ),
        pytest.param(
            urllib.error.URLError(OSError(errno.EHOSTUNREACH, "No route")),
            "transient",
            id="urlerror-no-route",
        ),
        pytest.param(
            urllib.error.URLError(urllib.error.URLError(ConnectionRefusedError())),
            "transient",
            id="urlerror-nested",
        ),
        pytest.param(urllib.error.URLError("unknown url type: htp"), "permanent", id="urlerror-text-reason"),
        pytest.param(
            urllib.error.URLError(FileNotFoundError(2, "x")), "permanent", id="urlerror-file-reason"
        ),
        pytest.param(self_reason(), "permanent", id="urlerror-reason-is-itself"),
        # urllib: HTTPError by its status, as httpx's
        pytest.param(http_error(503), "transient", id="httperror-503"),
        pytest.param(http_error(500), "transient", id="httperror-500"),
        pytest.param(http_error(429), "transient", id="httperror-429"),
        pytest.param(http_error(408), "transient", id="httperror-408"),
        pytest.param(http_error(425), "transient", id="httperror-425"),
        pytest.param(http_error(404), "permanent", id="httperror-404"),
        pytest.param(http_error(400), "permanent", id="httperror-400"),
        pytest.param(http_error(302), "permanent", id="httperror-302"),
        # http.client: the connection cut mid-reply
        pytest.param(http.client.RemoteDisconnected("closed"), "transient", id="remote-disconnected"),
        pytest.param(http.client.IncompleteRead(b"part", 10), "transient", id="incomplete-read"),
        pytest.param(http.client.InvalidURL("bad"), "permanent", id="http-invalid-url"),
        # third-party classes, by name in their MRO
        pytest.param(Requests.ConnectionError("refused"), "transient", id="requests-connection-error"),
        pytest.param(Requests.Timeout("slow"), "transient", id="requests-timeout"),
        pytest.param(Requests.ConnectTimeout("slow"), "transient", id="requests-connect-timeout"),
        pytest.param(Requests.ReadTimeout("slow"), "transient", id="requests-read-timeout"),
        pytest.param(Requests.InvalidURL("bad"), "permanent", id="requests-invalid-url"),
        pytest.param(Requests.RequestException("?"), "permanent", id="requests-base"),
        pytest.param(Urllib3.NewConnectionError("refused"), "transient", id="urllib3-new-connection"),
        pytest.param(Urllib3.TimeoutError("slow"), "transient", id="urllib3-timeout"),
        pytest.param(Urllib3.LocationParseError("bad"), "permanent", id="urllib3-parse"),
        pytest.param(Aiohttp.ServerDisconnectedError(), "transient", id="aiohttp-disconnected"),
        pytest.param(Aiohttp.ClientConnectionError(), "transient", id="aiohttp-connection"),
        pytest.param(Aiohttp.ClientResponseError(), "permanent", id="aiohttp-response"),
        # other clients' HTTP status errors, by the status they carry (read by duck typing)
        pytest.param(Requests.HTTPError(503), "transient", id="requests-http-503"),
        pytest.param(Requests.HTTPError(429), "transient", id="requests-http-429"),
        pytest.param(Requests.HTTPError(404), "permanent", id="requests-http-404"),
        pytest.param(Requests.HTTPError(None), "permanent", id="requests-http-no-response"),
        pytest.param(Aiohttp.ClientResponseError(503), "transient", id="aiohttp-response-503"),
        pytest.param(Aiohttp.ClientResponseError(402), "permanent", id="aiohttp-response-402"),
        pytest.param(APIStatusError(502), "transient", id="sdk-status-502"),
        pytest.param(APIStatusError(401), "permanent", id="sdk-status-401"),
        pytest.param(Urllib3.HTTPError("base of all its errors"), "permanent", id="urllib3-base-no-status"),
        # asyncio streams: the peer closed mid-read
        pytest.param(asyncio.IncompleteReadError(b"par", 10), "transient", id="asyncio-incomplete-read"),
        # PostgreSQL drivers' errors, by SQLSTATE
        pytest.param(psycopg.errors.AdminShutdown(), "transient", id="pg-admin-shutdown"),
        pytest.param(psycopg.errors.SerializationFailure(), "transient", id="pg-serialization"),
        pytest.param(psycopg.errors.DeadlockDetected(), "transient", id="pg-deadlock"),
        pytest.param(psycopg.errors.QueryCanceled(), "transient", id="pg-statement-timeout"),
        pytest.param(psycopg.errors.ConnectionFailure(), "transient", id="pg-08006"),
        pytest.param(psycopg.errors.UniqueViolation(), "permanent", id="pg-unique-violation"),
        pytest.param(psycopg.errors.UndefinedTable(), "permanent", id="pg-undefined-table"),
        pytest.param(psycopg.OperationalError("connection lost"), "transient", id="pg-no-code"),
        pytest.param(Psycopg2.OperationalError("reset"), "transient", id="psycopg2-operational"),
        pytest.param(Psycopg2.IntegrityError("dup", "23505"), "permanent", id="psycopg2-integrity"),
        pytest.param(Psycopg2.IntegrityError("dead", "40P01"), "transient", id="psycopg2-by-pgcode"),
        pytest.param(Sqlite3OperationalError(), "permanent", id="other-operational-error"),
        pytest.param(Redis.ConnectionError("down"), "transient", id="plain-class-named-connection-error"),
        pytest.param(FakeBuiltinTimeout(), "permanent", id="name-rule-skips-builtins"),
        # raise ... from: the cause decides what the exception itself does not
        pytest.param(
            raised_from(Exception("wrapped"), ConnectionRefusedError()), "transient", id="from-refused"
        ),
        pytest.param(
            raised_from(RuntimeError("wrapped"), urllib.error.URLError(ConnectionRefusedError())),
            "transient",
            id="from-urlerror",
        ),
        pytest.param(
            raised_from(Exception("wrapped"), ValueError("bug")), "permanent", id="from-value-error"
        ),
        pytest.param(
            raised_from(Permanent("declined"), ConnectionError()), "permanent", id="permanent-from-conn"
        ),
        pytest.param(
            raised_from(Exception("x"), raised_from(Permanent("no"), ConnectionRefusedError())),
            "permanent",
            id="the-walk-stops-at-permanent",
        ),
        pytest.param(raised_from(http_error(404), ConnectionResetError()), "permanent", id="404-from-reset"),
        pytest.param(chain(5, ConnectionRefusedError()), "transient", id="cause-5-links-down"),
        pytest.param(chain(6, ConnectionRefusedError()), "permanent", id="cause-6-links-down-too-deep"),
        pytest.param(cycle(), "permanent", id="cause-cycle"),
    ],
)
def test_default_classification(exc: BaseException, kind: str) -> None:
    assert default_classify(exc) == kind


def test_only_an_explicit_cause_counts_not_the_exception_being_handled() -> None:
    try:
        try:
            raise ConnectionRefusedError
        except ConnectionRefusedError:
            raise KeyError("a bug in the handler")  # noqa: B904 - the implicit context is the point
    except KeyError as e:
        assert isinstance(e.__context__, ConnectionRefusedError)
        assert default_classify(e) == "permanent"


def test_a_real_refused_connection_through_urllib_is_transient() -> None:
    e = refused_url_error()
    assert isinstance(e.reason, ConnectionRefusedError)
    assert default_classify(e) == "transient"


def test_default_classify_lives_in_its_module_and_is_every_agents_default() -> None:
    from stepwarden import App, agent_definition, classify

    assert default_classify is classify.default_classify is agent_definition.default_classify
    assert Agent("svc").classify is default_classify
    assert App().agent("svc").classify is default_classify


# -- end to end: a plain-function operation on the standard library (AGT5, AGT7) --------------------


def test_a_refused_connection_in_a_plain_function_is_retried_inside_the_attempt(
    rt_store: Store, make_workflow: Callable[..., Workflow]
) -> None:
    retry = Retry(tries=4, in_attempt=Backoff(initial=0.01, maximum=0.02, jitter=0.0))
    wf = make_workflow("s", budget=5.0, retry=retry, compensate=False)
    task_id, *_ = rt_store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )
    assert rt_store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
    agent = Agent("svc")
    calls: list[int] = []

    @agent.operation
    def do_s(req: Request) -> str:  # plain: runs in the role's thread pool
        calls.append(req.attempt)
        if len(calls) < 3:
            raise refused_url_error()  # the service is restarting
        return "charged"

    async def body() -> None:
        role = AgentRole(rt_store, {agent.name: agent}, "agent-1:1:abc")
        assert await role.pull() == 1
        done, pending = await asyncio.wait(set(role.tasks), timeout=3.0)
        assert not pending
        for d in done:
            d.result()

    asyncio.run(body())
    assert calls == [1, 1, 1], "retried twice inside attempt 1, not replied permanent at the first refusal"
    rows = rt_store.transact_sync(
        lambda tx: tx.sql("SELECT task_id, attempt, outcome, result, error FROM replies")
    )
    assert [(r["task_id"], r["attempt"], r["outcome"], r["result"], r["error"]) for r in rows] == [
        (task_id, 1, "ok", '"charged"', None)
    ]
    rt_store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
    assert rt_store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks"))[0]["state"] == "processed"


# -- exception groups: a TaskGroup fan-out (AGT5) ----------------------------------------------------


def _status_error(code: int) -> Exception:
    import httpx

    req = httpx.Request("GET", "http://svc/x")
    return httpx.HTTPStatusError("status", request=req, response=httpx.Response(code, request=req))


def _read_timeout() -> Exception:
    import httpx

    return httpx.ReadTimeout("read timed out", request=httpx.Request("GET", "http://svc/x"))


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        pytest.param(ExceptionGroup("g", [ConnectionResetError()]), "transient", id="group-of-reset"),
        pytest.param(ExceptionGroup("g", [_read_timeout()]), "transient", id="group-of-httpx-timeout"),
        pytest.param(BaseExceptionGroup("g", [TimeoutError()]), "transient", id="base-group-of-timeout"),
        pytest.param(
            ExceptionGroup("g", [ExceptionGroup("inner", [ConnectionRefusedError()])]),
            "transient",
            id="nested-group",
        ),
        pytest.param(
            ExceptionGroup("g", [ValueError("a bug"), ConnectionResetError()]),
            "transient",
            id="a-bug-and-a-reset",
        ),
        pytest.param(
            ExceptionGroup("g", [ConnectionResetError(), Permanent("declined")]),
            "permanent",
            id="a-reset-and-a-permanent",
        ),
        pytest.param(
            ExceptionGroup("g", [_status_error(404), _read_timeout()]), "permanent", id="a-404-and-a-timeout"
        ),
        pytest.param(ExceptionGroup("g", [ValueError("a bug")]), "permanent", id="group-of-a-bug"),
        pytest.param(
            raised_from(ExceptionGroup("g", [ValueError("a bug")]), ConnectionResetError()),
            "transient",
            id="undecided-group-from-a-reset",
        ),
    ],
)
def test_an_exception_group_is_transient_if_a_leaf_is_and_none_is_permanent(
    exc: BaseException, kind: str
) -> None:
    """A fan-out in which one call met a dropped connection is worth retrying; one in which a call
    got a definite answer (Permanent, a 404) is not, whatever the others met."""
    assert default_classify(exc) == kind


def test_judge_turns_a_classify_that_raises_or_answers_nonsense_into_a_permanent_failure() -> None:
    from stepwarden.classify import judge

    def broken(exc: BaseException) -> str:
        raise RuntimeError("classify bug")

    assert judge(default_classify, ConnectionResetError()) == ("transient", None)
    assert judge(broken, ConnectionResetError()) == (
        "permanent",
        "classify raised RuntimeError: classify bug",
    )
    assert judge(lambda e: "retry-later", ValueError()) == (
        "permanent",
        "classify returned 'retry-later', not 'transient' or 'permanent'",
    )
    assert judge(lambda e: None, ValueError())[0] == "permanent"


def test_a_real_refused_connection_through_psycopg_is_transient() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(psycopg.OperationalError) as caught:
            psycopg.connect(f"postgresql://127.0.0.1:{port}/x", connect_timeout=2)
    assert default_classify(caught.value) == "transient"


def test_a_server_refusing_a_psycopg_connect_for_its_configuration_is_permanent(pg_admin_url: str) -> None:
    """psycopg gives the server's FATAL at connect no SQLSTATE, as it gives none to a refused
    connection: a database or role that does not exist is configuration, which no retry heals
    (found by review: it was retried, and counted toward the breaker). A server starting up is
    not (57P03's text, as the server words it)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(pg_admin_url)
    for url in (
        urlunsplit(parts._replace(path="/no_such_database_here")),
        urlunsplit(parts._replace(netloc=f"no_such_role_here@{parts.hostname}:{parts.port}")),
    ):
        with pytest.raises(psycopg.OperationalError) as caught:
            psycopg.connect(url, connect_timeout=5)
        assert caught.value.sqlstate is None
        assert default_classify(caught.value) == "permanent", str(caught.value)
    starting = psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  the'
        " database system is starting up"
    )
    assert default_classify(starting) == "transient"
    too_many = psycopg.OperationalError("connection failed: FATAL:  sorry, too many clients already")
    assert default_classify(too_many) == "transient"
    for text in (  # found by review: refusals a list of transient ones did not name
        "FATAL:  the database system is not accepting connections\nDETAIL:  Hot standby mode is disabled.",
        "FATAL:  the database system is not yet accepting connections",
        "consuming input failed: FATAL:  terminating connection due to administrator command",
    ):
        assert default_classify(psycopg.OperationalError(text)) == "transient", text


def test_the_operations_own_permanent_or_transient_wins_over_the_agents_classify() -> None:
    """SPEC §5's sketch raises Permanent("card declined") for an error reply at once; an agent
    whose classify retried everything else retried the declined card too."""
    from stepwarden.classify import judge
    from stepwarden.errors import Transient

    assert judge(lambda e: "transient", Permanent("card declined")) == ("permanent", None)
    assert judge(lambda e: "permanent", Transient("busy")) == ("transient", None)
    assert judge(lambda e: "transient", ValueError("other")) == ("transient", None)


def test_the_rules_import_no_http_library_so_a_cli_command_starts_without_one() -> None:
    """The standard library's and httpx's exceptions are judged through ``sys.modules``: one of their
    classes exists only once its module is imported. So ``stepwarden`` itself imports neither
    (``http.client`` pulls in the email package, a fifth of a CLI command's start), and an
    exception of each is still judged as above (the imports of this module)."""
    import subprocess
    import sys

    names = "('http.client', 'httpx', 'email')"
    code = f"import sys, stepwarden.cli; print(sorted(m for m in {names} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out
    assert default_classify(http.client.RemoteDisconnected("gone")) == "transient"
    assert default_classify(urllib.error.URLError(ConnectionRefusedError())) == "transient"
