"""`kvferry transfer-demo` (the README's main command) runs the two-process transfer and says so."""

from __future__ import annotations

import pytest
from kvferry.cli import main

pytestmark = pytest.mark.nixl


def test_transfer_demo_reports_equal_kv(capsys):
    assert main(["transfer-demo", "--tokens", "300"]) == 0
    out = capsys.readouterr().out
    assert "received on 2/2 decode ranks" in out
    assert "per decode rank (own layout): [0, 0]" in out
    assert "DEMO OK" in out
