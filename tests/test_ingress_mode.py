"""folio.serve.ingress_mode: the environment a cluster gets for each ingress mode, and a local cluster's HAProxy
files and processes (the served paths themselves run in tests/test_serving*.py: direct by default, proxy in
tests/test_serving_health.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from folio.serve import ingress_mode
from folio.serve.config import ServeConfig
from folio.serve.config_values import ConfigError


def test_direct_mode_sets_serves_throughput_settings_and_proxy_mode_sets_none():
    assert ingress_mode.cluster_env("proxy") == {}
    direct = ingress_mode.cluster_env("direct")
    assert direct == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    local = ingress_mode.cluster_env("direct", local=True)
    assert local.items() > direct.items() and local["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "1"
    with pytest.raises(ValueError, match="direct, proxy"):
        ingress_mode.cluster_env("haproxy")


def test_config_takes_only_the_known_modes():
    assert ServeConfig().ingress_mode == "direct"
    assert ServeConfig.from_dict({"ingress_mode": "proxy"}).ingress_mode == "proxy"
    with pytest.raises(ConfigError, match="ingress_mode"):
        ServeConfig(ingress_mode="fast")


def test_local_environment_applies_for_the_block_and_restores_the_callers(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # the caller's own, e.g. from a shell
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", raising=False)
    haproxy = ingress_mode.LocalHAProxy()
    try:
        with ingress_mode.local_environment("proxy"):
            # a proxy cluster: the caller's setting must not turn it direct
            assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        with ingress_mode.local_environment("direct", haproxy):
            assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
            assert os.environ["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"].startswith(haproxy.directory + os.sep)
            ports = [os.environ[name] for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                                                   "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
                                                   "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")]
            assert len(set(ports)) == 4
        assert "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in os.environ
        assert "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC" not in os.environ
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    finally:
        haproxy.stop()


def test_stop_ends_the_processes_of_this_clusters_haproxy_only(tmp_path):
    haproxy = ingress_mode.LocalHAProxy()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    # Serve starts HAProxy with its config in a folder below the directory it is given
    ours = subprocess.Popen([*sleeper, os.path.join(haproxy.directory, "0123abcd", "haproxy.cfg")])
    other = subprocess.Popen([*sleeper, str(tmp_path / "haproxy.cfg")])
    try:
        haproxy.stop(timeout_s=10)
        assert ours.wait(timeout=10) != 0  # killed
        assert other.poll() is None
        assert not os.path.exists(haproxy.directory)
    finally:
        for process in (ours, other):
            process.kill()
            process.wait(timeout=10)
