"""A process's certificate, key and CA bundle followed from their files while it runs.

Where the material comes from files (an operator's ``tls.ca`` / ``tls.cert`` /
``tls.key``, a Kubernetes Secret the kubelet updates, or the folder a launcher
keeps each of its processes' renewed certificates in), a change to any of them
is read, checked (dates, the issuing CA among the bundle's, the key matching,
the same identity as before) and, when good, renews the process's
:class:`~runtime.tls.TLSMaterial`: the next handshake of each listener and
each channel made after it use the new material, while connections in flight
go on with theirs. Material that does not check out is logged and changes
nothing; a half-written renewal (the new key beside the old certificate) is
taken on a later look, once both files are in place."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from kvrelay.runtime.files import file_stamp, polls, write_private
from kvrelay.runtime.pki import PKIError, cert_info, load_cert, read_pem
from kvrelay.runtime.tls import Pems, TLSMaterial, check_pems

if TYPE_CHECKING:  # annotations only
    from kvrelay.runtime.config import TLSSection

log = logging.getLogger(__name__)

POLL_S = 2.0
"""How often the files are looked at."""
TLS_DIR_FILES = ("ca.pem", "cert.pem", "key.pem")
"""The files of a launcher's per-process folder (``KVRELAY_TLS_DIR``)."""


@dataclass(frozen=True, slots=True)
class MaterialFiles:
    """Where a process's material is read from."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def in_folder(cls, folder: Path) -> MaterialFiles:
        """A launcher's per-process folder (:data:`TLS_DIR_FILES`)."""
        return cls(*(folder / name for name in TLS_DIR_FILES))

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.ca, self.cert, self.key) if p is not None)

    def read(self) -> dict[str, bytes]:
        """The PEM each file holds (``ca``, ``cert``, ``key``); PKIError naming a file that cannot be read."""
        pem = {"ca": read_pem(self.ca, str(self.ca))}
        if self.cert is not None and self.key is not None:
            pem |= {"cert": read_pem(self.cert, str(self.cert)), "key": read_pem(self.key, str(self.key))}
        return pem

    def load(self) -> Pems:
        """The files' material, checked (:func:`~runtime.tls.check_pems`)."""
        pem = self.read()
        return check_pems(pem["ca"], pem.get("cert"), pem.get("key"), str(self.cert or self.ca), str(self.ca))


def write_material(folder: Path, ca: bytes, cert: bytes, key: bytes) -> None:
    """A process's material into its folder (:data:`TLS_DIR_FILES`, 0600), the certificate last: a
    process reading between two writes finds a pair that does not match, takes none of it and looks
    again (:func:`follow_material`)."""
    ca_file, cert_file, key_file = (folder / n for n in TLS_DIR_FILES)
    for path, pem in ((ca_file, ca), (key_file, key), (cert_file, cert)):
        write_private(path, pem)


def material_files(section: TLSSection, tls_dir: Path | None, launcher_pem: dict[str, bytes]) -> MaterialFiles | None:
    """The files a process follows: the launcher's folder for it (``KVRELAY_TLS_DIR``), else
    the config's ``tls.ca`` / ``tls.cert`` / ``tls.key``; None when TLS is off or the launcher
    handed the material over in the environment (nothing on disk to follow)."""
    if not section.enabled:
        return None
    if tls_dir is not None:
        return MaterialFiles.in_folder(tls_dir)
    if launcher_pem or section.ca is None:
        return None
    return MaterialFiles(Path(section.ca), Path(section.cert) if section.cert else None,
                         Path(section.key) if section.key else None)


Renewed = Callable[[Pems], None]
"""Told the new material after each renewal (what a process rebuilds from it: its HTTPS
context, its channels to workers)."""


def describe(pems: Pems) -> str:
    """``serial .. until ..`` of a certificate, for the logs."""
    if pems.cert_pem is None:
        return "no certificate"
    info = cert_info(load_cert(pems.cert_pem, "certificate"))
    return f"serial {info.serial_hex} valid until {info.not_after:%Y-%m-%d %H:%M:%S} UTC"


class Look(StrEnum):
    """What one look at the files found."""

    SAME = "same"
    RENEWED = "renewed"
    UNUSABLE = "unusable"


def renew_from(files: MaterialFiles, material: TLSMaterial, quiet: bool = False) -> Look:
    """One look: a :class:`Look`: the files' material renewed ``material``, was the same, or
    did not check out (logged unless ``quiet``)."""
    try:
        pems = files.load()
        if pems == material.pems:
            return Look.SAME
        material.renew(pems)
    except (PKIError, OSError) as exc:
        if not quiet:
            log.warning("TLS material in %s changed but cannot be used (%s); keeping %s",
                        files.cert or files.ca, exc, describe(material.pems))
        return Look.UNUSABLE
    log.info("TLS material renewed from %s: %s", files.cert or files.ca, describe(pems))
    return Look.RENEWED


async def follow_material(files: MaterialFiles | None, material: TLSMaterial | None, stop: asyncio.Event,
                          on_renew: Renewed | None = None, poll_s: float = POLL_S) -> None:
    """Until ``stop``: every ``poll_s``, the files' material into ``material`` when any file changed.
    Material that does not check out is looked at once more, quietly (a writer between its
    files), before it is logged as unusable."""
    if files is None or material is None:
        return
    seen = [file_stamp(p) for p in files.paths]
    retry = False
    async for _ in polls(stop, poll_s):
        now = [file_stamp(p) for p in files.paths]
        if (now == seen and not retry) or None in now:
            continue
        first, seen = now != seen, now
        look = renew_from(files, material, quiet=first)
        retry = look == Look.UNUSABLE and first
        if look == Look.RENEWED and on_renew is not None:
            on_renew(material.pems)


__all__ = ["POLL_S", "TLS_DIR_FILES", "Look", "MaterialFiles", "Renewed", "describe", "follow_material",
           "material_files", "renew_from", "write_material"]
