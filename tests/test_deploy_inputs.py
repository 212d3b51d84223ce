"""Deployment keys and the refusals that need no running coordinator."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedge.cli.main import main
from fedge.server.pki import add_device, init_keys


def test_keys_have_the_right_permissions_and_formats(tmp_path: Path) -> None:
    keys = init_keys(tmp_path / "k", hosts=["10.0.0.7", "coord.example"])
    private, public = add_device(tmp_path / "k", "phone-1")
    for path in (keys.ca_key, keys.key, private):
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    assert public.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert private.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(keys.cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(n.value) for n in sans} == {"localhost", "127.0.0.1", "10.0.0.7", "coord.example"}
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(keys.ca_cert.read_bytes()))


def test_keys_are_not_overwritten_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "init", str(tmp_path / "k")]) == 0
    before = (tmp_path / "k" / "ca.key").read_bytes()
    assert main(["keys", "init", str(tmp_path / "k")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "k" / "ca.key").read_bytes() == before
    assert main(["keys", "init", str(tmp_path / "k"), "--force"]) == 0
    assert (tmp_path / "k" / "ca.key").read_bytes() != before


@pytest.fixture
def device_files(tmp_path: Path) -> dict[str, Path]:
    init_keys(tmp_path / "keys")
    key, _ = add_device(tmp_path / "keys", "d0")
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 64), np.float32), y=np.array([0, 1, 2, 3]))
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    (tmp_path / "text.csv").write_text("a,label\nhello,1\n")
    return {"key": key, "ca": tmp_path / "keys" / "ca.crt", "data": tmp_path / "data.npz",
            "bad": tmp_path / "bad.npz", "csv": tmp_path / "text.csv", "tmp": tmp_path}


def _free_port() -> int:
    from fedge.simulation.loopback import free_port

    return free_port(1)  # a port of this xdist worker's own


DEVICE_CASES = [
    (["--profile", "toaster"], "fleet names unknown profile 'toaster'"),
    (["--data", "{bad}"], "cannot read"),
    (["--data", "{csv}"], "non-numeric"),
    (["--data", "{tmp}/missing.npz"], "does not exist"),
    (["--key", "{tmp}/missing.key"], "device key '.*missing.key' does not exist"),
    (["--key", "{ca}"], "is not an OpenSSH private key"),
    (["--coordinator", "nohostport"], "is not HOST:PORT"),
    (["--max-wait", "2"], "unreachable .* after 2 s"),
]


@pytest.mark.parametrize(("extra", "message"), DEVICE_CASES, ids=[c[1][:30] for c in DEVICE_CASES])
def test_device_refuses_bad_input_with_one_line(device_files: dict[str, Path], extra: list[str],
                                               message: str, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    base = ["device", "--coordinator", f"127.0.0.1:{_free_port()}", "--profile", "phone",
            "--data", str(device_files["data"]), "--key", str(device_files["key"]),
            "--ca", str(device_files["ca"]), "--max-wait", "0", "--state-dir", str(device_files["tmp"] / "s")]
    argv = base + [a.format(**{k: str(v) for k, v in device_files.items()}) for a in extra]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedge: error")]
    assert len(err) == 1 and re.search(message, err[0]), err


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[int]:
    """A TLS listener with a certificate from a *different* CA than the device's."""
    other = init_keys(tmp_path / "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(other.cert, other.key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(3):
            try:
                conn, _ = listener.accept()
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                continue

    threading.Thread(target=serve, daemon=True).start()
    yield port
    listener.close()


def test_device_refuses_a_coordinator_its_ca_did_not_sign(
    device_files: dict[str, Path], tls_server: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["device", "--coordinator", f"127.0.0.1:{tls_server}", "--data", str(device_files["data"]),
                 "--key", str(device_files["key"]), "--ca", str(device_files["ca"]), "--max-wait", "3",
                 "--state-dir", str(device_files["tmp"] / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "does not verify with" in err and "Traceback" not in err


@pytest.mark.parametrize("problem", ["expired", "mismatched key", "missing", "foreign CA"])
def test_coordinator_refuses_bad_tls_files(tmp_path: Path, problem: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    keys = init_keys(tmp_path / "k", days=0 if problem == "expired" else 365)
    other = init_keys(tmp_path / "other")
    if problem == "mismatched key":
        keys.key.write_bytes(other.key.read_bytes())
    elif problem == "missing":
        keys.cert.unlink()
    elif problem == "foreign CA":
        keys.ca_cert.write_bytes(other.ca_cert.read_bytes())
    code = main(["coordinator", "start", "--keys", str(keys.directory), "--state-dir", str(tmp_path / "s"),
                 "--port", str(_free_port()), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    expected = {"expired": "is valid only from", "mismatched key": "does not belong to",
                "missing": "is missing; create keys", "foreign CA": "is not signed by"}[problem]
    assert code == 2 and expected in err, err
    assert not (tmp_path / "run").exists()


def test_coordinator_refuses_bad_run_config_before_starting(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["coordinator", "start", "--insecure", "--state-dir", str(tmp_path / "s"),
                 "--run-config", "num-round=3"])
    assert code == 2 and "unknown run-config key 'num-round'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(("arguments", "message"), [
    (["--clients-per-round", "10"], "clients-per-round = 10 but only 2 device(s) are registered"),
    (["--clients-per-round", "2", "--run-config", "min-train-replies=3"],
     "min-train-replies = 3 but only 2 device(s) are registered"),
    (["--clients-per-round", "2", "--run-config", "secure-aggregation=true"],
     "secure-aggregation needs at least 3 devices a round"),
    (["--clients-per-round", "2", "--run-config", "round-policy='deadline' deadline-s=0.001"],
     "deadline-s = 0.001 is shorter than any device could finish a round"),
    (["--clients-per-round", "2", "--run-config", "task='no_such_module:Task'"],
     "cannot import module 'no_such_module'"),
])
def test_coordinator_refuses_a_run_that_cannot_work_with_its_devices_before_starting(
        tmp_path: Path, arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: keys with two registered devices (the operator's example in issue 17)
    keys = init_keys(tmp_path / "k")
    for name in ("phone-1", "phone-2"):
        add_device(tmp_path / "k", name)
    # Execute
    code = main(["coordinator", "start", "--keys", str(keys.directory), "--state-dir", str(tmp_path / "s"),
                 "--port", str(_free_port()), "--run-dir", str(tmp_path / "run"), *arguments])
    # Assert: one line, exit 2, nothing written, no Flower process started
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "s" / "current-run").exists()


def test_a_free_coordinator_port_has_its_bundle_and_metrics_ports_free_too() -> None:
    # Prepare: a listener where a coordinator's bundle service would go
    import socket

    from fedge.simulation.loopback import _bindable, free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # Execute
        port = free_port()
        # Assert: a busy port is seen as busy; the chosen port's +1 and +2 are bindable
        assert not _bindable(taken)
        assert all(_bindable(port + step) for step in range(3))
