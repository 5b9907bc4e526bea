"""An install from the wheel has no checkout and so no crds/ folder: `kvferry generate --crds` prints
the CRDs from the installed package, the same documents `kvferry generate` writes to crds/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from kvferry.codegen.generate import crd_files

from tests.wheel import wheelkit


def test_generate_crds_from_the_wheel_prints_the_crds_without_a_checkout(wheel_venv, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(wheel_venv.kvferry), "generate", "--crds"],
        cwd=tmp_path,
        env=wheelkit.clean_env(wheel_venv.venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    want = [doc for docs, _ in crd_files().values() for doc in docs]
    assert [d["metadata"]["name"] for d in got] == [d["metadata"]["name"] for d in want]
    assert got == want
    # Without --crds it still refuses to run outside a checkout, naming why.
    bare = subprocess.run(
        [str(wheel_venv.kvferry), "generate", "--root", str(tmp_path)],
        cwd=tmp_path,
        env=wheelkit.clean_env(wheel_venv.venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bare.returncode == 2 and "run it in a kvferry checkout" in bare.stderr, bare.stderr
