"""Device profiles (phone / laptop / gpu-box / custom) and fleets made of them.

A profile is what the virtual clock charges a device for: download, compute and
upload time. Fleets are mixes of profiles (``"phone=60,laptop=30,gpu-box=10"``
or a TOML file). Both the coordinator and the device use this module: the
device to know which budget it trains under, the simulator to time it.
"""

from __future__ import annotations

import difflib
import math
import random
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import overload

import numpy as np
from numpy.typing import NDArray

from fedge.errors import ConfigError
from fedge.files import read_regular_file


@dataclass(frozen=True)
class Runtime:
    """What can train on a device, as the coordinator and the CLI know it (its handlers live with the
    device SDK: :mod:`fedge.clients.runtimes`).

    Attributes
    ----------
    name : str
        Its name (``runtime = "<name>"`` in a profile, the run config, ``fedge device --runtime``).
    needs_training_graph : bool
        It trains with the run's signed ONNX training graph, which the coordinator then exports
        and publishes.
    summary : str
        One line for ``--help``.
    """

    name: str
    needs_training_graph: bool
    summary: str


RUNTIMES: dict[str, Runtime] = {}
"""The runtimes there are, by name (:func:`register_runtime`)."""


def register_runtime(runtime: Runtime) -> Runtime:
    """Make ``runtime`` a name profiles, the run config and ``fedge device`` accept."""
    RUNTIMES[runtime.name] = runtime
    return runtime


def runtime(name: str) -> Runtime:
    """The runtime ``name``.

    Raises
    ------
    ConfigError
        Naming the runtimes there are.
    """
    if name not in RUNTIMES:
        raise ConfigError(f"runtime {name!r} is not one fedge knows; use one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


register_runtime(Runtime("torch", False, "Python + torch"))
register_runtime(Runtime("onnx", True, "the coordinator's signed ONNX training graph on onnxruntime + numpy, no "
                                       "torch: phones, browsers"))


@dataclass(frozen=True)
class DeviceProfile:
    """What one class of device can do.

    Attributes
    ----------
    name : str
        Profile name, e.g. ``"phone"``.
    compute_rate : float
        Training throughput in samples per second (forward + backward).
    uplink_mbps, downlink_mbps : float
        Link bandwidth in Mbit/s.
    memory_mb : int
        Memory available to training, in MiB.
    availability : float
        Probability that the device is online in a given slot of time.
    dropout : float
        Probability that the device vanishes mid-round, after receiving work.
    online_hours : tuple of (start, end) hours
        A diurnal trace: the device can be online only within these windows of each
        simulated day (hours 0-24, e.g. ``((0, 7), (19, 24))`` for phones charging at
        night); empty means any time. ``availability`` applies within the windows.
    runtime : str
        What trains on the device: ``"torch"`` (Python + torch) or ``"onnx"`` (the task's
        signed ONNX training graph on onnxruntime + numpy, no torch: phones, browsers).
    """

    name: str
    compute_rate: float
    uplink_mbps: float
    downlink_mbps: float
    memory_mb: int
    availability: float = 1.0
    dropout: float = 0.0
    online_hours: tuple[tuple[float, float], ...] = ()
    runtime: str = "torch"
    model_width: float | None = None

    def __post_init__(self) -> None:
        for field in ("compute_rate", "uplink_mbps", "downlink_mbps"):
            value = getattr(self, field)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"profile '{self.name}': {field} must be > 0 (a finite number), got {value!r}")
        if isinstance(self.memory_mb, bool) or not isinstance(self.memory_mb, int) or self.memory_mb <= 0:
            raise ConfigError(f"profile '{self.name}': memory_mb must be an integer > 0 (MiB), got {self.memory_mb!r}")
        if not _is_number(self.availability) or not 0 < self.availability <= 1:
            raise ConfigError(f"profile '{self.name}': availability must be in (0, 1], got {self.availability!r}")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ConfigError(f"profile '{self.name}': dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.online_hours, tuple):
            raise ConfigError(f"profile '{self.name}': online_hours must be a list of [start, end] windows, "
                              f"got {self.online_hours!r}")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"profile '{self.name}': runtime must be one of {', '.join(RUNTIMES)}, "
                              f"got {self.runtime!r}")
        if self.model_width is not None and (not _is_number(self.model_width) or not 0 < self.model_width <= 1):
            raise ConfigError(f"profile '{self.name}': model_width must be a number in (0, 1] (1: the whole model, "
                              f"0.25: a quarter of every hidden layer), got {self.model_width!r}")
        for window in self.online_hours:
            if (not isinstance(window, tuple) or len(window) != 2 or not all(map(_is_number, window))
                    or not 0 <= window[0] < window[1] <= 24):
                shown = list(window) if isinstance(window, tuple) else window
                raise ConfigError(f"profile '{self.name}': online-hours window {shown!r} must be "
                                  "[start, end] with 0 <= start < end <= 24")

    def online_at_hour(self, hour: float) -> bool:
        """Whether the diurnal trace allows being online at ``hour`` (0-24) of the day."""
        return not self.online_hours or any(start <= hour < end for start, end in self.online_hours)

    def download_seconds(self, nbytes: int) -> float:
        """Seconds to receive ``nbytes`` over this profile's downlink."""
        return nbytes * 8 / (self.downlink_mbps * 1e6)

    def upload_seconds(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` over this profile's uplink."""
        return nbytes * 8 / (self.uplink_mbps * 1e6)

    def compute_seconds(self, samples: int) -> float:
        """Seconds to process ``samples`` training samples."""
        return samples / self.compute_rate


def time_budget_steps(time_budget_s: float, compute_rate: float, batch_size: int) -> int:
    """SGD steps that ``time_budget_s`` seconds buy at ``compute_rate`` samples/s (at least 1).

    What a device with ``local-budget = "time"`` trains, and what the coordinator allows it.
    """
    return max(1, int(time_budget_s * compute_rate) // batch_size)


def _is_number(value: object) -> bool:
    """An int or float, not a bool (TOML's ``true`` is no rate)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


# Rough 2024-era figures for a small model: a phone is 100x slower than a GPU box
# and has a thin, asymmetric uplink.
BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    "phone": DeviceProfile("phone", compute_rate=200.0, uplink_mbps=2.0, downlink_mbps=10.0,
                           memory_mb=2048, availability=0.7, dropout=0.1),
    "laptop": DeviceProfile("laptop", compute_rate=2_000.0, uplink_mbps=20.0,
                            downlink_mbps=50.0, memory_mb=8192, availability=0.9, dropout=0.02),
    "gpu-box": DeviceProfile("gpu-box", compute_rate=20_000.0, uplink_mbps=100.0,
                             downlink_mbps=500.0, memory_mb=32768, availability=1.0),
}

# Most devices a fleet may have. The simulator keeps a few bytes per idle device (its profile
# code in Fleet.profile_codes) and materialises only the selected ones; a count beyond this is
# a typo, not a fleet.
MAX_FLEET_SIZE = 1_000_000
MAX_FLEET_FILE_BYTES = 1 << 20  # a fleet file is a few profile tables; 1 MiB is far beyond any real one

_TOML_FIELDS = {
    "compute-rate": "compute_rate",
    "uplink-mbps": "uplink_mbps",
    "downlink-mbps": "downlink_mbps",
    "memory-mb": "memory_mb",
    "availability": "availability",
    "dropout": "dropout",
    "online-hours": "online_hours",
    "runtime": "runtime",
    "model-width": "model_width",
}


@dataclass(frozen=True)
class Fleet:
    """A fleet: which profile each device (partition id) has.

    Attributes
    ----------
    profiles : dict[str, DeviceProfile]
        Every profile the fleet may name (built-in ones plus custom ones).
    mix : tuple[tuple[str, int], ...]
        ``(profile name, device count)`` in the order given.
    """

    profiles: dict[str, DeviceProfile]
    mix: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        """Number of devices."""
        return sum(count for _, count in self.mix)

    def assignment(self, seed: int) -> ProfileAssignment:
        """Profile name of each partition id, shuffled reproducibly by ``seed``.

        A read-only sequence of ``size`` names over :meth:`profile_codes` (two bytes a device).
        """
        return ProfileAssignment(*self.profile_codes(seed))

    def profile_codes(self, seed: int) -> tuple[tuple[str, ...], NDArray[np.int16]]:
        """(profile names, the index into them of each partition id's profile): compact, cached.

        The same shuffle as :meth:`assignment` (``random.Random(seed)``), computed once per
        (mix, seed) in a process; two bytes per device.
        """
        return _profile_codes(self.mix, seed)

    def profile_of(self, partition_id: int, seed: int) -> str:
        """The profile name of one partition id (what :meth:`assignment` has at that index)."""
        names, codes = self.profile_codes(seed)
        return names[int(codes[partition_id])]

    def profile(self, name: str) -> DeviceProfile:
        """Look up a profile, with a clear error for an unknown name."""
        try:
            return self.profiles[name]
        except KeyError:
            raise ConfigError(
                f"unknown device profile '{name}'; known profiles: {', '.join(self.profiles)}"
            ) from None


class ProfileAssignment(Sequence[str]):
    """Which profile each partition id has: a sequence of names over a compact code array."""

    def __init__(self, names: tuple[str, ...], codes: NDArray[np.int16]) -> None:
        self.names, self.codes = names, codes

    def __len__(self) -> int:
        return len(self.codes)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self.names[code] for code in self.codes[index].tolist()]
        return self.names[int(self.codes[index])]

    def __iter__(self) -> Iterator[str]:
        names = self.names
        return (names[code] for code in self.codes.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ProfileAssignment):
            return [*self.names] == [*other.names] and bool(np.array_equal(self.codes, other.codes))
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        counts = np.bincount(self.codes, minlength=len(self.names)).tolist()
        return f"ProfileAssignment({len(self)} devices: {dict(zip(self.names, counts, strict=True))})"


@lru_cache(maxsize=8)
def _profile_codes(mix: tuple[tuple[str, int], ...], seed: int) -> tuple[tuple[str, ...], NDArray[np.int16]]:
    names = tuple(dict.fromkeys(name for name, _ in mix))
    base = np.repeat(np.array([names.index(name) for name, _ in mix], dtype=np.int16),
                     [count for _, count in mix])
    order = list(range(len(base)))
    random.Random(seed).shuffle(order)  # shuffles positions exactly as it would shuffle the names
    codes = base[np.array(order, dtype=np.int64)]
    codes.flags.writeable = False
    return names, codes


def load_profiles_toml(path: str | Path) -> tuple[dict[str, DeviceProfile], dict[str, int]]:
    """Read custom ``[profiles.NAME]`` tables and an optional ``[fleet]`` mix from TOML.

    Raises
    ------
    ConfigError
        The file cannot be read, is not UTF-8 TOML, or its tables are not those of a
        fleet file.
    """
    content = read_regular_file(path, limit=MAX_FLEET_FILE_BYTES, what="fleet file")  # not /dev/zero, not 1 GB
    try:
        data = tomllib.loads(content.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"fleet file '{path}' is not UTF-8 text: {exc}") from None
    except ValueError as exc:  # TOMLDecodeError, or an integer of more than 4300 digits
        raise ConfigError(f"fleet file '{path}' is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"fleet file '{path}' is not valid TOML: arrays or tables nest too deeply") from None
    _refuse_unknown_tables(path, data)
    tables, mix = data.get("profiles", {}), data.get("fleet", {})
    if not isinstance(tables, dict) or not all(isinstance(table, dict) for table in tables.values()):
        raise ConfigError(f"fleet file '{path}': 'profiles' must hold one table per profile, e.g. "
                          "[profiles.watch] with compute-rate = 50 ...")
    if not isinstance(mix, dict):
        raise ConfigError(f"fleet file '{path}': 'fleet' must be a table of NAME = COUNT, e.g. [fleet] phone = 60")
    profiles = {name: _profile_from_table(name, table) for name, table in tables.items()}
    return profiles, dict(mix)


def _profile_from_table(name: str, table: dict[str, object]) -> DeviceProfile:
    unknown = set(table) - set(_TOML_FIELDS)
    missing = set(_TOML_FIELDS) - {"availability", "dropout", "online-hours", "runtime", "model-width"} - set(table)
    if unknown or missing:
        raise ConfigError(
            f"profile '{name}': unknown keys {sorted(unknown)} / missing keys {sorted(missing)};"
            f" a profile has {', '.join(_TOML_FIELDS)}"
        )
    for key in _NUMBER_KEYS.keys() & set(table):
        if not _is_number(table[key]):
            raise ConfigError(f"profile '{name}': {key} must be a number, got {table[key]!r} "
                              f"(write e.g. {key} = {_NUMBER_KEYS[key]}, without quotes)")
    kwargs = {_TOML_FIELDS[key]: value for key, value in table.items()}
    if "online_hours" in kwargs:
        windows = kwargs["online_hours"]
        if not isinstance(windows, list) or not all(isinstance(window, list) for window in windows):
            raise ConfigError(f"profile '{name}': online-hours must be a list of [start, end] windows, "
                              f"e.g. [[0, 7], [19, 24]], got {windows!r}")
        kwargs["online_hours"] = tuple(tuple(window) for window in windows)
    try:
        return DeviceProfile(name=name, **kwargs)  # type: ignore[arg-type]
    except ConfigError as exc:  # name the fleet file's key, not the Python field
        message = str(exc)
        for key, field in _TOML_FIELDS.items():
            message = message.replace(f": {field} must", f": {key} must")
        raise ConfigError(message) from None


_FILE_TABLES = ("profiles", "fleet")
_NUMBER_KEYS = {"compute-rate": 50, "uplink-mbps": 2, "downlink-mbps": 10, "memory-mb": 512, "availability": 0.6,
                "dropout": 0.1, "model-width": 0.25}


def _refuse_unknown_tables(path: str | Path, data: dict[str, object]) -> None:
    """A fleet file holds [profiles.NAME] tables and a [fleet] table; anything else is a typo."""
    for key in data:
        if key not in _FILE_TABLES:
            close = difflib.get_close_matches(key, _FILE_TABLES, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise ConfigError(f"fleet file '{path}': unknown table or key '{key}'{hint}; a fleet file has "
                              "[profiles.NAME] tables and a [fleet] table of NAME = COUNT")


def parse_fleet(spec: str, fleet_file: str = "") -> Fleet:
    """Build a :class:`Fleet` from ``"phone=60,laptop=30"`` and/or a TOML fleet file.

    A fleet file's ``[fleet]`` table replaces ``spec``; its ``[profiles.*]`` tables
    add to (or override) the built-in profiles.
    """
    profiles = dict(BUILTIN_PROFILES)
    mix: dict[str, int] = {}
    file_mix: dict[str, int] = {}
    if fleet_file:
        custom, file_mix = load_profiles_toml(fleet_file)
        profiles.update(custom)
        mix = file_mix
    if not mix:
        mix = _parse_mix(spec)
    for name, count in mix.items():
        if name not in profiles:
            raise ConfigError(
                f"fleet names unknown profile '{name}'; known profiles: {', '.join(profiles)}"
                " (define custom ones in a fleet TOML file's [profiles.NAME] table)"
            )
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"fleet count for '{name}' must be an integer >= 0, got {count!r}")
    fleet = Fleet(profiles=profiles, mix=tuple(mix.items()))
    source = f"fleet file '{fleet_file}'" if file_mix else f"fleet '{spec}'"
    if fleet.size == 0:
        raise ConfigError(f"{source} has no devices; give counts like phone=60,laptop=30")
    if fleet.size > MAX_FLEET_SIZE:
        raise ConfigError(f"{source} has {fleet.size} devices; a fleet has at most {MAX_FLEET_SIZE:,}")
    return fleet


def fleet_of(config: Mapping[str, object]) -> Fleet:
    """The run's fleet (its ``fleet`` and ``fleet-file`` knobs), parsed once per process.

    Devices ask for it on every message (profile, runtime, partitions, step budget); a fleet
    file is parsed again only when its size or modification time changes. The result is shared:
    read it, do not mutate its ``profiles``.
    """
    from fedge import knobs  # here, not at the top: fedge.knobs imports this module for its runtimes

    spec, fleet_file = str(config[knobs.FLEET]), str(config.get(knobs.FLEET_FILE, ""))
    return _parsed_fleet(spec, fleet_file, _file_stamp(fleet_file))


def _file_stamp(fleet_file: str) -> tuple[int, int]:
    if not fleet_file:
        return (0, 0)
    try:
        stat = Path(fleet_file).stat()
    except OSError:
        return (-1, -1)  # parse_fleet says what is wrong with the path
    return (stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=16)
def _parsed_fleet(spec: str, fleet_file: str, stamp: tuple[int, int]) -> Fleet:
    del stamp  # part of the cache key only
    return parse_fleet(spec, fleet_file)


def _parse_mix(spec: str) -> dict[str, int]:
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, count = (text.strip() for text in part.partition("="))
        # ASCII digits only: str.isdigit() takes "\u00b2" and int() refuses it (and whitespace such as "\x1f")
        if not sep or not re.fullmatch(r"[0-9]+", count):
            raise ConfigError(
                f"fleet entry '{part}' is not NAME=COUNT; write e.g. phone=60,laptop=30,gpu-box=10"
            )
        if len(count) > len(str(MAX_FLEET_SIZE)):  # int() refuses > 4300 digits: stop far earlier
            raise ConfigError(f"fleet entry '{part[:60]}': too many devices; a fleet has at most {MAX_FLEET_SIZE:,}")
        mix[name] = mix.get(name, 0) + int(count)
    return mix
