"""`kvrelay job submit`'s job file, checked before anything is sent: within
the router's limits (the same messages), every bad line named by its number
and what is wrong with it, whatever JSON makes Python raise (deep nesting, a
100,000-digit integer, a lone surrogate), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.cli.jobs import JobFileError, parse_job_file
from kvrelay.cli.main import main
from kvrelay.router.core.job_limits import MAX_JOB_REQUESTS, MAX_REQUEST_BYTES, job_limit_error
from kvrelay.v1 import inference_pb2 as ipb

GOOD = '{"prompt": "ok", "max_tokens": 4}'


def _file(tmp_path: Path, *lines: str | bytes) -> Path:
    f = tmp_path / "job.jsonl"
    f.write_bytes(b"\n".join(x.encode() if isinstance(x, str) else x for x in lines) + b"\n")
    return f


@pytest.mark.parametrize("line,reason", [
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be >= 1, got 0"),
    ('{"prompt": "x", "colour": "red"}', "unknown field 'colour'"),
    ('{"prompt": "x", "sampling": {"temprature": 1}}', 'no field named "temprature"'),
    ('{"prompt": "x", "prompt": "y"}', "field 'prompt' appears twice"),
    ('{"prompt": "x", "seed": 1, "sampling": {"seed": 2}}', "'seed' is given both"),
    ('{"prompt": "x", "seed": 1, "sampling": [1]}', "sampling must be an object, got an array"),
    ('{"prompt": 5}', "prompt"),
    ('{"prompt": "x", "token_ids": [1]}', 'multiple "input" oneof'),
    ('["a list"]', "expected a JSON object, got an array"),
    ("null", "expected a JSON object, got null"),
    ('{"prompt": "x"', "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # RecursionError inside json
    ('{"prompt": "x", "max_tokens": ' + "9" * 100_000 + "}", "integer with 100000 digits; at most 20"),  # ValueError
    ('{"prompt": "x", "max_tokens": "' + "9" * 100_000 + '"}', "max_tokens"),  # a quoted one: protobuf's message
    ('{"prompt": "\\ud800"}', "surrogate"),  # a lone surrogate cannot become a protobuf string
    ('{"\\udfff": 1}', "unknown field '\\udfff'"),
    ('{"prompt": "x", "temperature": NaN}', "NaN is not a number"),
    ('{"prompt": "x", "temperature": 1e999}', "out of range"),
    ('{"prompt": "x", "temperature": "Infinity"}', "sampling.temperature must be a finite number"),
    (b'{"prompt": "\xff"}', "not UTF-8"),
])
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path, line, reason):
    f = _file(tmp_path, GOOD, "", line, GOOD)
    with pytest.raises(JobFileError) as err:
        parse_job_file(f)
    msg = str(err.value)
    assert msg.startswith(f"{f}:3: ") and reason in msg, msg
    assert len(msg) < 600  # a reason quoting a huge line is cut short


def test_good_lines_keep_their_line_numbers_and_shortcuts(tmp_path):
    f = _file(tmp_path, GOOD, "", '{"messages": [{"role": "user", "content": "a\u2028b"}], "temperature": 0.5}',
              '{"token_ids": [1, 2], "seed": 7, "ignore_eos": true}', '{"prompt": "default max_tokens"}')
    job = parse_job_file(f)
    assert job.lines == [1, 3, 4, 5] and job.name == "job.jsonl"
    first, chat, ids, plain = job.requests
    assert first.max_tokens == 4 and chat.messages.messages[0].content == "a\u2028b"  # U+2028 ends no line
    assert chat.sampling.temperature == 0.5 and list(ids.token_ids.ids) == [1, 2] and ids.sampling.seed == 7
    assert not plain.HasField("max_tokens")  # absent: the router's default, not 0
    assert job.where("requests[2]: token ids out of range") == f"{f}:4: requests[2]: token ids out of range"
    assert job.where("job has 3 requests") == f"{f}: job has 3 requests"


def test_too_many_requests_is_refused_with_the_routers_message(tmp_path):
    f = tmp_path / "many.jsonl"
    f.write_text("{}\n" * (MAX_JOB_REQUESTS + 1))
    with pytest.raises(JobFileError, match=f"{f}: job has 100001 requests; at most 100000$"):
        parse_job_file(f)
    assert job_limit_error("", [ipb.GenerateRequest()] * (MAX_JOB_REQUESTS + 1)) == \
        "job has 100001 requests; at most 100000"


def test_a_file_or_line_over_its_byte_limit_is_refused(tmp_path):
    f = _file(tmp_path, GOOD, GOOD, GOOD)
    with pytest.raises(JobFileError, match=r"job file is \d+ bytes; at most 60 \(0 MiB\)"):
        parse_job_file(f, max_bytes=60)
    long = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES})
    with pytest.raises(JobFileError, match=rf":2: line is {len(long)} bytes; at most {MAX_REQUEST_BYTES} \(1 MiB\)"):
        parse_job_file(_file(tmp_path, GOOD, long))
    # a line under the cap whose request is over it (negative ids take 10 bytes each): the router's message
    ids = json.dumps({"token_ids": [-1] * 200_000})
    with pytest.raises(JobFileError, match=rf":2: requests\[1\]: \d+ bytes; at most {MAX_REQUEST_BYTES}"):
        parse_job_file(_file(tmp_path, GOOD, ids))


def test_the_cli_refuses_a_bad_file_before_connecting(tmp_path, capsys):
    f = _file(tmp_path, GOOD, '{"prompt": "x", "max_tokens": 0}')
    assert main(["job", "submit", str(f), "--router", "127.0.0.1:1"]) == 2  # nothing listens there
    assert capsys.readouterr().err.strip() == f"kvrelay: {f}:2: max_tokens must be >= 1, got 0"
    assert main(["job", "submit", str(tmp_path / "missing.jsonl"), "--router", "127.0.0.1:1"]) == 2
    assert "No such file" in capsys.readouterr().err
