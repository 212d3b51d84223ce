"""Device profiles and fleets."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from fedge.errors import ConfigError
from fedge.profiles import BUILTIN_PROFILES, DeviceProfile, fleet_of, parse_fleet


def test_builtin_profiles_span_two_orders_of_magnitude() -> None:
    rates = [p.compute_rate for p in BUILTIN_PROFILES.values()]
    assert max(rates) / min(rates) == pytest.approx(100)


def test_profile_times_are_hand_computable() -> None:
    phone = DeviceProfile("p", compute_rate=100.0, uplink_mbps=1.0, downlink_mbps=8.0, memory_mb=1)
    assert phone.upload_seconds(125_000) == pytest.approx(1.0)  # 1 Mbit over 1 Mbit/s
    assert phone.download_seconds(1_000_000) == pytest.approx(1.0)  # 8 Mbit over 8 Mbit/s
    assert phone.compute_seconds(250) == pytest.approx(2.5)


def test_fleet_spec_and_seeded_assignment() -> None:
    fleet = parse_fleet("phone=6, laptop=3,gpu-box=1")
    assignment = fleet.assignment(seed=7)
    assert fleet.size == 10
    assert Counter(assignment) == {"phone": 6, "laptop": 3, "gpu-box": 1}
    assert assignment == fleet.assignment(seed=7)


def test_custom_profiles_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        '[profiles.watch]\ncompute-rate = 50\nuplink-mbps = 0.5\ndownlink-mbps = 1\nmemory-mb = 512\n'
        '[fleet]\nwatch = 4\nphone = 2\n'
    )
    fleet = parse_fleet("ignored=1", str(path))
    assert dict(fleet.mix) == {"watch": 4, "phone": 2}
    assert fleet.profile("watch").compute_rate == 50


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("phone=10,toaster=3", "unknown profile 'toaster'"),
        ("phone", "not NAME=COUNT"),
        ("phone=-1", "not NAME=COUNT"),
        ("phone=0", "no devices"),
    ],
)
def test_bad_fleet_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fleet(spec)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[profiles.x]\ncompute-rate = 1\n", "missing keys"),
        ("[profiles.x]\ncompute-rate = 1\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 1\nwat = 2\n",
         "unknown keys"),
        ("[profiles.x]\ncompute-rate = 0\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 1\n",
         "compute-rate must be > 0"),  # the TOML key, not the Python field (issue 26 item 3)
        ("[profiles.x]\ncompute-rate = 'fast'\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 1\n",
         r"compute-rate must be a number, got 'fast' \(write e\.g\. compute-rate = 50, without quotes\)"),
        ("[profiles.x]\ncompute-rate = 1\nuplink-mbps = 1\ndownlink-mbps = 1\nmemory-mb = 1\n[extra]\na = 1\n",
         r"unknown table or key 'extra'"),
        ("[profile.x]\ncompute-rate = 1\n", r"unknown table or key 'profile' \(did you mean \[profiles\]\?\)"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_fleet_files(tmp_path: Path, toml: str, message: str) -> None:
    (tmp_path / "f.toml").write_text(toml)
    with pytest.raises(ConfigError, match=message):
        parse_fleet("phone=1", str(tmp_path / "f.toml"))


def test_a_runs_fleet_is_parsed_once_and_again_when_its_file_changes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: count parses; a fleet file of 2 phones
    import fedge.profiles as profiles

    calls: list[tuple[str, str]] = []
    real = profiles.parse_fleet
    monkeypatch.setattr(profiles, "parse_fleet", lambda spec, path="": calls.append((spec, path)) or real(spec, path))
    profiles._parsed_fleet.cache_clear()
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text("[fleet]\nphone = 2\n")
    config = {"fleet": "laptop=3", "fleet-file": str(fleet_file)}
    # Execute: four asks (as a device's message does), then the file grows by a laptop
    first = [fleet_of(config) for _ in range(4)]
    fleet_file.write_text("[fleet]\nphone = 2\nlaptop = 1\n")
    changed = fleet_of(config)
    plain = fleet_of({"fleet": "laptop=3", "fleet-file": ""})
    # Assert: one parse for the four, one for the changed file, one for the plain spec
    assert all(f is first[0] for f in first) and first[0].size == 2
    assert changed.size == 3 and plain.size == 3
    assert len(calls) == 3
