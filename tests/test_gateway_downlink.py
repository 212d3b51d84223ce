"""A gateway's compressed downlink (``--downlink fp16|int8``): each device is sent the task encoding it reads,
and its update is taken against the weights it read, so the encoding's rounding never reaches the model.
(Live devices training from an fp16 task: tests/test_gateway.py, which has a live gateway's run.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedge.clients.gateway.pool import GatewayRound, Session
from fedge.clients.gateway.protocol import (
    TASK_CAPABILITIES,
    Frame,
    assemble_frame,
    decode_frame,
    encode_task,
    frame_tensors,
    int8_delta,
    task_weights,
)
from fedge.clients.gateway.service import GatewayOptions, GatewaySettings, check_gateway
from fedge.errors import ConfigError

WEIGHTS = {"w": np.array([0.5, -1.0, 2.0, 0.25], np.float32)}
# int8 by hand: scale = 2 / 127; q = rint(w / scale) = [31.75 -> 32, -63.5 -> -64 (half to even), 127, 15.875 -> 16]
INT8_READ = np.array([32, -64, 127, 16], np.float32) * np.float32(2 / 127)


def _session(name: str, *, reads: frozenset[str] = frozenset(TASK_CAPABILITIES)) -> Session:
    return Session(device=name, key=b"k" * 32, expires=1e18, tasks=reads)


def _result(current: GatewayRound, examples: int, tensors: dict[str, np.ndarray], encoding: str = "fp32",
            scales: dict[str, float] | None = None) -> tuple[Frame, dict[str, float]]:
    header = {"task": current.task_id, "kind": "train", "num-examples": examples, "encoding": encoding}
    return decode_frame(assemble_frame(header, *frame_tensors(tensors, scales)))


def test_the_int8_task_is_the_hand_computed_one_and_fp16_halves_the_bytes() -> None:
    # Execute
    tasks = {encoding: encode_task(WEIGHTS, encoding) for encoding in ("fp32", "fp16", "int8")}

    # Assert: a quarter and a half of fp32's bytes; each device reads what the encoding rounds to
    assert [len(tasks[e].data) for e in ("fp32", "fp16", "int8")] == [16, 8, 4]
    assert np.array_equal(tasks["int8"].received["w"], INT8_READ)
    assert np.array_equal(tasks["fp16"].received["w"], WEIGHTS["w"])  # these four are exact in float16
    frame, scales = decode_frame(assemble_frame({}, tasks["int8"].entries, tasks["int8"].data))
    assert np.array_equal(task_weights(frame, scales)["w"], INT8_READ)


def test_each_device_gets_the_encoding_it_reads_and_its_update_is_taken_against_what_it_read() -> None:
    # Prepare: an int8 downlink; phone0 reads int8 tasks, phone1 (an older app) only float32
    current = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=WEIGHTS, target=2,
                           max_num_examples=100, downlink="int8")
    reader, older = _session("phone0"), _session("phone1", reads=frozenset())

    # Execute: each takes its task and trains +0.1 (1 example) and +0.3 (3 examples) from what it read
    sent = current.task(reader), current.task(older)
    current.accept(reader, *_result(current, 1, {"w": sent[0].received["w"] + np.float32(0.1)}))
    current.accept(older, *_result(current, 3, {"w": sent[1].received["w"] + np.float32(0.3)}))
    result = current.close()

    # Assert: int8 for one, float32 for the other; the mean is the exact weights + (1 x 0.1 + 3 x 0.3) / 4, with
    # no trace of the int8 rounding (up to 0.0079 a weight here)
    assert [entry["dtype"] for entry in sent[0].entries] == ["int8"] and sent[1].entries[0]["dtype"] == "float32"
    assert result is not None and result.num_examples == 4
    assert np.allclose(result.arrays["w"], WEIGHTS["w"] + np.float32(0.25), rtol=0, atol=1e-6)


def test_an_int8_delta_update_from_an_fp16_task_restores_onto_the_exact_weights() -> None:
    # Prepare: an fp16 downlink of weights float16 cannot hold exactly
    weights = {"w": np.array([0.1, -0.7, 1e-3, 3.3], np.float32)}
    current = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=weights, target=1,
                           max_num_examples=100, downlink="fp16")
    device = _session("phone0")
    read = current.task(device).received["w"]
    trained = {"w": read + np.array([0.05, -0.02, 0.01, 0.0], np.float32)}

    # Execute: the device sends int8-delta against the weights it read
    quantised, scales = int8_delta(trained, {"w": read})
    current.accept(device, *_result(current, 5, quantised, "int8-delta", scales))
    result = current.close()

    # Assert: the exact weights plus its delta, within half an int8 step of the delta (0.05 / 127 / 2)
    assert not np.array_equal(read, weights["w"])
    assert result is not None
    assert np.max(np.abs(result.arrays["w"] - (weights["w"] + (trained["w"] - read)))) <= 0.05 / 254 + 1e-7


def test_one_encoding_is_made_once_a_round_whoever_asks() -> None:
    # Prepare
    current = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=WEIGHTS, target=3,
                           max_num_examples=100, downlink="fp16")

    # Execute
    first, second = current.task(_session("a")), current.task(_session("b"))

    # Assert: the same bytes object, not a second encoding
    assert first is second and current.taken == 2


@pytest.mark.parametrize("downlink", ["fp8", "int4", ""])
def test_a_downlink_that_is_not_a_task_encoding_is_refused_at_start_naming_them(tmp_path: Path,
                                                                                 downlink: str) -> None:
    # Prepare
    (tmp_path / "allow").mkdir()
    (tmp_path / "signing.pub").write_text("a key")
    options = GatewayOptions(coordinator="127.0.0.1:1", devices=tmp_path / "allow", key=tmp_path / "k",
                             ca=None, trust=tmp_path / "signing.pub", insecure=True,
                             settings=GatewaySettings(name="gw", downlink=downlink))
    # Execute / Assert
    with pytest.raises(ConfigError, match="--downlink .*fp32 or fp16 or int8"):
        check_gateway(options)
