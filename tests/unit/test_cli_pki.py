"""`kvrelay pki init | issue | show`, run in-process: the files they write,
what they print, and their exit codes (0 fine, 1 a certificate that is not
usable, 2 bad input or an unreadable file)."""

from __future__ import annotations

import datetime as dt
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from kvrelay.cli.main import main
from kvrelay.runtime.pki import (
    CA_CERT,
    CA_KEY,
    CertRole,
    check_pair,
    load_ca,
    load_cert,
    read_pem,
)

SITE = "montreal"


@pytest.fixture
def ca_dir(tmp_path: Path, capsys) -> Path:
    folder = tmp_path / "pki"
    assert main(["pki", "init", str(folder), "--days", "100"]) == 0
    out = capsys.readouterr().out
    assert str(folder / CA_CERT) in out and str(folder / CA_KEY) in out and "expires:" in out
    return folder


def issue_args(ca_dir: Path, out: Path, role: str = "decode", site: str = SITE, name: str = "w1") -> list[str]:
    return ["pki", "issue", "--role", role, "--site", site, "--name", name, "--out", str(out),
            "--ca-dir", str(ca_dir)]


def test_init_writes_a_private_ca(ca_dir: Path):
    assert stat.S_IMODE(ca_dir.stat().st_mode) == 0o700
    assert {stat.S_IMODE((ca_dir / n).stat().st_mode) for n in (CA_CERT, CA_KEY)} == {0o600}
    ca = load_ca(ca_dir / CA_CERT, ca_dir / CA_KEY)
    assert dt.timedelta(days=99) < ca.cert.not_valid_after_utc - dt.datetime.now(dt.UTC)


def test_init_twice_refuses(ca_dir: Path, capsys):
    key = (ca_dir / CA_KEY).read_bytes()
    assert main(["pki", "init", str(ca_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: error:") and "exists there already" in err
    assert (ca_dir / CA_KEY).read_bytes() == key


@pytest.mark.parametrize("role", [r.value for r in CertRole])
def test_issue_writes_a_usable_certificate(ca_dir: Path, tmp_path: Path, capsys, role: str):
    out = tmp_path / "certs"
    assert main(issue_args(ca_dir, out, role=role) + ["--days", "2"]) == 0
    printed = capsys.readouterr().out
    cert_path, key_path = out / f"{role}-{SITE}-w1.pem", out / f"{role}-{SITE}-w1.key"
    assert {stat.S_IMODE(p.stat().st_mode) for p in (cert_path, key_path)} == {0o600}
    assert (out / CA_CERT).read_bytes() == (ca_dir / CA_CERT).read_bytes()
    info = check_pair(cert_path.read_bytes(), key_path.read_bytes(), (out / CA_CERT).read_bytes(), "t")
    assert info.identity is not None and info.identity.uri == f"kvrelay://{SITE}/{role}/w1"
    assert info.identity.uri in printed and info.serial_hex in printed and str(cert_path) in printed
    assert info.not_after - info.not_before <= dt.timedelta(days=2, minutes=5)


def test_issue_with_ca_files_and_hosts(ca_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "certs"
    args = ["pki", "issue", "--role", "router", "--site", SITE, "--name", "main", "--out", str(out),
            "--ca", str(ca_dir / CA_CERT), "--ca-key", str(ca_dir / CA_KEY),
            "--host", "api.example.com", "--host", "10.1.2.3"]
    assert main(args) == 0
    assert "api.example.com, 10.1.2.3" in capsys.readouterr().out
    cert = load_cert(read_pem(out / f"router-{SITE}-main.pem", "t"), "t")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "api.example.com" in sans.get_values_for_type(x509.DNSName)


def test_issue_needs_the_ca(tmp_path: Path, capsys):
    args = ["pki", "issue", "--role", "decode", "--site", SITE, "--name", "1", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert "--ca-dir" in capsys.readouterr().err
    assert main(args + ["--ca", str(tmp_path / "ca.pem")]) == 2
    assert "--ca-key" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_issue_names_a_missing_ca_file(tmp_path: Path, capsys):
    assert main(issue_args(tmp_path / "nowhere", tmp_path / "o")) == 2
    assert f"{tmp_path / 'nowhere' / CA_CERT}: file not found" in capsys.readouterr().err


def test_issue_refuses_an_unknown_role(ca_dir: Path, tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(issue_args(ca_dir, tmp_path / "o", role="admin"))
    assert exc.value.code == 2
    assert "invalid choice: 'admin'" in capsys.readouterr().err


def test_issue_refuses_a_bad_site_name(ca_dir: Path, tmp_path: Path, capsys):
    assert main(issue_args(ca_dir, tmp_path / "o", site="Mont Real")) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: error:") and "site 'Mont Real' must be" in err
    assert not (tmp_path / "o").exists()


def test_show_a_valid_certificate(ca_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "certs"
    assert main(issue_args(ca_dir, out, role="prefill", name="7")) == 0
    capsys.readouterr()
    cert_path = out / f"prefill-{SITE}-7.pem"
    serial = format(load_cert(cert_path.read_bytes(), "t").serial_number, "x")
    assert main(["pki", "show", str(cert_path), "--ca", str(ca_dir / CA_CERT)]) == 0
    printed = capsys.readouterr().out
    assert f"kvrelay://{SITE}/prefill/7" in printed and f"serial:     {serial}" in printed
    assert "status:     valid" in printed and "issued by:" in printed and ": yes" in printed
    assert f"7.prefill.{SITE}.kvrelay" not in printed  # the identity's own names are not "other hosts"


def test_show_a_certificate_of_another_ca(ca_dir: Path, tmp_path: Path, capsys):
    assert main(["pki", "init", str(tmp_path / "other")]) == 0
    assert main(issue_args(tmp_path / "other", tmp_path / "o")) == 0
    capsys.readouterr()
    assert main(["pki", "show", str(tmp_path / "o" / f"decode-{SITE}-w1.pem"), "--ca", str(ca_dir / CA_CERT)]) == 1
    assert "not issued by the cluster CA" in capsys.readouterr().out


def test_show_an_expired_certificate(ca_dir: Path, tmp_path: Path, capsys):
    ca = load_ca(ca_dir / CA_CERT, ca_dir / CA_KEY)
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")]))
            .issuer_name(ca.cert.subject).public_key(ca.key.public_key()).serial_number(0xABC123)
            .not_valid_before(now - dt.timedelta(days=10)).not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"kvrelay://{SITE}/decode/old")]), critical=False)
            .sign(ca.key, hashes.SHA256()))
    path = tmp_path / "old.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert main(["pki", "show", str(path)]) == 1
    printed = capsys.readouterr().out
    assert "status:     EXPIRED since" in printed and "abc123" in printed and f"kvrelay://{SITE}/decode/old" in printed


def test_show_a_ca_certificate(ca_dir: Path, capsys):
    assert main(["pki", "show", str(ca_dir / CA_CERT)]) == 0
    printed = capsys.readouterr().out
    assert "identity:   none" in printed and "CA:         yes" in printed


def test_show_a_missing_file(tmp_path: Path, capsys):
    path = tmp_path / "missing.pem"
    assert main(["pki", "show", str(path)]) == 2
    assert f"kvrelay: error: certificate {path}: file not found" in capsys.readouterr().err


def test_show_a_file_that_is_not_a_certificate(ca_dir: Path, tmp_path: Path, capsys):
    garbage = tmp_path / "x.pem"
    garbage.write_text("hello\n")
    assert main(["pki", "show", str(garbage)]) == 2
    assert f"{garbage}: not a PEM file" in capsys.readouterr().err
    assert main(["pki", "show", str(ca_dir / CA_KEY)]) == 2
    assert f"{ca_dir / CA_KEY}: not a PEM certificate" in capsys.readouterr().err


def test_rotate_ca_in_three_steps_each_in_its_turn(ca_dir: Path, tmp_path: Path, capsys):
    old = load_ca(ca_dir / CA_CERT, ca_dir / CA_KEY)
    assert main(["pki", "rotate-ca", str(ca_dir), "--overlap-days", "3"]) == 0
    out = capsys.readouterr().out
    bundle = x509.load_pem_x509_certificates(read_pem(ca_dir / CA_CERT, "bundle"))
    assert bundle[0] == old.cert and len(bundle) == 2 and f"{bundle[1].serial_number:x}" in out
    assert f"kvrelay pki rotate-ca {ca_dir} --issue" in out
    assert load_ca(ca_dir / CA_CERT, ca_dir / CA_KEY).cert == old.cert  # step 1: the old CA still issues
    assert main(["pki", "rotate-ca", str(ca_dir), "--issue"]) == 2  # too soon for every process to trust it
    assert "give every process 15 s to trust it" in capsys.readouterr().err
    assert main(["pki", "rotate-ca", str(ca_dir), "--finish"]) == 2
    assert "no rotation whose new CA issues" in capsys.readouterr().err
    assert main(["pki", "rotate-ca", str(ca_dir)]) == 2
    assert "a rotation is in progress" in capsys.readouterr().err
    assert main(["pki", "rotate-ca", str(ca_dir), "--force"]) == 2
    assert "--force goes with --issue or --finish" in capsys.readouterr().err
    assert main(["pki", "rotate-ca", str(ca_dir), "--issue", "--force", "--overlap-days", "9"]) == 2
    assert "--overlap-days and --days go with the first step" in capsys.readouterr().err  # not ignored
    assert main(["pki", "rotate-ca", str(ca_dir), "--issue", "--force"]) == 0
    assert "issues now" in capsys.readouterr().out
    new = load_ca(ca_dir / CA_CERT, ca_dir / CA_KEY)
    assert new.cert == bundle[1] and not (ca_dir / "ca-next.key").exists()
    assert main(issue_args(ca_dir, tmp_path / "out")) == 0  # kvrelay pki issue signs with the new CA now
    issued = load_cert(read_pem(tmp_path / "out" / f"decode-{SITE}-w1.pem", "cert"), "cert")
    issued.verify_directly_issued_by(new.cert)
    assert main(["pki", "rotate-ca", str(ca_dir), "--finish"]) == 2
    assert "the overlap lasts until" in capsys.readouterr().err
    assert main(["pki", "rotate-ca", str(ca_dir), "--finish", "--force"]) == 0
    assert "now holds only the new CA" in capsys.readouterr().out
    assert x509.load_pem_x509_certificates(read_pem(ca_dir / CA_CERT, "bundle")) == [new.cert]


def test_crl_lists_the_configs_revoked_serials_signed_by_the_ca(ca_dir, tmp_path, capsys):
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("tls:\n  revoked_serials: ['0a', 'ff:01']\n")
    out = tmp_path / "crl.pem"
    assert main(["stores", "crl", "--config", str(cfg), "--ca-dir", str(ca_dir), "--out", str(out), "--days", "3"]) == 0
    assert "2 revoked serial(s), valid 3 days" in capsys.readouterr().out
    crl = x509.load_pem_x509_crl(out.read_bytes())
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    assert crl.is_signature_valid(ca.public_key()) and crl.issuer == ca.subject
    assert sorted(r.serial_number for r in crl) == [0x0A, 0xFF01]
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert main(["stores", "crl", "--config", str(cfg), "--out", str(out)]) == 2
    assert "needs the CA that signs" in capsys.readouterr().err
