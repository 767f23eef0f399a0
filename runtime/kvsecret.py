"""The cluster's secrets as a process receives them: the KV secret (KV
connections' handshake key, and the key of tenants' prefix-cache salts) and
the PEM material a launcher hands the processes it starts. Read in process
entry points only; library code gets the values."""

from __future__ import annotations

import os
from pathlib import Path

MIN_SECRET_BYTES = 32
"""A KV secret shorter than this is refused."""


def read_secret(secret_file: str | None, from_launcher: str) -> bytes:
    """The KV deployment secret: the config's secret_file, else the launcher's
    per-run secret. SystemExit when there is none, or it is shorter than
    32 bytes: a worker never runs with KV connections open to anyone."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise SystemExit(f"kv.secret_file {secret_file}: cannot read ({exc.strerror})") from None
        where = f"kv.secret_file {secret_file}"
    else:
        secret, where = from_launcher.encode(), "the launcher's KVRELAY_KV_SECRET"
    if len(secret) < MIN_SECRET_BYTES:
        raise SystemExit(f"{where}: a KV secret of at least {MIN_SECRET_BYTES} random bytes is required, "
                         f"got {len(secret)} (make one: head -c 32 /dev/urandom | xxd -p -c 64)")
    return secret


TLS_ENV = {"ca": "KVRELAY_TLS_CA", "cert": "KVRELAY_TLS_CERT", "key": "KVRELAY_TLS_KEY"}
"""Environment variables through which a launcher hands a process its PEM material."""


TLS_DIR_ENV = "KVRELAY_TLS_DIR"
"""Environment variable naming the folder where a launcher keeps a process's PEM material
(``ca.pem``, ``cert.pem``, ``key.pem``), renewing it there while the process runs."""


def pem_from_env() -> dict[str, bytes]:
    """The PEM material the launcher handed over (read in process entry points only): from
    its folder for this process (:data:`TLS_DIR_ENV`), else from the environment."""
    folder = tls_dir_from_env()
    if folder is not None:
        return {k: _read_pem(folder / f"{k}.pem") for k in TLS_ENV}
    return {k: os.environ[v].encode() for k, v in TLS_ENV.items() if os.environ.get(v)}


def tls_dir_from_env() -> Path | None:
    """The launcher's folder of this process's material (process entry points only)."""
    folder = os.environ.get(TLS_DIR_ENV)
    return Path(folder) if folder else None


def _read_pem(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SystemExit(f"{TLS_DIR_ENV}: cannot read {path}: {exc.strerror}") from None
