"""A robust rule inside a plain gateway (issue 42 §3): ``GatewaySettings(device_rule="median")`` replies with
the coordinate-wise median of its devices' updates instead of their weighted mean, so one hostile protocol
device moves its gateway's reply only within the honest devices' spread (not one unit of trust per gateway).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.aggregate import update_norm
from fedge.clients.gateway.pool import GatewayRound
from fedge.clients.gateway.protocol import PREFIX, decode_frame, encode_frame
from fedge.clients.gateway.service import GatewaySettings
from fedge.clients.protocol_device import ProtocolDevice
from fedge.errors import ConfigError
from tests.live_gateway import LiveGateway

BOUNDS = {"max-device-examples": 10_000, "max-update-norm": 10.0}


def _send(device: ProtocolDevice, fields: dict[str, Any], tensors: dict[str, np.ndarray]) -> int:
    """``device`` answers the open task with ``fields`` and ``tensors`` of its choosing."""
    _, _, body = device._authenticated("GET", f"{PREFIX}/task")
    task = decode_frame(body)[0].header
    header = {"task": task["task"], "kind": "train", "encoding": "fp32", **fields}
    code, _, answer = device._authenticated("POST", f"{PREFIX}/result", encode_frame(header, tensors))
    json.loads(answer)
    return code


@pytest.mark.parametrize("device_rule", ["median", "mean"])
def test_one_hostile_protocol_device_is_bounded_by_the_median_inside_its_gateway(
        tmp_path: Path, run: dict[str, Any], device_rule: str) -> None:
    # Prepare: a gateway whose rounds take four protocol devices; three honest ones send the global weights plus
    # 0.01, 0.02 and 0.03 in every entry (100 examples each); the attacker sends weights far away (every entry
    # + 3.0, clipped at the gateway to max-update-norm = 10: 10 / sqrt(P) an entry, above 0.03) and claims 99,000
    # examples (capped at 10,000)
    settings = GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=300, idle_poll_s=0.2,
                               device_rule=device_rule)
    weights = run["weights"]
    entries = sum(value.size for value in weights.values())
    clipped = 10.0 / np.sqrt(entries)  # the attacker's entry once its update is clipped to norm 10
    with LiveGateway(tmp_path, run, settings) as live:
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.update(result=live.round(config=BOUNDS)), daemon=True)
        thread.start()
        while live.gateway.round is None:
            thread.join(0.02)
        # Execute: the four answers, through the gateway's device protocol (TLS, sessions, checks)
        codes = [_send(live.device(f"phone{i}", i), {"num-examples": 100, "metrics": {"train-loss": 0.1}},
                       {name: value + step for name, value in weights.items()})
                 for i, step in enumerate([0.01, 0.02, 0.03])]
        codes.append(_send(live.device("phone3", 3), {"num-examples": 99_000, "metrics": {"train-loss": 0.1}},
                           {name: value + 3.0 for name, value in weights.items()}))
        thread.join()
    header, arrays = box["result"]
    moved = {name: arrays[name] - weights[name] for name in weights}
    # Assert: the median of 0.01, 0.02, 0.03 and the attacker's entry is (0.02 + 0.03) / 2 = 0.025 in every
    # entry, within the honest devices' range; the weighted mean is pulled to (1 + 2 + 3 + 10,000 x 100 x
    # clipped) / 10,300, about 0.97 x the attacker's clipped entry
    assert codes == [200] * 4 and header["devices"] == 4 and header["clipped"] >= 1
    # ... and it reports its devices' median update norm before clipping (update-norm-bound = median reads it):
    # the norms are 0.01, 0.02, 0.03 and 3 times sqrt(P), so the median is 0.025 sqrt(P)
    assert header["device-norm-median"] == pytest.approx(0.025 * np.sqrt(entries), rel=1e-4)
    expected = 0.025 if device_rule == "median" else (100 * 0.06 + 10_000 * clipped) / 10_300
    for name, change in moved.items():
        np.testing.assert_allclose(change, expected, atol=1e-4, err_msg=name)
    if device_rule == "median":
        assert update_norm(arrays, weights) <= 0.03 * np.sqrt(entries)


def test_an_unknown_device_rule_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(ConfigError, match="use one of mean, median, trimmed-mean"):
        GatewaySettings(device_rule="krum")
    with pytest.raises(ConfigError, match=r"give a fraction in \[0, 0.5\)"):
        GatewaySettings(device_rule="trimmed-mean", device_trim_fraction=0.5)


def test_the_trimmed_mean_inside_a_gateway_cuts_each_end() -> None:
    # Prepare: a gateway round over five devices' updates (x = 1, 2, 3, 4, 100), trim 0.2: one cut at each end
    weights = {"w": np.zeros(1, np.float32)}
    current = GatewayRound(kind="train", server_round=1, config={}, graph="", weights=weights, target=5,
                           max_num_examples=1000, device_rule="trimmed-mean", trim_fraction=0.2)
    for index, value in enumerate([1.0, 2.0, 3.0, 4.0, 100.0]):
        current._fold(f"d{index}", {"w": np.array([value], np.float32)}, 10, {}, 10, 1)
    # Execute
    result = current.close()
    # Assert: (2 + 3 + 4) / 3 = 3; the weight is still the devices' total
    assert result is not None and result.num_examples == 50
    np.testing.assert_allclose(result.arrays["w"], [3.0])


def test_a_trimmed_mean_that_cuts_no_device_says_its_reply_is_a_plain_mean(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: four devices at trim 0.2: floor(0.8) = 0 cut at each end
    current = GatewayRound(kind="train", server_round=3, config={}, graph="", weights={"w": np.zeros(1, np.float32)},
                           target=4, max_num_examples=1000, device_rule="trimmed-mean", trim_fraction=0.2)
    for index, value in enumerate([1.0, 2.0, 3.0, 100.0]):
        current._fold(f"d{index}", {"w": np.array([value], np.float32)}, 10, {}, 10, 1)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge"):
        result = current.close()
    # Assert: the plain mean (106 / 4), and a line that says so
    assert result is not None
    np.testing.assert_allclose(result.arrays["w"], [26.5])
    assert "round 3: the trimmed mean cuts no device at either end of 4 (trim fraction 0.2)" in caplog.text
