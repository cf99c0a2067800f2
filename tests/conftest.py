"""Shared by the two folders of tests: tests/e2e (the filter's behaviour, in
real Envoys) and tests/tooling (the project's tooling: scripts/, the
Makefile, the reference rate-limit service, the schema, observability/).
The helpers here in tests/ (harness.py, http1.py, ecds.py, rls.py, the
child upstreams) are importable from both.

Each test is marked by its folder, `e2e` or `tooling`; `slow` marks the
few that take 10 s or more: `-m "not slow"` is the quick set. The markers
are registered in pytest.ini (at the project's root, which also makes it
the rootdir wherever pytest starts); see the Makefile's test targets."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.parent.name
        if folder in ("e2e", "tooling"):
            item.add_marker(folder)
