"""Which store ``submit --app`` and ``worker --app`` use (DEP5): ``--db``, else the store the
application was made with (``App("sqlite:///shop.db")``), as the app itself does, else
``STEPWARDEN_DB``, else ``sqlite:///stepwarden.db``. The app's own store used to be ignored:
the command line made a ``stepwarden.db`` in the working folder, and the tasks the web process
submitted with ``app.submit`` were never run by the command line's workers."""

from __future__ import annotations

from pathlib import Path

from stepwarden import App, Step

from .helpers import FINAL, SW, Db, Procs, clean_env, sw, wait_until

SHOP = """
from stepwarden import App, Step

app = App({url!r})
inv = app.agent("inv")


@inv.operation
def reserve(req):
    return None


app.workflow("order", [Step("reserve", "inv.reserve", complete_by=5)])
"""


def shop(folder: Path, name: str = "shop.db") -> Db:
    """``shop.py`` in ``folder``, whose app is made with the store ``folder/name`` (not created yet)."""
    db = Db(folder / name, folder)
    (folder / "shop.py").write_text(SHOP.format(url=db.url))
    return db


def submitted(folder: Path, env: dict[str, str] | None = None, *db: str) -> int:
    r = sw(*db, "submit", "order", "--app", "shop:app", "--input", '{"order": "o-1"}', cwd=folder, env=env)
    assert r.returncode == 0, str(r)
    return int(r.stdout)


def test_submit_with_app_writes_to_the_apps_own_store(tmp_path: Path) -> None:
    own = shop(tmp_path)
    task_id = submitted(tmp_path)
    assert not (tmp_path / "stepwarden.db").exists(), "submit --app made a store of its own"
    assert own.task(task_id)["workflow"] == "order"


def test_db_comes_before_the_apps_own_store_and_the_app_before_the_variable(tmp_path: Path) -> None:
    """The app's ``app.submit`` writes to its own URL whatever ``STEPWARDEN_DB`` says, so the
    command line with ``--app`` does too: a worker that followed the variable never ran the tasks
    the web process submitted. ``--db`` still chooses."""
    own = shop(tmp_path)
    by_env = Db(tmp_path / "env.db", tmp_path)
    by_option = Db(tmp_path / "option.db", tmp_path)
    env = clean_env(STEPWARDEN_DB=by_env.url)
    first = submitted(tmp_path, env)
    second = submitted(tmp_path, env, "--db", by_option.url)
    assert own.task(first)["workflow"] == "order"
    assert by_option.task(second)["workflow"] == "order"
    assert not by_env.path.exists() and not (tmp_path / "stepwarden.db").exists()
    in_code = App(own.url)
    try:
        assert in_code.store.url == own.url, "the app itself opens its own URL, as the command line did"
    finally:
        in_code.close()


def test_an_app_made_without_a_url_follows_the_variable(tmp_path: Path) -> None:
    (tmp_path / "shop.py").write_text(SHOP.format(url=None))
    by_env = Db(tmp_path / "env.db", tmp_path)
    task_id = submitted(tmp_path, clean_env(STEPWARDEN_DB=by_env.url))
    assert by_env.task(task_id)["workflow"] == "order"
    assert not (tmp_path / "stepwarden.db").exists()


def test_a_worker_with_app_runs_the_tasks_of_the_apps_own_store(tmp_path: Path, procs: Procs) -> None:
    """A task the web process submits with ``app.submit`` (into the app's store) is run by a
    worker started as the docs say, ``stepwarden worker --app shop:app``."""
    own = shop(tmp_path)
    web = App(own.url)
    web.workflow("order", [Step("reserve", "inv.reserve", complete_by=5)])
    try:
        task_id = web.submit("order", {"order": "o-1"})
    finally:
        web.close()
    worker = procs.start([str(SW), "worker", "--app", "shop:app", "--name", "w"], "worker", clean_env())
    started = wait_until(
        lambda: next((ln for ln in procs.log_of(worker).splitlines() if " starting: " in ln), None),
        20,
        "the worker to start",
    )
    assert started.endswith(f"store={own.url}"), started
    assert own.wait_state(task_id, FINAL, timeout=30)["state"] == "processed", procs.log_of(worker)
    assert not (tmp_path / "stepwarden.db").exists(), "the worker made a store of its own"
