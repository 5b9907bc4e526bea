"""Tests against the local control plane (kvferry.local.controlplane), all marked `cluster`.

The fixtures (`control_plane`, `kubeconfig`, `admin_api`, `sa_client`, `namespace`) are in
plane_fixtures.py, registered for every tier by tests/conftest.py; this file marks the tests here and
builds the binaries when any selected test, here or in another tier, carries the `cluster` marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.local.controlplane import build

from tests.cluster import on_demand
from tests.cluster.plane_fixtures import STARTED_IN

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selection reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.cluster)


@pytest.hookimpl(trylast=True)  # after selection and the other orderings (tests/e2e/shared_stack.py)
def pytest_collection_finish(session: pytest.Session) -> None:
    """If a cluster test runs, build the binaries (tens of minutes cold) here, outside any test timeout;
    start the on-demand ones (Kueue) in the background and run their tests last (on_demand.py)."""
    if not any(item.get_closest_marker("cluster") for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show the build's progress lines
        build.ensure_built()
        if any(on_demand.needs_on_demand(i) for i in session.items):
            on_demand.last(session.items)
            on_demand.start_if_missing()


def pytest_sessionfinish() -> None:
    on_demand.stop()


def pytest_terminal_summary(terminalreporter) -> None:
    if STARTED_IN:
        total, phases = STARTED_IN[0]
        terminalreporter.write_line(f"kvferry control plane: started in {total:.1f} s (cumulative: {phases})")
