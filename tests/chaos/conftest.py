"""The chaos harness (``bench/chaos.py``) loaded as a module, for the short chaos runs of CI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "chaos: a fault-injection run of the demo workload (tens of seconds)")


@pytest.fixture(scope="session")
def chaos() -> ModuleType:
    name = "stepwarden_bench_chaos"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
