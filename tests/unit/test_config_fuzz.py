"""Property tests of the config loader: whatever the input (a valid config with
random leaves replaced, keys deleted or added; random text or bytes as the
file), loading either succeeds or raises ConfigError, never anything else."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.runtime.config import (
    ClusterConfig,
    ConfigError,
    bounds,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FILE_FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _multi_site() -> dict[str, Any]:
    """A valid three-site config with credentials and TLS lists, every field spelled out."""
    raw = yaml.safe_load((ROOT / "examples" / "three-cities.yaml").read_text())
    raw["auth"] = {"operators": [{"name": "noc", "token_sha256": "a" * 64}]}
    raw["tenants"] = [{"name": "t1", "token_sha256": "b" * 64, "jurisdictions": ["CA-QC"], "priority": "high",
                       "requests_per_minute": 60, "share_prefix_cache_with": ["t2"]},
                      {"name": "t2", "share_prefix_cache_with": ["t1"], "log_prompts": True}]
    raw["sites"][0]["decode"]["tenants"] = ["t2"]
    raw["tls"] = {"revoked_serials": ["0a:1b"], "server_names": ["router.example"]}
    return parse_config(raw).to_dict()


BASES = [load_config(None).to_dict(), _multi_site()]


def _nested(depth: int) -> list:
    """A list nested ``depth`` deep, built without recursion."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _recursive_list() -> list:
    """A list that contains itself (YAML anchors make these: ``a: &x [*x]``)."""
    value: list = [1]
    value.append(value)
    return value


huge_ints = st.tuples(st.sampled_from([1, -1]), st.sampled_from([16, 30, 31, 40, 63, 64, 1_400, 14_300, 20_000]),
                      st.integers(-1, 1)).map(lambda t: t[0] * (2 ** t[1] + t[2]))
"""Around 2**N: past the bounds, int64, float range and Python's int-to-str digit limit."""
WORDS = ["nan", ".nan", "inf", "-.inf", "1e9", "auto", "tcp", "nixl", "local", "aead", "integrity", "cpu",
         "cuda:0", "float32", "cost_model", "a", "b", "toronto", "montreal", "", " ", "\x00", "127.0.0.1",
         "0.0.0.0", "x" * 5000]
hashable = st.one_of(st.none(), st.booleans(), st.integers(), huge_ints,
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(WORDS))
numbers = st.one_of(st.integers(), huge_ints, st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 1e308, 1e-308]))
values = st.one_of(
    numbers,
    st.recursive(hashable, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hashable, inner, max_size=4),
                 max_leaves=12),
    st.integers(1, 20_000).map(_nested),
    st.builds(_recursive_list),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """The path of every node under ``node`` (dict keys and list indexes), the root
    excluded, down to depth 6 (the config's own depth; the fuzz values nest deeper)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        out.append((*prefix, key))
        if len(prefix) < 5:
            out.extend(_paths(child, (*prefix, key)))
    return out


def _node(doc: Any, path: tuple) -> Any:
    """The node at ``path`` in ``doc``."""
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated_configs(draw) -> Any:
    """A valid config with 1-4 random mutations: a node replaced, a key deleted, an unknown key added."""
    doc = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        paths = _paths(doc)
        if kind == "add" or not paths:
            dicts = [p for p in [(), *paths] if isinstance(_node(doc, p), dict)]
            _node(doc, draw(st.sampled_from(dicts)))[draw(hashable)] = draw(values)
            continue
        leaves = [p for p in paths if not isinstance(_node(doc, p), (dict, list))]
        path = draw(st.sampled_from(leaves if leaves and draw(st.booleans()) else paths))
        parent = _node(doc, path[:-1])
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(values)
    return doc


def _load(fn, arg) -> None:
    """Runs the loader; a ConfigError is a fine answer, any other exception fails
    the test, and a config it accepts has every number finite and within its bound."""
    try:
        cfg = fn(arg)
    except ConfigError as exc:
        assert str(exc)
        return
    assert isinstance(cfg, ClusterConfig)
    _check_numbers(cfg)


def _check_numbers(section: Any) -> None:
    """Every numeric field of ``section`` and the sections under it is finite, >= 0 and within its declared bound."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        children = value if isinstance(value, list) else [value]
        for child in children:
            if dataclasses.is_dataclass(child):
                _check_numbers(child)
        bound = bounds(type(section), f.name).get("maximum")
        if bound is not None and value is not None:
            assert not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= bound, (f.name, value)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "cluster.yaml"


@FUZZ
@given(doc=mutated_configs())
def test_mutated_config_loads_or_raises_config_error(doc):
    _load(parse_config, doc)


@FILE_FUZZ
@given(doc=mutated_configs())
def test_mutated_config_file_loads_or_raises_config_error(doc, config_file):
    try:
        text = yaml.safe_dump(doc)
    except (RecursionError, ValueError):  # the test's own dumper: too deep, or an int too long to print
        return
    config_file.write_text(text)
    _load(load_config, config_file)


FRAGMENTS = ["router:", "sites:", "links:", "kv:", "cache:", "workers:", "tls:", "auth:", "\n", "  ", "    ",
             "- ", "port: ", "streams: ", "rtt_ms: ", "name: a", "name: b", "between: [a, b]", "decode: ",
             "{replicas: 1}", "[", "]", "{", "}", ",", ": ", "&x ", "*x", "&y ", "*y", "? ", "<<: ", "''", "x",
             "!!int ", "!!float ", "!!binary ", "!!set ", "!!str ", "!!bool ", "!!timestamp ", "!!null ",
             "!!omap ", "!!pairs ", "!!map ", "!!seq ", "!!merge ", "!!python/object:os.system ", ".nan", ".inf",
             "-.inf", "1" * 5000, "-" + "9" * 5000, "0x" + "f" * 5000, "1:30", "2020-13-45", "~", "null", "true",
             "0o17", "1e400", "1.0e400", "'x'", '"\\x00"', "|\n  text", "#", "---\n", "...\n", "%YAML 1.1\n", "\t"]
"""Pieces of YAML (tags, anchors, flow and block syntax, huge numbers) that random joins make plausible files of."""


@FUZZ
@given(text=st.one_of(st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
                      st.text(alphabet="[]{}:-,&*!|>'\"#%@`?~ \n\t0123456789.eE+_abnrxy", max_size=300),
                      st.text(max_size=300)))
def test_random_text_loads_or_raises_config_error(text, config_file):
    config_file.write_text(text, encoding="utf-8", errors="surrogatepass")
    _load(load_config, config_file)


@FUZZ
@given(data=st.binary(max_size=500))
def test_random_bytes_load_or_raise_config_error(data, config_file):
    config_file.write_bytes(data)
    _load(load_config, config_file)
