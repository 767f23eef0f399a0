"""What ``kvrelay bench fuzz`` (and the suite's bounded run) throws at a
running cluster, one target per surface: the OpenAI HTTP API, the public
gRPC API, a decode worker's KV port, the config loader. Each target makes
one case from a seeded ``random.Random`` and sends it; a case fails when the
answer is a server error (HTTP 5xx, gRPC INTERNAL / UNKNOWN / DATA_LOSS),
not the API's error shape, no answer at all, or (config) any exception but
ConfigError. Generators, not hypothesis: a timed run must draw cases for as
long as it is given (the suite adds hypothesis and schemathesis on top)."""

from __future__ import annotations

import http.client
import json
import math
import random
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import yaml
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from kvrelay.kvtransfer.handshake import SenderHello, client_handshake
from kvrelay.kvtransfer.wire import PROTOCOL_VERSION, ProtocolError, frame_bytes
from kvrelay.runtime.config import ConfigError, load_config, parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import jobs_pb2 as jpb
from kvrelay.v1 import kv_wire_pb2 as kpb

if TYPE_CHECKING:
    from google._upb._message import FieldDescriptor as UpbFieldDescriptor

SERVER_ERRORS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
"""gRPC's 5xx: a bug, whatever the input."""

EDGE_INTS = (0, 1, -1, 2, 7, 64, 255, 256, 2**31 - 1, -2**31, 2**32, 2**53, 2**63 - 1, -2**63, 10**30, 10**4000)
"""Integers at the edges (10**4000: under Python's 4300-digit limit; longer ones come as text, pathological())."""
EDGE_FLOATS = (0.0, -0.0, 0.5, 1.0, 2.0, 100.0, 101.0, 1e-300, 1e300, math.inf, -math.inf, math.nan)
EDGE_TEXT = ("", " ", "hi", "\x00", "\ud800", "\udfff", "é", "東京", "🙂", "<|im_end|>", "a" * 300, "\n" * 50)


@dataclass(slots=True)
class Outcome:
    """One case's result: ``failure`` names what went wrong (None: the service behaved)."""

    kind: str
    failure: str | None = None


def _text(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(EDGE_TEXT)
    return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF),
                                   rng.randrange(0x1F300, 0x1F6FF))))
                   for _ in range(rng.randrange(0, 40)))


def random_json(rng: random.Random, depth: int = 0):
    """A JSON value: scalars of every kind (edge values often), lists and objects a few levels deep."""
    pick = rng.randrange(9 if depth < 4 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(EDGE_INTS) if rng.random() < 0.5 else rng.randrange(-1000, 100000)
    if pick == 3:
        return rng.choice(EDGE_FLOATS[:-3]) if rng.random() < 0.5 else rng.uniform(-10, 10)
    if pick in (4, 5):
        return _text(rng)
    if pick in (6, 7):
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {_text(rng): random_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos", "kvrelay", "tools",
               "response_format", "logit_bias", "user", "frobnicate")


def valid_chat(rng: random.Random, model: str) -> dict:
    body = {"model": model, "messages": [{"role": rng.choice(("user", "system", "assistant", "developer")),
                                          "content": _text(rng) or "hi"} for _ in range(rng.randrange(1, 4))],
            "max_tokens": rng.randrange(1, 8)}
    if rng.random() < 0.3:
        body |= {"logprobs": True, "top_logprobs": rng.randrange(0, 21)}
    if rng.random() < 0.3:
        body |= {"stream": True, "stream_options": {"include_usage": rng.random() < 0.5}}
    if rng.random() < 0.3:
        body |= {"temperature": rng.uniform(0, 2), "top_p": rng.uniform(0.1, 1), "seed": rng.randrange(1 << 32)}
    return body


def valid_completion(rng: random.Random, model: str) -> dict:
    prompt = _text(rng) or "hi" if rng.random() < 0.7 else [rng.randrange(0, 49152) for _ in range(rng.randrange(1, 9))]
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randrange(1, 8)}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randrange(0, 6)
    return body


def mutate(rng: random.Random, value, depth: int = 0):
    """``value`` with one random change somewhere inside: a key dropped, added or retyped, an item swapped."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        op = rng.randrange(4)
        out = dict(value)
        if op == 0:
            del out[key]
        elif op == 1:
            out[rng.choice(CHAT_FIELDS + (_text(rng),))] = random_json(rng)
        elif op == 2:
            out[key] = random_json(rng)
        else:
            out[key] = mutate(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        items = list(value)
        i = rng.randrange(len(items))
        items[i] = mutate(rng, items[i], depth + 1) if rng.random() < 0.5 else random_json(rng)
        return items
    return random_json(rng)


def pathological(rng: random.Random, base: dict) -> bytes:
    """Bodies that break naive parsers: deep nesting, huge integers, lone surrogates, NaN, huge strings."""
    text = json.dumps(base)
    pick = rng.randrange(7)
    if pick == 0:
        n = rng.choice((1000, 10_000, 100_000))
        return b"[" * n + b"]" * n
    if pick == 1:
        return text.replace('"max_tokens": ', '"max_tokens": ' + "9" * rng.choice((20, 5000, 100_000)) + "0*", 1) \
            .replace("0*", "").encode()
    if pick == 2:
        return text.replace('"hi"', '"\\ud800\\udbff"').replace('"model"', '"\\udc00model"', 1).encode()
    if pick == 3:
        return text.replace("}", ', "temperature": NaN, "top_p": Infinity}', 1).encode()
    if pick == 4:
        return json.dumps(base | {"messages": [{"role": "user", "content": "x" * rng.choice((10**5, 2 * 10**6))}]}
                          ).encode()
    if pick == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 2000)))
    return text.encode()[:rng.randrange(0, max(1, len(text)))]


class HttpTarget:
    """POSTs to the OpenAI API over TLS with the tenant's token."""

    name = "http"

    def __init__(self, address: str, ca_file: str, token: str, model: str) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.ctx = ssl.create_default_context(cafile=ca_file)
        self.token, self.model = token, model

    def body(self, rng: random.Random) -> tuple[str, bytes, str]:
        chat = rng.random() < 0.6
        path = "/v1/chat/completions" if chat else "/v1/completions"
        base = valid_chat(rng, self.model) if chat else valid_completion(rng, self.model)
        pick = rng.randrange(10)
        if pick < 4:
            return path, json.dumps(mutate(rng, base), allow_nan=True).encode(), "mutated"
        if pick < 6:
            return path, pathological(rng, base), "pathological"
        if pick < 8:
            return path, json.dumps(random_json(rng)).encode(), "random json"
        return path, json.dumps(base).encode(), "valid"

    def post(self, path: str, body: bytes, auth: bool = True) -> tuple[int, str, bytes]:
        """One POST on a connection of its own: status, content type, body."""
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=120)
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type", ""), resp.read()
        finally:
            conn.close()

    def one(self, rng: random.Random) -> Outcome:
        path, body, kind = self.body(rng)
        try:
            status, ctype, data = self.post(path, body, auth=rng.random() < 0.95)
        except (OSError, http.client.HTTPException) as exc:
            return Outcome(kind, f"no answer to a {kind} body of {len(body)} bytes: {exc!r}")
        return Outcome(kind, http_failure(status, ctype, data))


def http_failure(status: int, content_type: str, data: bytes) -> str | None:
    """What is wrong with an answer (None: nothing): a 5xx, or an error not in OpenAI's shape."""
    if status >= 500:
        return f"HTTP {status}: {data[:300]!r}"
    if status >= 400:
        try:
            err = json.loads(data)["error"]
            if not isinstance(err.get("message"), str) or not err["message"]:
                return f"HTTP {status} without an error message: {data[:200]!r}"
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"HTTP {status} not in OpenAI's error shape: {data[:200]!r}"
    elif "text/event-stream" in content_type and not data.rstrip().endswith(b"data: [DONE]"):
        return f"a stream that does not end with [DONE]: {data[-200:]!r}"
    return None


M = TypeVar("M", bound=Message)


def random_message(rng: random.Random, cls: type[M], depth: int = 0) -> M:
    """A message of ``cls`` with random values in random fields (every scalar kind, nested messages)."""
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                if f.message_type is None:  # a message field names its type
                    raise TypeError(f"message field {f.full_name} has no message type")
                sub = GetMessageClass(f.message_type)  # type: ignore[arg-type]  # stubs omit upb's Descriptor
                if f.is_repeated:
                    for _ in range(rng.randrange(0, 4)):
                        getattr(msg, f.name).add().CopyFrom(random_message(rng, sub, depth + 1))
                else:
                    getattr(msg, f.name).CopyFrom(random_message(rng, sub, depth + 1))
            continue
        values = [_scalar(rng, f) for _ in range(rng.randrange(0, 5) if f.is_repeated
                                                  else 1)]
        try:
            if f.is_repeated:
                getattr(msg, f.name).extend(values)
            else:
                setattr(msg, f.name, values[0])
        except (ValueError, TypeError):
            continue  # out of the field's range: not sendable, so not a case
    return msg


def _scalar(rng: random.Random, f: FieldDescriptor | UpbFieldDescriptor):
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return _text(rng).encode("utf-8", "replace").decode("utf-8", "replace")
    if t == FieldDescriptor.TYPE_BYTES:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice(EDGE_FLOATS) if rng.random() < 0.5 else rng.uniform(-5, 5)
    if t == FieldDescriptor.TYPE_ENUM:
        if f.enum_type is None:  # an enum field names its type
            raise TypeError(f"enum field {f.full_name} has no enum type")
        return rng.choice([v.number for v in f.enum_type.values] + [99])
    unsigned = t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                     FieldDescriptor.TYPE_FIXED64)
    bits = 64 if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
                       FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64) else 32
    lo, hi = (0, 2**bits - 1) if unsigned else (-2**(bits - 1), 2**(bits - 1) - 1)
    pick = rng.choice(EDGE_INTS[:10]) if rng.random() < 0.6 else rng.randrange(lo, hi + 1)
    return min(hi, max(lo, pick))


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """``data`` with bytes flipped, cut, inserted or repeated."""
    b = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(4)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[i:i + rng.randrange(1, 8)]
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        else:
            b[i:i] = b[max(0, i - 8):i]
    return bytes(b)


GRPC_METHODS = {
    "/kvrelay.v1.Inference/Generate": (ipb.GenerateRequest, True),
    "/kvrelay.v1.Inference/ListModels": (ipb.ListModelsRequest, False),
    "/kvrelay.v1.Inference/Health": (ipb.HealthRequest, False),
    "/kvrelay.v1.Jobs/GetJob": (jpb.GetJobRequest, False),
    "/kvrelay.v1.Jobs/ListJobs": (jpb.ListJobsRequest, False),
    "/kvrelay.v1.Jobs/CancelJob": (jpb.CancelJobRequest, False),
    "/kvrelay.v1.Jobs/JobResults": (jpb.JobResultsRequest, True),
    "/kvrelay.v1.Jobs/SubmitJob": (jpb.SubmitJobRequest, False),
}
"""The public gRPC methods, their request class, and whether they stream answers."""


class GrpcTarget:
    """Random, mutated and random-valued messages to every public gRPC method (raw bytes on the wire)."""

    name = "grpc"

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self.channel, self.auth = channel, (("authorization", f"Bearer {token}"),)

    def payload(self, rng: random.Random, cls: type[Message]) -> tuple[bytes, str]:
        pick = rng.randrange(4)
        if pick == 0:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))), "random bytes"
        msg = random_message(rng, cls)
        if isinstance(msg, ipb.GenerateRequest) and rng.random() < 0.7:
            msg.max_tokens = rng.randrange(0, 8)  # keep most generations short
        data = msg.SerializeToString()
        return (mutate_bytes(rng, data), "mutated message") if pick == 1 else (data, "random message")

    def one(self, rng: random.Random) -> Outcome:
        method = rng.choice(list(GRPC_METHODS))
        cls, streams = GRPC_METHODS[method]
        data, kind = self.payload(rng, cls)
        ident = (lambda b: b)  # noqa: E731 - bytes travel as they are
        call = (self.channel.unary_stream if streams else self.channel.unary_unary)(
            method, request_serializer=ident, response_deserializer=ident)
        try:
            out = call(data, timeout=120, metadata=self.auth if rng.random() < 0.95 else ())
            if streams:
                for _ in out:
                    pass
        except grpc.RpcError as exc:
            if exc.code() in SERVER_ERRORS or exc.code() is grpc.StatusCode.UNAVAILABLE:
                return Outcome(kind, f"{method}: {exc.code().name}: {exc.details()}")
        return Outcome(kind)


class KVTarget:
    """A decode worker's KV port: bytes before the handshake, and sealed
    records with random contents after a real one (a peer with valid credentials)."""

    name = "kv"

    def __init__(self, endpoint: str, hello: SenderHello) -> None:
        host, _, port = endpoint.rpartition(":")
        self.address, self.hello = (host, int(port)), hello

    def _before(self, rng: random.Random, sock: socket.socket) -> str:
        pick = rng.randrange(5)
        hello = kpb.KVHello(protocol_version=PROTOCOL_VERSION, layout_hash=self.hello.layout_hash,
                            nonce=bytes(32), key_share=bytes(32))
        real = frame_bytes(kpb.KVFrame(hello=hello).SerializeToString())
        if pick == 0:
            sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000))))
            return "random bytes"
        if pick == 1:
            sock.sendall(struct.pack("<I", rng.choice((0, 5000, 2**20, 2**31, 2**32 - 1))) + b"\x00" * 64)
            return "oversized frame"
        if pick == 2:
            sock.sendall(real[:rng.randrange(1, len(real))])
            return "truncated hello"
        if pick == 3:
            sock.sendall(mutate_bytes(rng, real) * rng.randrange(1, 3))
            return "mutated hello"
        sock.sendall(frame_bytes(random_message(rng, kpb.KVFrame).SerializeToString()))
        return "random frame"

    def _after(self, rng: random.Random, sock: socket.socket) -> str:
        session = client_handshake(sock, self.hello)
        pick = rng.randrange(3)
        if pick == 0:
            sock.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000))))
            return "random bytes after the handshake"
        records = []
        for _ in range(rng.randrange(1, 4)):
            claim = rng.choice((0, 0, 16, 4096, 1 << 20))  # payload bytes the prefix announces
            _, head = session.writer.seal(random_message(rng, kpb.KVFrame), claim)
            records.append(head + bytes(rng.randrange(256) for _ in range(min(claim, rng.randrange(0, 64)))))
        if pick == 1:
            rng.shuffle(records)
            records += records[:1]
            kind = "reordered and replayed records"
        else:
            kind = "sealed records with random contents"
        for r in records:
            sock.sendall(r)
        return kind

    def one(self, rng: random.Random) -> Outcome:
        after = rng.random() < 0.4
        with socket.create_connection(self.address, timeout=30) as sock:
            try:
                kind = self._after(rng, sock) if after else self._before(rng, sock)
            except ProtocolError as exc:
                return Outcome("handshake", f"the handshake of a valid peer failed: {exc}")
            except OSError:
                return Outcome("closed early")  # the receiver refused before we finished sending: fine
            try:
                sock.shutdown(socket.SHUT_WR)  # whatever the receiver still waits for will not come
            except OSError:
                return Outcome("closed early")
            sock.settimeout(30)
            try:
                while sock.recv(65536):
                    pass
            except TimeoutError:
                return Outcome(kind, f"{kind}: the receiver kept the connection open 30 s after our end closed")
            except OSError:
                pass
        return Outcome(kind)


class ConfigTarget:
    """Mutated valid configs and random YAML into the loader: success or ConfigError, nothing else."""

    name = "config"

    def __init__(self, base: dict, file: Path) -> None:
        self.base, self.file = base, file

    def one(self, rng: random.Random) -> Outcome:
        pick = rng.randrange(3)
        try:
            if pick == 0:
                parse_config(mutate(rng, mutate(rng, self.base)))
                return Outcome("mutated config")
            text = yaml.safe_dump(mutate(rng, self.base)) if pick == 1 else _text(rng) + ": [" * rng.randrange(3)
            self.file.write_bytes(mutate_bytes(rng, text.encode("utf-8", "surrogatepass")))
            load_config(self.file)
            return Outcome("mutated yaml file")
        except ConfigError:
            return Outcome("refused")
        except Exception as exc:  # the point: any other exception is the finding
            return Outcome("config", f"{type(exc).__name__}: {exc}"[:300])

