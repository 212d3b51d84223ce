"""Names both sides of a fedge round agree on (the coordinator <-> device contract).

A train instruction carries ``ArrayRecord`` ``"arrays"`` and ``ConfigRecord``
``"config"`` (Flower's FedAvg keys). A train reply carries exactly one
``ArrayRecord``, one ``MetricRecord`` holding ``"num-examples"``, and the
``ConfigRecord`` :data:`REPLY_META` with the round it answers, the device's
profile and how many samples it processed (for the virtual clock).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from flwr.app import ConfigRecord, RecordDict

from fedge.errors import UpdateRejected
from fedge.preprocessing import OUTSIDE, RAW_SCALED
from fedge.work import LocalWork as LocalWork  # re-exported: every runtime reports its work as one

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
REPLY_META = "fedge"
NUM_EXAMPLES = "num-examples"
SERVER_ROUND = "server-round"
PROXIMAL_MU = "proximal-mu"  # FedProx's proximal term, sent in the train config
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
# a gateway's reply (fedge.clients.gateway): how many devices' updates its weighted mean stands for
AGGREGATE_OF = "aggregate-of"
# ... and, when its pool ran secure aggregation (fedge.clients.gateway_secure), how many devices'
# masked inputs the unmasked sum holds: the coordinator under secure-aggregation takes no other reply
SECURE_POOL = "secure-pool"
# ... its name (the one its TLS certificate and its devices' check-ins carry: one node per name), and how
# many of its devices' updates it clipped to max-update-norm and whose weight it capped at max-device-examples
GATEWAY = "gateway"
CLIPPED = "clipped"
CAPPED = "capped"
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


def reply_meta(content: RecordDict) -> ConfigRecord | None:
    """The fedge meta record of a reply, or ``None`` when the sender did not add one."""
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
    return ReplyMeta(server_round=_count(record, SERVER_ROUND, low=0), profile=profile,
                     samples_processed=_count(record, SAMPLES_PROCESSED, low=0) or 0,
                     steps=_count(record, STEPS, low=1), inputs=inputs,
                     aggregate_of=_count(record, AGGREGATE_OF, low=1),
                     secure_pool=_count(record, SECURE_POOL, low=0), gateway=gateway,
                     clipped=_count(record, CLIPPED, low=0) or 0, capped=_count(record, CAPPED, low=0) or 0)


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
