"""Names both sides of a fedge round agree on (the coordinator <-> device contract).

A train instruction carries ``ArrayRecord`` ``"arrays"`` and ``ConfigRecord``
``"config"`` (Flower's FedAvg keys): what to train is one typed record,
:class:`TrainInstruction`, written once by the coordinator and read once by every runtime
(torch, onnx, a gateway, which hands the device protocol's devices its protocol form). A
train reply carries exactly one
``ArrayRecord``, one ``MetricRecord`` holding ``"num-examples"``, and the
``ConfigRecord`` :data:`REPLY_META` with the round it answers, the device's
profile and how many samples it processed (for the virtual clock).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedge import knobs
from fedge.config import CODEC_PREFIXES
from fedge.errors import ConfigError, UpdateRejected
from fedge.knobs import KNOBS
from fedge.preprocessing import OUTSIDE, RAW_SCALED
from fedge.work import LocalWork as LocalWork  # re-exported: every runtime reports its work as one

if TYPE_CHECKING:  # Flower is imported where a record is read or built: the device protocol's devices have none
    from flwr.app import ConfigRecord, RecordDict

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
REPLY_META = "fedge"
NUM_EXAMPLES = "num-examples"
SERVER_ROUND = "server-round"
# DP with client-side clipping: "fixed" or "adaptive" (which of Flower's clipping mods devices run)
DP_CLIENT_CLIPPING = "dp-client-clipping"
PROFILE = "profile"
SAMPLES_PROCESSED = "samples-processed"
STEPS = "steps"
# what a deployed device's own inputs looked like against the task's declared ranges
# (fedge.preprocessing: "raw" were preprocessed on the device, "outside" fall outside both)
INPUTS = "inputs"
INPUT_VERDICTS = (RAW_SCALED, OUTSIDE)
TRAIN_LOSS = "train-loss"
# a gateway's reply (fedge.clients.gateway.service): how many devices' updates its weighted mean stands for
AGGREGATE_OF = "aggregate-of"
# ... and, when its pool ran secure aggregation (fedge.clients.gateway.secure_pool), how many devices'
# masked inputs the unmasked sum holds: the coordinator under secure-aggregation takes no other reply
SECURE_POOL = "secure-pool"
# ... its name (the one its TLS certificate and its devices' check-ins carry: one node per name), and how
# many of its devices' updates it clipped to max-update-norm and whose weight it capped at max-device-examples
GATEWAY = "gateway"
CLIPPED = "clipped"
CAPPED = "capped"
# ... and the median L2 norm of its devices' updates before clipping (a plain round's: update-norm-bound = median
# sets each round's device bound from these); the coordinator's train instruction to gateways carries the bound
DEVICE_NORM_MEDIAN = "device-norm-median"
DEVICE_NORM_BOUND = "device-norm-bound"
# an asynchronous run's instruction (fedge.strategies.drivers.asynchronous): its staleness exponent, with which a
# gateway folds a device's result for one of its earlier rounds into the round open now; and a gateway's reply:
# how many of the devices behind its mean were such late results
LATE_EXPONENT = "late-exponent"
LATE = "late"
EVAL_PREFIX = "eval-"  # a device's evaluation reply names each task metric "eval-<metric>"
# the architecture hash of the run's signed training graph (onnx devices check theirs matches)
TRAINING_GRAPH = "training-graph"
MODEL_WIDTH = "model-width"  # a width-scaled sub-model's width (sub-models)
MODEL_SCALER = "model-scaler"  # true: the device trains and evaluates its sub-model with HeteroFL's scaler
# secure aggregation's masked step: the device's signed digests of the model and config it was
# sent ("arrays", "config", "signature"), or instead, the neighbours whose shares did not open ("senders")
SECAGG_RECEIVED = "secagg-received"
SECAGG_BAD_SHARES = "secagg-bad-shares"
# a device's own state (never sent): the samples its last masked input trained on, which the
# inline simulation's virtual clock charges (secure aggregation's replies do not carry them)
LOCAL_WORK = "fedge-local-work"
# a deployed device's own state (sent as INPUTS in its train replies): what its inputs looked like
INPUT_STATE = "fedge-inputs"

PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_COUNT = 10**12  # no device processes more samples or steps than this in one round


# --------------------------------------------------------------------------- the train instruction
# Each field's key (in its metadata) is a run-config knob's name (fedge.knobs declares them) or, for what is
# not a knob, a wire name above. Fields that are ``None`` are not part of the instruction (not sent).


def _run(key: str, *, protocol: bool = False) -> dict[str, Any]:
    """A field written by the coordinator from the run config (what every train instruction holds); with
    ``protocol`` also sent to the device protocol's devices in a task's config."""
    return {"key": key, "run": True, "protocol": protocol}


@dataclass(frozen=True)
class TrainInstruction:
    """What a device trains in a round: one typed record, written once, read once.

    The coordinator writes it from the run config (:meth:`from_run_config`, then
    :meth:`to_record`); strategies change it with :func:`dataclasses.replace` (e.g.
    :meth:`with_epochs`, FedProx's stragglers); every runtime reads it once with :meth:`read`
    (torch and onnx devices through :func:`fedge.clients.common.train_order`, a gateway, the
    device protocol's devices from a task's ``config``: :meth:`protocol_config`,
    ``docs/device-protocol.md``).

    Attributes
    ----------
    local_epochs, batch_size, learning_rate, momentum : int, int, float, float
        Local SGD: epochs of mini-batches of ``batch_size``, its learning rate and momentum.
    local_budget, time_budget_s : str | None, float | None
        ``"time"``: the device trains the steps ``time_budget_s`` buys on its profile instead of epochs.
    codecs : Mapping[str, str]
        The run's ``codec.<profile>`` / ``downlink.<profile>`` policy (each device picks its own).
    dp_client_clipping : str | None
        DP with client-side clipping: ``"fixed"`` or ``"adaptive"`` (which of Flower's mods devices run).
    training_graph : str | None
        The architecture hash of the signed training graph onnx devices train with.
    proximal_mu : float | None
        FedProx's proximal term (None: not sent, no term).
    model_width, model_scaler : float | None, bool | None
        A width-scaled sub-model's width, and whether it trains with HeteroFL's scaler.
    """

    local_epochs: int = field(metadata=_run(knobs.LOCAL_EPOCHS, protocol=True))
    batch_size: int = field(metadata=_run(knobs.BATCH_SIZE, protocol=True))
    learning_rate: float = field(metadata=_run(knobs.LEARNING_RATE, protocol=True))
    momentum: float = field(metadata=_run(knobs.MOMENTUM, protocol=True))
    local_budget: str | None = field(default=None, metadata=_run(knobs.LOCAL_BUDGET))
    time_budget_s: float | None = field(default=None, metadata=_run(knobs.TIME_BUDGET_S))
    codecs: Mapping[str, str] = field(default_factory=dict)
    dp_client_clipping: str | None = field(default=None, metadata={"key": DP_CLIENT_CLIPPING})
    training_graph: str | None = field(default=None, metadata={"key": TRAINING_GRAPH})
    proximal_mu: float | None = field(default=None, metadata={"key": knobs.PROXIMAL_MU, "protocol": True})
    model_width: float | None = field(default=None, metadata={"key": MODEL_WIDTH})
    model_scaler: bool | None = field(default=None, metadata={"key": MODEL_SCALER})

    @staticmethod
    def key(name: str) -> str:
        """The wire (and run-config) key of field ``name``."""
        return str(_FIELDS[name].metadata["key"])

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> TrainInstruction:
        """The instruction a run config gives every device (its training keys and codec policy)."""
        return cls.read({key: config[key] for key in TRAIN_KEYS}).with_codecs(config)

    @classmethod
    def read(cls, record: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> TrainInstruction:
        """The instruction in ``record`` (a train config), each field checked; ``defaults`` (the device's
        run config) fills the run's training keys (:data:`TRAIN_KEYS`) and codecs the record does not carry.

        Raises
        ------
        ConfigError
            Naming the key that is missing or has the wrong type or value, and how to set it.
        """
        values: dict[str, Any] = {}
        for name, spec in _FIELDS.items():
            if name == "codecs":
                continue
            key = cls.key(name)
            value = record.get(key, (defaults or {}).get(key) if spec.metadata.get("run") else None)
            if value is None:
                if spec.default is dataclasses.MISSING:
                    raise ConfigError(f"the train instruction has no '{key}'; the coordinator sends it from its run "
                                      f"config (--run-config '{key}=...')")
                continue
            values[name] = _checked(key, value, _TYPES[name])
        return cls(**values).with_codecs(defaults or {}).with_codecs(record)

    def with_codecs(self, config: Mapping[str, Any]) -> TrainInstruction:
        """This instruction with ``config``'s ``codec.*`` / ``downlink.*`` keys over its codec policy."""
        policy = {key: value for key, value in config.items() if key.startswith(CODEC_PREFIXES)}
        for key, value in policy.items():
            if not isinstance(value, str):
                raise ConfigError(f"train instruction '{key}' must be a codec name, got {value!r:.40}")
        return dataclasses.replace(self, codecs={**self.codecs, **policy}) if policy else self

    def with_epochs(self, epochs: int) -> TrainInstruction:
        """This instruction with ``epochs`` local epochs (FedProx's stragglers train fewer).

        Raises
        ------
        ConfigError
            ``epochs`` is not a whole number >= 1.
        """
        return dataclasses.replace(self, local_epochs=_checked(self.key("local_epochs"), epochs, int))

    def to_config(self) -> dict[str, bool | int | float | str]:
        """The instruction's keys and values as a train config carries them (unset fields left out)."""
        out: dict[str, bool | int | float | str] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if name == "codecs":
                out.update(value)
            elif value is not None:
                out[self.key(name)] = value
        return out

    def to_record(self) -> ConfigRecord:
        """:meth:`to_config` as the ``ConfigRecord`` a train message carries."""
        from flwr.app import ConfigRecord  # noqa: PLC0415 - see the TYPE_CHECKING import

        return ConfigRecord(self.to_config())  # type: ignore[arg-type]

    def written_over(self, record: Mapping[str, Any]) -> ConfigRecord:
        """``record`` (a train config, with the round's other keys) with the keys where this instruction
        differs from it written over it (in place; the rest as the record has them, types included)."""
        from flwr.app import ConfigRecord  # noqa: PLC0415

        changed = {key: value for key, value in self.to_config().items() if key not in record or record[key] != value}
        return ConfigRecord({**record, **changed})

    def protocol_config(self) -> dict[str, int | float]:
        """The training keys of a device-protocol task's ``config`` (``docs/device-protocol.md``): local SGD's
        and FedProx's term (0.0 when none)."""
        return {self.key(name): self.proximal_term if name == "proximal_mu" else getattr(self, name)
                for name, spec in _FIELDS.items() if spec.metadata.get("protocol")}

    @property
    def proximal_term(self) -> float:
        """FedProx's mu, 0 when the instruction has none."""
        return float(self.proximal_mu or 0.0)

    @property
    def time_budget(self) -> float | None:
        """Seconds of local work when the budget is time (``local-budget = "time"``), else None."""
        return self.time_budget_s if self.local_budget == "time" else None


_FIELDS = {spec.name: spec for spec in dataclasses.fields(TrainInstruction)}
_TYPES: dict[str, type] = {name: next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
                           for name, hint in typing.get_type_hints(TrainInstruction).items() if name != "codecs"}
TRAIN_KEYS = tuple(TrainInstruction.key(name) for name, spec in _FIELDS.items() if spec.metadata.get("run"))
"""The run-config keys every train instruction carries (the coordinator writes them from its run config)."""
LOCAL_EPOCHS, BATCH_SIZE = knobs.LOCAL_EPOCHS, knobs.BATCH_SIZE  # re-exported: what a gateway bounds claims by
PROXIMAL_MU = knobs.PROXIMAL_MU  # FedProx's proximal term, sent in the train config
_UNKNOWN = [name for name, spec in _FIELDS.items() if spec.metadata.get("run") and spec.metadata["key"] not in KNOBS]
if _UNKNOWN:  # the coordinator writes these from its run config: each must be a knob
    raise AssertionError(f"TrainInstruction fields {_UNKNOWN} name no run-config knob (fedge.knobs)")


def _checked(key: str, value: object, kind: type) -> Any:
    """``value`` of instruction key ``key`` as ``kind``, within its knob's range, or :class:`ConfigError` saying so."""
    fix = f"the coordinator sends it from its run config (--run-config '{key}=...')"
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"train instruction '{key}' must be true or false, got {value!r:.40}; {fix}")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"train instruction '{key}' must be a string, got {value!r:.40}; {fix}")
        choices = KNOBS[key].allowed() if key in KNOBS else ()
        if choices and value not in choices:
            raise ConfigError(f"train instruction '{key}' = {value!r:.40} is not one of {', '.join(choices)}; {fix}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"train instruction '{key}' must be a finite number, got {value!r:.40}; {fix}")
    if kind is int:
        if not float(value).is_integer():
            raise ConfigError(f"train instruction '{key}' must be a whole number, got {value!r:.40}; {fix}")
        value = int(value)
    else:
        value = float(value)
    check = KNOBS[key].check if key in KNOBS else None
    if check is not None and not check[0](value):
        raise ConfigError(f"train instruction '{key}' = {value!r:.40} must be {check[1]}; {fix}")
    return value


def reply_meta(content: RecordDict) -> ConfigRecord | None:
    """The fedge meta record of a reply, or ``None`` when the sender did not add one."""
    from flwr.app import ConfigRecord  # noqa: PLC0415 - see the TYPE_CHECKING import

    record = content.config_records.get(REPLY_META)
    return record if isinstance(record, ConfigRecord) else None


def payload_bytes(content: RecordDict) -> int:
    """Bytes of array and binary payload in a message (what dominates a round's traffic).

    Binary config values count too: secure aggregation's keys and sealed shares travel there.
    """
    arrays = sum(len(array.data) for record in content.array_records.values() for array in record.values())
    blobs = sum(len(value) if isinstance(value, bytes) else sum(len(v) for v in value if isinstance(v, bytes))
                for record in content.config_records.values() for value in record.values()
                if isinstance(value, bytes | list))
    return arrays + blobs


# --------------------------------------------------------------------------- reading what devices send
# Threat model: every value below comes from a device that may be buggy or hostile. These
# readers are the ONLY place that turns a reply's meta and metrics into Python values: types
# are exact (no int("lots"), no int(inf)), numbers are bounded, names are short and plain.
# Everything downstream (the virtual clock, FedNova, selectors, codec policy, validation)
# uses their results, never the raw record.


@dataclass(frozen=True)
class ReplyMeta:
    """The checked fields of a reply's fedge meta record."""

    server_round: int | None = None
    profile: str | None = None
    samples_processed: int = 0
    steps: int | None = None
    inputs: str | None = None  # INPUT_VERDICTS, or None: inputs as the model takes them
    aggregate_of: int | None = None  # a gateway's reply: the devices behind its mean
    secure_pool: int | None = None  # a gateway's secure pool sum: the devices whose masked inputs it holds
    gateway: str | None = None  # a gateway's reply: its name
    clipped: int = 0  # a gateway's reply: its devices' updates it clipped to the run's norm bound
    capped: int = 0  # ... and whose weight it capped at max-device-examples
    device_norm_median: float | None = None  # ... and the median norm of its devices' updates before clipping
    late: int = 0  # ... and how many of its devices' results answered one of its earlier rounds (asynchronous)

    @property
    def pooled(self) -> bool:
        """Whether the reply stands for several devices (a gateway's mean or secure pool sum)."""
        return (self.aggregate_of or 1) > 1 or (self.secure_pool or 0) > 0


def _count(record: ConfigRecord, key: str, *, low: int) -> int | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UpdateRejected(f"reply meta '{key}' must be an integer, got {type(value).__name__} {value!r:.40}")
    if not low <= value <= MAX_COUNT:
        raise UpdateRejected(f"reply meta '{key}' = {value} is outside [{low}, {MAX_COUNT}]")
    return value


def read_reply_meta(content: RecordDict) -> ReplyMeta | None:
    """The reply's fedge meta, every field checked; ``None`` when the sender added none.

    Raises
    ------
    UpdateRejected
        Naming the field that has the wrong type or is out of range.
    """
    record = reply_meta(content)
    if record is None:
        return None
    profile = record.get(PROFILE)
    if profile is not None and (not isinstance(profile, str) or not PROFILE_NAME.match(profile)):
        raise UpdateRejected(f"reply meta '{PROFILE}' must be 1-64 letters, digits, '.', '_' or '-', "
                             f"got {profile!r:.40}")
    inputs = record.get(INPUTS)
    if inputs is not None and (not isinstance(inputs, str) or inputs not in INPUT_VERDICTS):
        raise UpdateRejected(f"reply meta '{INPUTS}' must be one of {', '.join(INPUT_VERDICTS)}, got {inputs!r:.40}")
    gateway = record.get(GATEWAY)
    if gateway is not None and (not isinstance(gateway, str) or not PROFILE_NAME.match(gateway)):
        raise UpdateRejected(f"reply meta '{GATEWAY}' must be 1-64 letters, digits, '.', '_' or '-', "
                             f"got {gateway!r:.40}")
    norm = _device_norm_median(record, plain_gateway=gateway is not None and not record.get(SECURE_POOL))
    aggregate_of, late = _count(record, AGGREGATE_OF, low=1), _count(record, LATE, low=0) or 0
    if late > (aggregate_of or 0):
        raise UpdateRejected(f"reply meta '{LATE}' = {late} must count some of a gateway's '{AGGREGATE_OF}' = "
                             f"{aggregate_of} results (a device's own reply has none late)")
    return ReplyMeta(server_round=_count(record, SERVER_ROUND, low=0), profile=profile,
                     samples_processed=_count(record, SAMPLES_PROCESSED, low=0) or 0,
                     steps=_count(record, STEPS, low=1), inputs=inputs,
                     aggregate_of=aggregate_of,
                     secure_pool=_count(record, SECURE_POOL, low=0), gateway=gateway,
                     clipped=_count(record, CLIPPED, low=0) or 0, capped=_count(record, CAPPED, low=0) or 0,
                     device_norm_median=norm, late=late)


def _device_norm_median(record: ConfigRecord, *, plain_gateway: bool) -> float | None:
    """A plain gateway's median device update norm, checked (None when the reply carries none)."""
    norm = record.get(DEVICE_NORM_MEDIAN)
    if norm is None:
        return None
    if not plain_gateway:  # a secure pool's gateway sees no device's update; a device has no devices
        raise UpdateRejected(f"reply meta '{DEVICE_NORM_MEDIAN}' comes only with a plain gateway's reply (a "
                             f"'{GATEWAY}' name and no '{SECURE_POOL}'), and this reply is none")
    if isinstance(norm, bool) or not isinstance(norm, int | float) or not math.isfinite(norm) or norm < 0:
        raise UpdateRejected(f"reply meta '{DEVICE_NORM_MEDIAN}' must be a finite number >= 0, got {norm!r:.40}")
    return float(norm)


def read_reply_meta_or_none(content: RecordDict) -> ReplyMeta | None:
    """:func:`read_reply_meta` for bookkeeping before validation: a malformed meta reads as none.

    The reply itself is rejected later by validation, with the reason.
    """
    try:
        return read_reply_meta(content)
    except UpdateRejected:
        return None


@dataclass(frozen=True)
class TrainMetrics:
    """The checked metrics of a train reply."""

    num_examples: int
    loss: float | None
    values: dict[str, float]


def _whole_count(key: str, value: object) -> int:
    """An int, or a float holding a whole number (``32.0``: Flower apps that count in floats)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UpdateRejected(f"'{key}' must be a whole number of examples, got {value!r:.40}")
    return value


def read_train_metrics(content: RecordDict, *, max_num_examples: int,
                       weight_key: str = NUM_EXAMPLES) -> TrainMetrics:
    """The reply's single MetricRecord: ``weight_key`` a whole number in ``[1, max_num_examples]``, all finite.

    ``weight_key`` is what the strategy weights updates by (Flower's ``weighted_by_key``,
    ``num-examples`` by default); a float with a whole value (``32.0``) counts as that int.

    Raises
    ------
    UpdateRejected
        Naming the metric that is missing, of the wrong type, out of range or not finite.
    """
    if len(content.metric_records) != 1:
        raise UpdateRejected(f"a train reply needs exactly one MetricRecord, got {len(content.metric_records)}")
    metrics = next(iter(content.metric_records.values()))
    if weight_key not in metrics:
        raise UpdateRejected(f"the MetricRecord has no '{weight_key}' (the key updates are weighted by)")
    count = _whole_count(weight_key, metrics[weight_key])
    if not 1 <= count <= max_num_examples:
        raise UpdateRejected(f"'{weight_key}' = {count} is outside [1, {max_num_examples}] (max-num-examples; "
                             "in a Flower app: FedAvg(validator=ReplyValidator(max_num_examples=N, "
                             "require_round_tag=False)))")
    values: dict[str, float] = {}
    for key, value in metrics.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in items):
            raise UpdateRejected(f"metric '{key}' is not finite")
        if not isinstance(value, list):
            values[key] = float(value)
    return TrainMetrics(num_examples=count, loss=values.get(TRAIN_LOSS), values=values)
