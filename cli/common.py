"""Helpers the `kvrelay` command modules share."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from pathlib import Path

import grpc
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc

from benchmarks.replay import (
    ReplayConfig,
    build_report,
    check_lengths,
    replay,
    trace_slice,
    write_report,
)
from benchmarks.traces import build_prompts
from engine.default_model import prepare_default_model
from launch.credentials import CLIENT_TOKEN, LOCAL_PKI
from runtime.pki import CA_CERT, PKIError, check_pair, read_pem
from runtime.rpc import Dialer
from runtime.tls import TLSMaterial


def default_cache_dir() -> Path:
    """``$KVRELAY_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvrelay``, else ``~/.cache/kvrelay``."""
    if os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(os.environ["KVRELAY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvrelay"


def resolve_model(arg: str | None, cache_dir: Path) -> Path:

    return Path(arg) if arg else prepare_default_model(cache_dir)


VOCAB_RANGE = (100, 10000)
"""Token ids of replayed prompts: inside any real vocabulary, clear of special tokens."""


def add_connect_flags(p: argparse.ArgumentParser, router_default: str | None = "127.0.0.1:50051") -> None:
    """How a command reaches the router: address, CA, optional certificate."""
    p.add_argument("--router", default=router_default,
                   help="router address (the public port; with --cert, its internal port)"
                        + (" (default: %(default)s)" if router_default else ""))
    p.add_argument("--ca", type=Path, help="CA bundle the router's certificate must come from "
                                           "(default: the local one kvrelay serve made, <cache-dir>/pki/ca.pem)")
    p.add_argument("--cert", type=Path, help="present this client or operator certificate instead of a token "
                                             "(kvrelay pki issue; needs --key and the router's internal port)")
    p.add_argument("--key", type=Path, help="the key of --cert")
    p.add_argument("--plaintext", action="store_true",
                   help="no TLS: only for a router started with tls.enabled: false (loopback)")


def client_token(args: argparse.Namespace) -> str | None:
    """The tenant token: $KVRELAY_API_KEY, else the local default's (written by kvrelay serve)."""
    token = os.environ.get("KVRELAY_API_KEY", "")
    if not token and (args.cache_dir / CLIENT_TOKEN).exists():
        token = (args.cache_dir / CLIENT_TOKEN).read_text().strip()
    return token or None


def dialer(args: argparse.Namespace, token: str | None) -> Dialer:
    """Channels as the flags say (:func:`add_connect_flags`), sending
    ``token`` unless a certificate is presented. PKIError (a ValueError)
    naming the file when the CA or certificate cannot be used."""
    if args.plaintext:
        if args.cert or args.ca:
            raise PKIError("--plaintext presents no certificate and verifies none: drop --cert/--ca, or --plaintext")
        return Dialer(None, token)
    ca = args.ca or args.cache_dir / LOCAL_PKI / CA_CERT
    hint = "" if args.ca else " (pass --ca with the cluster's CA bundle; `kvrelay serve` makes the local one)"
    try:
        ca_pem = read_pem(ca, "CA bundle")
    except PKIError as exc:
        raise PKIError(f"{exc}{hint}") from None
    if args.cert is None:
        return Dialer(TLSMaterial(ca_pem), token)
    if args.key is None:
        raise PKIError("--cert needs --key")
    cert, key = read_pem(args.cert, "certificate"), read_pem(args.key, "key")
    info = check_pair(cert, key, ca_pem, str(args.cert))
    return Dialer(TLSMaterial(ca_pem, cert, key, info.identity))


def operator_token(token_file: Path) -> str | None:
    """The operator token: $KVRELAY_OPERATOR_TOKEN, else ``token_file`` (kvrelay serve writes it)."""
    token = os.environ.get("KVRELAY_OPERATOR_TOKEN", "")
    if not token and token_file.exists():
        token = token_file.read_text().strip()
    return token or None


def client_dialer(args: argparse.Namespace) -> Dialer:
    """Channels as a tenant: its token, or its certificate."""
    return dialer(args, client_token(args))


TLS_HINTS = (("certificate verify failed", "the router's certificate is not from the CA given (--ca)"),
             ("certificate signature failure", "the router's certificate is not from the CA given (--ca)"),
             ("unable to get local issuer", "the router's certificate is not from the CA given (--ca)"),
             ("Hostname Verification", "the router's certificate is not valid for this address "
                                       "(tls.server_names adds names)"),
             ("WRONG_VERSION_NUMBER", "the router does not speak TLS (tls.enabled: false? then --plaintext)"),
             ("Socket closed", "the router closed the connection during the TLS handshake: it speaks TLS and "
                               "refused this client (plaintext client, or a certificate it does not accept: "
                               "expired, revoked or from another CA; with --cert use its internal port)"))


def grpc_error(exc) -> int:
    """Prints a failed call's status (with what a TLS failure means); returns 1."""
    details = exc.details() or ""
    connecting = "failed to connect" in details  # the channel never got through its handshake
    hint = next((h for pattern, h in TLS_HINTS if connecting and pattern in details), "")
    print(f"kvrelay: error: {exc.code().name}: {details}" + (f"\nkvrelay: {hint}" if hint else ""), file=sys.stderr)
    return 1


def table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())


def default_token_file() -> Path:
    """Where `kvrelay serve` writes its per-run operator token: beside the model cache."""
    return default_cache_dir() / "operator-token"


def write_secret(path: Path, value: str) -> None:
    """Writes ``value`` to ``path``, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    tmp.rename(path)


def replay_config(args: argparse.Namespace):
    """The replay settings given on the command line."""

    return ReplayConfig(speedup=args.speedup, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                        progress=not args.no_progress, warmup=getattr(args, "warmup", 0))


def replay_prompts(args: argparse.Namespace, reqs, address: str, client: Dialer) -> tuple[list, dict] | int:
    """The prompts to replay, their lengths checked against the model the
    router at ``address`` serves, and the report's metadata; an exit code
    (after saying why) when they cannot be replayed."""


    with client.sync(address) as ch:
        try:
            model = igrpc.InferenceStub(ch).ListModels(ipb.ListModelsRequest(), timeout=30).models[0]
        except grpc.RpcError as exc:
            return grpc_error(exc)
    scale = args.length_scale or 1.0
    out_scale = getattr(args, "output_scale", None)
    too_long = check_lengths(reqs, scale, model.context_window, out_scale)
    if too_long and args.length_scale is None:
        worst = max(r.input_tokens + r.output_tokens for r in reqs)
        print(f"kvrelay: {len(too_long)} of {len(reqs)} requests exceed {model.name}'s context window of "
              f"{model.context_window} tokens (longest {worst}); pass --length-scale, e.g. "
              f"--length-scale {0.95 * model.context_window / worst:.3g}", file=sys.stderr)
        return 2
    reason = ""
    if args.length_scale is not None:
        reason = f"--length-scale {scale:g} given" + (f", outputs {out_scale:g}" if out_scale is not None else "")
        if too_long:
            reason += f"; {len(too_long)} request(s) still exceed the context window and are sent anyway " \
                      "(they fail and are reported)"
    meta = {"trace": str(args.trace), "format": args.format or "auto", "limit": args.limit,
            "speedup": args.speedup, "length_scale": scale, "output_scale": out_scale, "scale_reason": reason,
            "seed": args.seed, "model": model.name, "context_window": model.context_window}
    return build_prompts(reqs, scale, VOCAB_RANGE, seed=args.seed, out_scale=out_scale), meta


def run_meta(reqs, address: str, cluster) -> dict:
    """The report's metadata about one run: where it ran, on what."""


    return {"router": address, "policy": cluster.cfg.router.policy if cluster is not None else "?",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wan_emulation": cluster is not None and cluster.cities is not None,
            "config": cluster.cfg.to_dict() if cluster is not None else None, "trace_slice": trace_slice(reqs)}


def run_replay(args: argparse.Namespace, reqs, address: str, cluster) -> int:
    """Replays ``reqs`` against the router at ``address``; writes and prints the report."""


    if cluster is not None:
        client, operator = cluster.client_dialer, cluster.operator_dialer
    else:
        client, operator = client_dialer(args), dialer(args, operator_token(default_token_file()))
    got = replay_prompts(args, reqs, address, client)
    if isinstance(got, int):
        return got
    prompts, meta = got
    rcfg = replay_config(args)
    meta |= run_meta(reqs, address, cluster)
    records, samples = asyncio.run(replay(address, prompts, rcfg, client, operator))
    report = build_report(records, samples, rcfg, meta)
    write_report(report, Path(args.out))
    print((Path(args.out) / "report.md").read_text())
    return 0 if report["summary"]["failed"] == 0 else 1
