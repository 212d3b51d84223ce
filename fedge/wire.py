"""Names both sides of a fedge round agree on (the coordinator <-> device contract).

A train instruction carries ``ArrayRecord`` ``"arrays"`` and ``ConfigRecord``
``"config"`` (Flower's FedAvg keys). A train reply carries exactly one
``ArrayRecord``, one ``MetricRecord`` holding ``"num-examples"``, and the
``ConfigRecord`` :data:`REPLY_META` with the round it answers, the device's
profile and how many samples it processed (for the virtual clock).
"""

from __future__ import annotations

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
