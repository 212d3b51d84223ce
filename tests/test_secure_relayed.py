"""The coordinator's relayed records (strategies/drivers/secure.py): built without Flower's per-value
type check, they must be the records Flower's constructor makes, byte for byte on the wire."""

from __future__ import annotations

import os

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedge.strategies.drivers.secure import _config, _relayed


@pytest.mark.parametrize("values", [
    {},
    {"server-round": 3},
    {"server-round": 3, "threshold": 7, "neighbours": [5, 1, 9], **{f"c-pk/{p}": os.urandom(32) for p in (5, 1, 9)}},
    {"survivors": [], "sig/4": os.urandom(64)},
])
def test_a_relayed_record_is_the_record_flower_makes(values: dict) -> None:
    fast, checked = _relayed(dict(values)), ConfigRecord(dict(values))
    assert isinstance(fast, ConfigRecord) and fast == checked
    assert list(fast.items()) == list(checked.items())
    assert (recorddict_to_proto(RecordDict({"r": fast})).SerializeToString(deterministic=True)
            == recorddict_to_proto(RecordDict({"r": checked})).SerializeToString(deterministic=True))
    fast["more"] = 1  # still a working record
    assert fast["more"] == 1


def test_values_of_other_types_go_through_flowers_checks() -> None:
    assert _relayed({"flag": True, "rate": 0.5, "name": "x", "ids": [True, False]}) == ConfigRecord(
        {"flag": True, "rate": 0.5, "name": "x", "ids": [True, False]})
    with pytest.raises(TypeError):
        _relayed({"bad": object()})
    with pytest.raises(TypeError):
        _relayed({"mixed": [1, "a"]})


def test_a_replys_config_record_is_read_as_flowers_view_reads_it() -> None:
    content = RecordDict({"keys": ConfigRecord({"a": b"1"}), "masked": ArrayRecord()})
    reply = Message(content, dst_node_id=1, message_type="train")
    assert _config(reply, "keys") is content.config_records["keys"]
    assert _config(reply, "masked") is None and content.config_records.get("masked") is None
    assert _config(reply, "absent") is None
