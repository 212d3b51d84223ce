"""Key directories are private whatever the umask (security review, issue 12, finding 7).

Attack replayed: under ``umask 0`` a plain ``mkdir`` makes ``keys/`` and ``keys/devices/``
(the allow-list of devices the coordinator registers) mode 0777, so any local user could
drop their own device key into the allow-list or swap a public key.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from fedge.cli.main import main
from fedge.edge.signing import ensure_private_dir
from fedge.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# (command line, {path: expected mode}); {d} is the test's key directory.
COMMANDS: list[tuple[list[str], dict[str, int]]] = [
    (["keys", "init", "{d}"],
     {"": 0o700, "devices": 0o700, "ca.key": 0o600, "coordinator.key": 0o600, "ca.crt": 0o644,
      "coordinator.crt": 0o644}),
    (["keys", "add-device", "phone-1", "--dir", "{d}"],
     {"": 0o700, "devices": 0o700, "devices/phone-1.key": 0o600, "devices/phone-1.pub": 0o644}),
    (["keys", "signing", "init", "{d}"], {"": 0o700, "signing.key": 0o600, "signing.pub": 0o644}),
]


@pytest.mark.parametrize(("argv", "modes"), COMMANDS, ids=[" ".join(c[0][:2]) for c in COMMANDS])
def test_key_commands_create_private_directories_under_umask_zero(
    tmp_path: Path, umask_zero: None, argv: list[str], modes: dict[str, int]
) -> None:
    # Prepare
    directory = tmp_path / "keys"
    # Execute
    code = main([a.format(d=directory) for a in argv])
    # Assert: 0700 directories, 0600 private keys, 0644 public files (never 0777 / 0666)
    assert code == 0
    assert {name: _mode(directory / name) for name in modes} == modes


@pytest.mark.parametrize(("argv", "modes"), COMMANDS, ids=[" ".join(c[0][:2]) for c in COMMANDS])
def test_existing_world_writable_key_directories_are_tightened(
    tmp_path: Path, umask_zero: None, argv: list[str], modes: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: directories another user could write (as an old fedge left them under umask 0)
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o777)
    if "devices" in modes:
        (directory / "devices").mkdir(mode=0o777)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.edge"):
        code = main([a.format(d=directory) for a in argv])
    # Assert
    assert code == 0
    assert _mode(directory) == 0o700
    if "devices" in modes:
        assert _mode(directory / "devices") == 0o700
    assert "was writable by group or others (mode 0777); tightened it to 0700" in caplog.text


@pytest.mark.parametrize(("existing", "expected"), [
    (None, 0o700),    # created: 0700 exactly, not 0777 & ~umask
    (0o777, 0o700),   # world-writable: tightened
    (0o770, 0o700),   # group-writable: tightened
    (0o755, 0o755),   # only readable by others: left alone
    (0o700, 0o700),
])
def test_ensure_private_dir_modes(tmp_path: Path, umask_zero: None, existing: int | None, expected: int) -> None:
    # Prepare
    directory = tmp_path / "d"
    if existing is not None:
        directory.mkdir(mode=existing)
    # Execute
    ensure_private_dir(directory)
    # Assert
    assert _mode(directory) == expected


def test_ensure_private_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        ensure_private_dir(tmp_path / "f")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="needs root to make a directory another user owns")
def test_a_key_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    # Prepare: a 0755 directory that uid 12345 owns (it could later swap keys in it)
    theirs = tmp_path / "keys"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    # Execute / Assert
    with pytest.raises(ConfigError, match="belongs to another user"):
        ensure_private_dir(theirs)
