"""Cluster config parsing and the checked-in protobuf stubs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_default_config():
    cfg = load_config(None)
    assert [s.name for s in cfg.sites] == ["local"]
    assert cfg.sites[0].prefill.replicas == 1 and cfg.sites[0].decode.replicas == 1
    assert cfg.model.path is None


TWO = {"sites": [{"name": "a"}, {"name": "b"}]}


def test_topology_config():
    cfg = parse_config({**TWO, "links": [{"between": ["a", "b"], "rtt_ms": 9, "gbps": 1, "protection": "integrity"}],
                        "router": {"policy": "prefix_aware"}})
    assert cfg.links[0].between == ["a", "b"] and cfg.links[0].rtt_ms == 9.0 and cfg.links[0].protection == "integrity"
    assert cfg.router.policy == "prefix_aware" and load_config(None).router.policy == "cost_model"
    assert load_config(None).kv.protection == "aead"  # every link is encrypted unless it says otherwise
    with pytest.raises(ConfigError, match="encrypt: replaced by protection"):
        parse_config({**TWO, "links": [{"between": ["a", "b"], "encrypt": True}]})
    with pytest.raises(ConfigError, match="links.*protection: must be aead or integrity, got 'none'"):
        parse_config({**TWO, "links": [{"between": ["a", "b"], "protection": "none"}]})


def test_example_configs_parse():
    from pathlib import Path

    paths = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))
    assert len(paths) >= 2
    for path in paths:
        assert len(load_config(path).sites) >= 2


@pytest.mark.parametrize("raw,match", [
    ({"sites": [{"name": "a", "decode": {"replicas": -1}}]}, r"sites\[0\]\.decode\.replicas: must be in \[0, max_replicas=16\]"),
    ({"sites": [{"name": "a", "decode": {"replicas": 3, "max_replicas": 2}}]},
     r"sites\[0\]\.decode\.replicas: must be in \[0, max_replicas=2\], got 3"),
    ({"auth": {"operators": [{"name": "noc", "token_sha256": "abc"}]}}, r"auth\.operators\[0\]\.token_sha256: must be 64"),
    ({"auth": {"operators": [{"name": "noc", "token_sha256": "a" * 64}, {"name": "noc", "token_sha256": "b" * 64}]}},
     r"auth\.operators\[1\]\.name: must be non-empty and unique"),
    ({"router": {"drain_timeout_s": 0}}, r"router\.drain_timeout_s: must be positive"),
    ({"router": {"port": "x"}}, r"router\.port: expected an integer"),
    ({"router": {"port": 70000}}, r"router\.port"),
    ({"routr": {}}, r"config: unknown field\(s\) routr"),
    ({"sites": [{"name": "a"}, {"name": "a"}]}, r"sites\[1\]\.name: duplicate site 'a'"),
    ({"sites": [{"name": "Bad Name"}]}, r"sites\[0\]\.name"),
    ({"sites": []}, r"sites: expected a non-empty list"),
    ({"sites": [{"name": "a", "decode": {"replicas": 0}}]}, r"at least one site needs a decode worker"),
    ({"cache": {"block_size": 3}}, r"cache: .*block_size must be a positive power of two"),
    ({"model": {"dtype": "int4"}}, r"model\.dtype"),
    ({"sites": [{"name": "a", "prefill": {"replicas": True}}]}, r"sites\[0\]\.prefill\.replicas: expected an integer"),
    ({**TWO, "links": [{"between": ["a", "x"]}]}, r"links\[0\]\.between: unknown site 'x'"),
    ({**TWO, "links": [{"between": ["a", "b"], "gbps": -1}]}, r"links\[0\]\.gbps: must be positive"),
    ({**TWO, "links": [{"between": ["a", "b"], "rtt_ms": -3}]}, r"links\[0\]\.rtt_ms: must be >= 0"),
    ({**TWO, "links": [{"between": ["a", "a"]}]}, r"links\[0\]\.between: must name two different sites"),
    ({**TWO, "links": [{"between": ["a", "b"]}, {"between": ["b", "a"]}]}, r"links\[1\]: duplicate link"),
    ({**TWO, "links": [{"between": ["a", "b"], "transport": "carrier-pigeon"}]}, r"links\[0\]\.transport"),
    ({**TWO, "links": {"between": ["a", "b"]}}, r"links: expected a list of links"),
    ({"router": {"policy": "fastest"}}, r"router\.policy: must be one of round_robin"),
    ({"router": {"max_inflight_per_worker": 0}}, r"router\.max_inflight_per_worker"),
    ({"sites": [{"name": "a", "decode": {"device": "tpu"}}]}, r"sites\[0\]\.decode\.device"),
])
def test_invalid_config_names_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sites: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("router:\n  port: -1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: router.port"):
        load_config(bad)


def test_generated_stubs_are_fresh():
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "codegen.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
