"""Shared by the two folders of tests: tests/e2e (the filter's behaviour, in
real Envoys) and tests/tooling (the project's tooling: scripts/, the
Makefile, the reference rate-limit service, the schema, observability/).
The helpers here in tests/ (harness.py, http1.py, ecds.py, rls.py, the
child upstreams) are importable from both.

Each test is marked by its folder, `e2e` or `tooling`; `slow` marks the
few that take 10 s or more: `-m "not slow"` is the quick set. The markers
are registered in pytest.ini (at the project's root, which also makes it
the rootdir wherever pytest starts); see the Makefile's test targets.

The end-to-end tests run on the host SLUICE_HOST names (harness.HOST: the
wasm build by default, or the native build); `@pytest.mark.wasm_only(reason)`
marks a test that cannot apply to the native build, skipped there with
its reason."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from harness import HOST  # noqa: E402  (the path above first)


def pytest_report_header():
    return f"sluice host: {HOST} (SLUICE_HOST)"


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.parent.name
        if folder in ("e2e", "tooling"):
            item.add_marker(folder)
        only = item.get_closest_marker("wasm_only")
        if only is not None and HOST != "wasm":
            reason = only.args[0] if only.args else only.kwargs.get("reason", "the wasm build only")
            item.add_marker(pytest.mark.skip(reason=f"wasm build only: {reason}"))
