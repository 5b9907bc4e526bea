"""config: extra_config errors name the key; preflight: EFA detection from sysfs."""

from __future__ import annotations

import pytest
from kvferry.connector.config import ConfigError, KvferryConfig
from kvferry.connector.preflight import efa_devices


def test_defaults_are_for_efa():
    assert KvferryConfig.from_extra(None).backends == ["LIBFABRIC"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"lease": 3}, "unknown key 'lease' \\(did you mean 'lease_s'\\?\\)"),
        ({"lease_s": "3"}, "lease_s: expected float"),
        ({"lease_s": 0}, "lease_s must be > 0"),
        ({"backends": ["TCP"]}, "backends=\\['TCP'\\]"),
        ({"side_channel_port": 70000}, "is not a TCP port"),
        ({"max_entries": 2.5}, "max_entries: expected int"),
        ({"progress_thread": 1}, "progress_thread: expected true/false"),
        ({"descriptors": "fast"}, "descriptors='fast'"),
        ({"poll_min_s": 1, "poll_max_s": 0.5}, "poll_min_s must be <= poll_max_s"),
        ({"backends": []}, "backends=\\[\\] is not a non-empty list"),
        ({"side_channel_port": True}, "side_channel_port=True is not a TCP port"),
        ({"max_entries": 0}, "max_entries must be >= 1, got 0"),
        ({"num_threads": -1}, "num_threads must be >= 0, got -1"),
        ({"revision": None}, "revision: expected a string, got None"),
    ],
)
def test_bad_extra_config_names_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        KvferryConfig.from_extra(extra)


def test_cpu_config_parses():
    cfg = KvferryConfig.from_extra({"backends": "ucx", "lease_s": 5, "descriptors": "coalesced"})
    assert cfg.backends == ["UCX"] and cfg.lease_s == 5.0 and cfg.descriptors == "coalesced"


def test_efa_devices_read_from_sysfs(tmp_path):
    for name, driver in (("rdmap0", "efa"), ("mlx5_0", "mlx5_core")):
        drv = tmp_path / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ib" / name / "device").mkdir(parents=True)
        (tmp_path / "ib" / name / "device" / "driver").symlink_to(drv)
    assert efa_devices(tmp_path / "ib") == ["rdmap0"]
    assert efa_devices(tmp_path / "missing") == []
