"""Fuzzing a real cluster, bounded for CI (``kvrelay bench fuzz --minutes N``
is the long run): the generated cases of benchmarks/fuzz_targets.py against
the HTTP API, the public gRPC API, a decode worker's KV port and the config
loader; schemathesis against the published ``/openapi.json``; hypothesis-made
raw bodies. No case may get a server error or an error outside the API's
shape, no process may die, and nothing may leak (KV blocks, file
descriptors, threads)."""

from __future__ import annotations

import copy
import json
import ssl
import urllib.request
from importlib.metadata import version

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
)

from kvrelay.benchmarks.fuzz import FUZZ_CLUSTER, format_fuzz, fuzz_cluster
from kvrelay.benchmarks.fuzz_targets import HttpTarget, http_failure
from kvrelay.router.frontends.openai_schema import openapi
from tests.integration.helpers import running_cluster

pytestmark = pytest.mark.model

FUZZ_SECONDS = 8
"""The bounded run's budget (cases round-robin over the four targets)."""
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fuzzed_cluster(plumbing_model):
    with running_cluster(copy.deepcopy(FUZZ_CLUSTER), plumbing_model, reconcile=False) as lc:
        yield lc


def test_generated_cases_find_no_server_error_crash_or_leak(fuzzed_cluster):
    report = fuzz_cluster(fuzzed_cluster, FUZZ_SECONDS, seed=7, model=MODEL)
    text = format_fuzz(report)
    print(text)
    assert all(t.cases >= 5 for t in report.targets.values()), text
    assert report.ok(), text


def _published(fuzzed_cluster) -> dict:
    ctx = ssl.create_default_context(cafile=str(fuzzed_cluster.ca_file))
    with urllib.request.urlopen(f"https://{fuzzed_cluster.http_address}/openapi.json", context=ctx, timeout=30) as r:
        return json.load(r)


SCHEMA = openapi(version("kvrelay"))
schema = schemathesis.openapi.from_dict(SCHEMA)


def test_the_router_publishes_the_schema_fuzzed_here(fuzzed_cluster):
    assert _published(fuzzed_cluster) == SCHEMA


@pytest.fixture(scope="module")
def http_session(fuzzed_cluster):
    """One keep-alive session for every schemathesis case (a TLS handshake per case would dominate)."""
    with requests.Session() as session:
        session.verify = str(fuzzed_cluster.ca_file)
        session.headers["Authorization"] = f"Bearer {fuzzed_cluster.client_token}"
        yield session


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_published_schema_holds_under_schemathesis(case, fuzzed_cluster, http_session):
    response = case.call(base_url=f"https://{fuzzed_cluster.http_address}", session=http_session,
                         verify=http_session.verify, timeout=120)
    case.validate_response(response, checks=[not_a_server_error, content_type_conformance, negative_data_rejection])
    if response.status_code >= 400:
        assert http_failure(response.status_code, response.headers.get("content-type", ""),
                            response.content) is None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                    max_leaves=20)
CHAT_KEYS = st.sampled_from(["model", "messages", "max_tokens", "temperature", "top_p", "stop", "stream", "logprobs",
                             "top_logprobs", "n", "seed", "kvrelay", "tools", "response_format"])
BODIES = st.one_of(
    st.binary(max_size=512),
    JSON.map(json.dumps).map(str.encode),
    st.dictionaries(CHAT_KEYS, JSON, max_size=6).map(
        lambda d: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | d
    ).map(json.dumps).map(str.encode),
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_raw_bodies_from_hypothesis_get_openai_shaped_answers(fuzzed_cluster, body, chat):
    target = HttpTarget(fuzzed_cluster.http_address, str(fuzzed_cluster.ca_file), fuzzed_cluster.client_token, MODEL)
    status, ctype, data = target.post("/v1/chat/completions" if chat else "/v1/completions", body)
    assert http_failure(status, ctype, data) is None, (body[:200], data[:300])
