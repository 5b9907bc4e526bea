"""The local control plane's fixtures, registered for every test by `pytest_plugins` in tests/conftest.py
(so tiers outside tests/cluster, such as tests/wheel, share the one session plane).

Session: `control_plane` (started once, stopped at the end), `kubeconfig` (the file it wrote, exported as
KUBECONFIG for the session), `admin_api` (kubernetes ApiClient as cluster-admin), `sa_client` (factory:
an ApiClient acting as a ServiceAccount). Per test: `namespace` (created, deleted afterwards).
The fixtures never read ~/.kube/config: a kubeconfig that does not point at this plane is refused.
A test outside tests/cluster that uses them carries the `cluster` marker itself (tests/cluster/conftest.py
marks its own tests and builds the binaries when any selected test has it).
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvferry.local.controlplane import ControlPlane, ControlPlaneError
from kvferry.local.controlplane.kubeconfig import read_server_and_ca

from tests.waiting import WaitTimeout, wait_until

NAMESPACE_READY_TIMEOUT_S = 30.0
NAMESPACE_DELETE_TIMEOUT_S = 60.0
STARTED_IN: list[tuple[float, dict[str, float]]] = []  # the plane's start time, for the summary


def check_kubeconfig(plane: ControlPlane, path: Path) -> None:
    """Refuse a kubeconfig that does not point at `plane` (server and CA must both match)."""
    server, ca = read_server_and_ca(path)
    if server != plane.server or ca != plane.ca_file.read_bytes():
        raise ControlPlaneError(f"kubeconfig {path} points at {server}, not at the test plane {plane.server}")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane()
    t0 = time.monotonic()
    try:
        plane.start(tmp_path_factory.mktemp("controlplane"))
        STARTED_IN.append((time.monotonic() - t0, plane.timings))
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> Iterator[Path]:
    path = control_plane.kubeconfig
    check_kubeconfig(control_plane, path)
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(path)  # so kubectl/helm/kopf started by tests reach this plane only
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


@pytest.fixture(scope="session")
def admin_api(control_plane: ControlPlane, kubeconfig: Path):
    with control_plane.admin_client() as api:
        yield api


@pytest.fixture(scope="session")
def sa_client(control_plane: ControlPlane, kubeconfig: Path) -> Iterator[Callable]:
    """`sa_client(namespace, name, create=True)` -> ApiClient acting as that ServiceAccount."""
    made = []

    def make(namespace: str, name: str, *, create: bool = True):
        api = control_plane.sa_client(namespace, name, create=create)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()


@pytest.fixture
def namespace(admin_api, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (its default ServiceAccount exists, so pods can be created at once)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from tests.cluster.operator_fixtures import exists

    core = client.CoreV1Api(admin_api)
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        wait_until(
            lambda: exists(core.read_namespaced_service_account, "default", name),
            f"namespace {name}'s default ServiceAccount",
            NAMESPACE_READY_TIMEOUT_S,
        )
        yield name
    finally:
        try:
            core.delete_namespace(name)
        except ApiException as e:
            if e.status != 404:  # a test may delete its namespace itself
                raise
        _release_finalizers(admin_api, name)

        # Wait for its pods to go so the next test gets the nodes' resources back (the namespace itself
        # may finish terminating later); a stuck finalizer only warns.
        def no_pods() -> bool:
            return not core.list_namespaced_pod(name).items

        try:
            wait_until(no_pods, f"namespace {name}'s pods to go", NAMESPACE_DELETE_TIMEOUT_S)
        except WaitTimeout as exc:
            warnings.warn(str(exc), stacklevel=1)


def _release_finalizers(api, namespace: str) -> None:
    """Drop the operator's finalizer from the namespace's DisaggregatedInferences (product code:
    `kvferry release-finalizers`). The test's operator has stopped by now; without this the namespace
    would stay Terminating and the next cluster-wide operator would find another test's leftovers.
    `force`: the CRs may not carry a deletionTimestamp yet, and a test may have installed the chart."""
    from kvferry.operator.reconcile.apply import Kube
    from kvferry.operator.runtime.finalizers import release

    release(Kube(api), namespace, force=True)
