"""The PostgreSQL URL's own options (``listen``, ``pool_size``, ``prepare``, ``pooler``): parsed off
the libpq URL, defaulted and checked, without a server."""

from __future__ import annotations

import pytest

from stepwarden.errors import InputError
from stepwarden.store.postgres import TCP_DEFAULTS, PgOptions, parse_url, pg_options

BASE = "postgresql://sw:secret@db.internal:5432/stepwarden"


def test_our_options_come_off_the_url_and_libpq_keeps_the_rest() -> None:
    conninfo, ours = parse_url(
        BASE + "?sslmode=require&listen=off&pool_size=8&prepare=off&pooler=transaction&application_name=w"
    )
    assert conninfo == BASE + "?sslmode=require&application_name=w"
    assert ours == {"listen": "off", "pool_size": "8", "prepare": "off", "pooler": "transaction"}


def test_a_direct_connection_keeps_the_fast_path_by_default() -> None:
    assert pg_options(BASE) == PgOptions(
        conninfo=BASE, listen=True, prepare=True, pool_size=4, pooled=False, tcp=TCP_DEFAULTS
    )


def test_every_connection_gets_tcp_keepalives_and_a_user_timeout_unless_the_url_sets_them() -> None:
    """A partitioned server must not hold a thread for ever: see TCP_DEFAULTS. A URL that sets
    any of these keeps its own value (libpq's key=value form too), and gets the others."""
    assert dict(pg_options(BASE).tcp) == {
        "keepalives": "1",
        "keepalives_idle": "10",
        "keepalives_interval": "5",
        "keepalives_count": "3",
        "tcp_user_timeout": "30000",
    }
    assert dict(pg_options(BASE + "?keepalives_idle=60&tcp_user_timeout=0").tcp) == {
        "keepalives": "1",
        "keepalives_interval": "5",
        "keepalives_count": "3",
    }
    assert "keepalives" not in dict(pg_options("host=db.internal dbname=sw keepalives=0").tcp)
    # a URL libpq cannot parse gets them all, its own keepalives_idle unseen; connecting then
    # reports what is wrong with it
    assert pg_options(BASE + "?keepalives_idle=60&bogus=1").tcp == TCP_DEFAULTS


def test_a_libpq_older_than_12_is_not_given_tcp_user_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """It would refuse every connection with "invalid connection option"."""
    import psycopg

    monkeypatch.setattr(psycopg.pq, "version", lambda: 110022)
    assert "tcp_user_timeout" not in dict(pg_options(BASE).tcp)
    assert dict(pg_options(BASE).tcp)["keepalives_idle"] == "10"


@pytest.mark.parametrize(
    ("query", "listen", "prepare", "pooled"),
    [
        ("listen=off", False, True, False),
        ("prepare=off", True, False, False),
        ("listen=off&prepare=off", False, False, False),
        ("listen=0&prepare=false", False, False, False),
        ("prepare=ON", True, True, False),
        # behind a transaction-mode pooler: nothing that lives in a session
        ("pooler=transaction", False, False, True),
        ("pooler=Transaction&listen=off", False, False, True),
        # a pooler that tracks prepared statements (PgBouncer >= 1.22, max_prepared_statements > 0)
        ("pooler=transaction&prepare=on", False, True, True),
        # session mode keeps a session per client: every feature works
        ("pooler=session", True, True, False),
        ("pooler=none&listen=off", False, True, False),
    ],
)
def test_options_and_their_defaults(query: str, listen: bool, prepare: bool, pooled: bool) -> None:
    opts = pg_options(f"{BASE}?{query}")
    assert (opts.listen, opts.prepare, opts.pooled) == (listen, prepare, pooled)
    assert opts.conninfo == BASE


def test_pool_size_from_the_url_or_the_constructor() -> None:
    assert pg_options(BASE + "?pool_size=9").pool_size == 9
    assert pg_options(BASE + "?pool_size=9", pool_size=2).pool_size == 2


def test_constructor_arguments_override_the_url() -> None:
    opts = pg_options(BASE + "?listen=on&prepare=on", listen=False, prepare=False)
    assert (opts.listen, opts.prepare) == (False, False)
    assert pg_options(BASE + "?pooler=transaction", prepare=True).prepare is True


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("pooler=transaction&listen=on", "LISTEN needs a session of its own"),
        ("pooler=statement", "refuses multi-statement transactions"),
        ("pooler=pgbouncer", "expected transaction, session or none"),
        ("prepare=maybe", "prepare='maybe': expected on or off"),
        ("listen=sometimes", "listen='sometimes': expected on or off"),
        ("pool_size=many", "expected a whole number"),
        ("pool_size=0", "expected from 1 to 1000"),
        ("pool_size=100000", "expected from 1 to 1000"),  # found by review: accepted
    ],
)
def test_bad_options_are_refused_with_a_reason(query: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        pg_options(f"{BASE}?{query}")


def test_listen_on_cannot_be_forced_through_a_transaction_pooler() -> None:
    with pytest.raises(InputError, match="pooler=transaction and listen=on"):
        pg_options(BASE + "?pooler=transaction", listen=True)


def test_libpq_parameters_pass_through_exactly_as_written() -> None:
    """Decoding and re-encoding would turn %20 into '+', which libpq does not read as a space:
    ``options=-c%20statement_timeout%3D5000`` reached the server as ``-c+statement_timeout=5000``."""
    query = "options=-c%20statement_timeout%3D5000&application_name=my%20app&fallback=a%2Bb+c"
    conninfo, ours = parse_url(BASE + "?" + query + "&listen=off")
    assert conninfo == BASE + "?" + query
    assert ours == {"listen": "off"}
    assert parse_url(BASE + "?pool%5Fsize=2")[1] == {"pool_size": "2"}, "our own keys are decoded"


@pytest.mark.parametrize(
    "url",
    ["postgresql:///db?host=/tmp", "postgresql:///db", "postgresql://", "postgresql://h/db?host=/run/pg#x"],
)
def test_urls_without_a_host_part_keep_their_form(url: str) -> None:
    """A Unix-socket URL names no host before the path; rebuilding it from its parts dropped the
    empty host ('postgresql:/db?host=/tmp'), which libpq then refused."""
    assert parse_url(url) == (url, {})
    if "#" not in url:
        with_ours = url + ("&" if "?" in url else "?") + "listen=off"
        assert parse_url(with_ours) == (url, {"listen": "off"})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cret@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        ("postgresql://:s3cret@db/shop", "postgresql://:***@db/shop"),
        (
            "postgresql://app@db/shop?password=s3cret&sslmode=require",
            "postgresql://app@db/shop?password=***&sslmode=require",
        ),
        (
            "postgresql://app@db/shop?sslmode=require&password=s3cret",
            "postgresql://app@db/shop?sslmode=require&password=***",
        ),
        ("host=db password=s3cret dbname=shop", "host=db password=*** dbname=shop"),
        ("postgresql://app@db/shop", "postgresql://app@db/shop"),
        ("sqlite:///var/lib/shop.db", "sqlite:///var/lib/shop.db"),
    ],
)
def test_a_url_shown_anywhere_masks_its_password(url: str, shown: str) -> None:
    from stepwarden.store.base import redact_url

    assert redact_url(url) == shown
