"""Secure aggregation inside a gateway's pool (issue 27): the gateway learns only its devices' sum.

Real parts: a gateway's TLS device listener and control port in this process, reference
protocol devices (no Flower on their side of the wire) running the SecAgg+ device steps, the
coordinator's secure-aggregation driver run by the gateway over its pool, the run's signed
training graph on onnxruntime.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedge.aggregate import weighted_mean
from fedge.clients.gateway.protocol import Frame
from fedge.clients.gateway.secure_pool import SecureExchange, check_secure_settings
from fedge.clients.gateway.service import Gateway, GatewaySettings
from fedge.clients.protocol_device import Outcome, ProtocolDevice
from fedge.errors import DeviceProtocolError, FedgeError
from fedge.secagg import ProtocolViolation
from tests.live_gateway import LiveGateway, recomputed

SECURE = {"threshold": 0.5, "neighbours": 0, "clip": 1000.0, "precision": 1e-4, "bits": 32, "weight-clip": 100_000}


@pytest.fixture
def pool(tmp_path: Path, run: dict[str, Any]) -> Iterator[LiveGateway]:
    """A gateway whose secure rounds take its four checked-in phones (their sessions stay live an hour)."""
    with LiveGateway(tmp_path, run, GatewaySettings(name="gw-test", devices_per_round=4, round_deadline_s=600,
                                                   idle_poll_s=1200)) as gateway:
        yield gateway


class Polling:
    """Devices polling their gateway on threads until stopped (what phones do between rounds)."""

    def __init__(self, devices: list[ProtocolDevice]) -> None:
        self.stop, self.trained = threading.Event(), {device.name: 0 for device in devices}
        self.threads = [threading.Thread(target=self._run, args=(device,), daemon=True) for device in devices]
        for device in devices:
            device.check_in()
        for thread in self.threads:
            thread.start()

    def _run(self, device: ProtocolDevice) -> None:
        self.trained[device.name] = device.run(stop=self.stop, max_wait_s=0.05)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def _recording(exchange_answers: list[tuple[str, Frame]]) -> Any:
    """SecureExchange.answer, recording every frame a device sent the gateway."""
    original = SecureExchange.answer

    def answer(self: SecureExchange, device: str, frame: Frame) -> None:
        exchange_answers.append((device, frame))
        original(self, device, frame)
    return answer


def _trained(live: LiveGateway, run: dict[str, Any], names: list[str], server_round: int = 1
             ) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Each device's training recomputed with the same trainer, shard and seed: its weights and examples."""
    return recomputed(live.device("phone0").training_graph()[1], run, names, server_round)


def _expected_mean(live: LiveGateway, run: dict[str, Any], names: list[str], server_round: int = 1
                   ) -> tuple[dict[str, np.ndarray], int]:
    """Each device's training recomputed with the same trainer, shard and seed; their weighted mean."""
    trained, counts = _trained(live, run, names, server_round)
    return weighted_mean(trained, counts), sum(counts)


def _four_phones_round(pool: LiveGateway, monkeypatch: pytest.MonkeyPatch, secure: dict[str, Any]
                       ) -> tuple[dict[str, Any], dict[str, np.ndarray], list[tuple[str, Frame]], Polling]:
    """One secure pool round of phone0-3, each requiring secure aggregation on its own shard, with every frame
    they sent the gateway recorded: the reply's header and arrays, the frames, the (stopped) polling."""
    sent: list[tuple[str, Frame]] = []
    monkeypatch.setattr(SecureExchange, "answer", _recording(sent))
    polling = Polling([pool.device(f"phone{index}", index, secure=True) for index in range(4)])
    try:
        header, arrays = pool.round(secure=secure)
    finally:
        polling.close()
    return header, arrays, sent, polling


def test_a_secure_pool_round_sends_the_pool_mean_and_the_gateway_sees_only_masked_inputs(
        pool: LiveGateway, run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: four phones that require secure aggregation, each on its own shard; the gateway records what they send
    names = [f"phone{index}" for index in range(4)]
    # Execute: the coordinator's train instruction under secure aggregation
    header, arrays, sent, polling = _four_phones_round(pool, monkeypatch, SECURE)
    # Assert: the pool's weighted mean and example count, within the fixed-point step
    mean, examples = _expected_mean(pool, run, names)
    assert header["secure-pool"] == 4 and header["devices"] == 4 and header["num-examples"] == examples
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5
    assert header["metrics"] == {}  # no device's loss either
    # the gateway got each device's five steps, and from the masked step only a masked ring vector
    assert sorted(device for device, _ in sent) == sorted(names * 5)
    masked = [frame for _, frame in sent if "masked/vector" in frame.tensors]
    assert len(masked) == 4 and all(set(frame.tensors) == {"masked/vector"} for frame in masked)
    assert all(frame.tensors["masked/vector"].dtype == np.uint32 for frame in masked)
    assert all(set(frame.header["records"]) == {"secagg-received", "fedge"} for frame in masked)
    plain = [frame for _, frame in sent if any(t.dtype == np.float32 for t in frame.tensors.values())]
    assert plain == [] and sum(polling.trained.values()) == 4


def test_a_secure_round_sends_its_tasks_as_fp32_whatever_the_gateways_downlink(
        pool: LiveGateway, run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    # Prepare: the gateway sends plain rounds' tasks as fp16 to devices that read it (all four phones do); each
    # phone records the dtypes of the float tensors of every secure step it is sent
    monkeypatch.setattr(pool.gateway, "settings", dataclasses.replace(pool.gateway.settings, downlink="fp16"))
    received: list[str] = []
    step = ProtocolDevice._secure_step

    def recording(self: ProtocolDevice, task: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
        received.extend(str(value.dtype) for value in tensors.values() if value.dtype.kind == "f")
        return step(self, task, tensors)
    monkeypatch.setattr(ProtocolDevice, "_secure_step", recording)
    names = [f"phone{index}" for index in range(4)]
    # Execute
    with caplog.at_level(logging.INFO, logger="fedge"):
        header, arrays, _, _ = _four_phones_round(pool, monkeypatch, SECURE)
    # Assert: the model reached the devices as fp32 (the masked sum is taken against it), so the round is the
    # pool's exact mean within the fixed-point step, and the gateway said why its downlink did not apply
    assert received and set(received) == {"float32"}, received
    mean, examples = _expected_mean(pool, run, names)
    assert header["secure-pool"] == 4 and header["num-examples"] == examples
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5
    assert "a secure round sends its tasks as fp32 (--downlink fp16 applies to plain rounds)" in caplog.text


def test_a_secure_pool_under_distributed_dp_sends_the_clipped_uniform_mean_with_the_devices_noise(
        pool: LiveGateway, run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: four phones; distributed DP with an L2 clip of 0.05 and multiplier 1e-3 (noise far below the step)
    names = [f"phone{index}" for index in range(4)]
    # Execute
    header, arrays, sent, _ = _four_phones_round(pool, monkeypatch, {**SECURE, "dp-multiplier": 1e-3, "dp-clip": 0.05})
    # Assert: global + the sum of each device's update clipped to L2 norm 0.05 (over all arrays, by name), over
    # the 4 devices asked, whatever their examples; the pool reports 4 as its weight (DP's fixed denominator)
    trained, _ = _trained(pool, run, names)
    keys = sorted(run["weights"])
    deltas = [np.concatenate([(t[k].astype(np.float64) - run["weights"][k]).ravel() for k in keys]) for t in trained]
    assert max(float(np.linalg.norm(d)) for d in deltas) > 0.05  # clipping matters here
    mean = sum(d * min(1.0, 0.05 / float(np.linalg.norm(d))) for d in deltas) / 4
    got = np.concatenate([(arrays[k].astype(np.float64) - run["weights"][k]).ravel() for k in keys])
    assert header["secure-pool"] == 4 and header["num-examples"] == 4
    # within the step (half of 1e-4 per device) and six standard deviations of the 4 noise shares, each calibrated
    # so 3 of them (the pool's minimum) make 1e-3 x the sensitivity 0.05 x 1e4 + sqrt(d) / 2 ring units
    sigma_sum = 1e-3 * (0.05 * 1e4 + np.sqrt(len(mean)) / 2) * np.sqrt(4 / 3) / 1e4 / 4
    assert float(np.max(np.abs(got - mean))) <= 4 * 0.5e-4 / 4 + 6 * sigma_sum + 1e-6
    masked = [frame for _, frame in sent if "masked/vector" in frame.tensors]
    assert len(masked) == 4 and all(frame.tensors["masked/vector"].dtype == np.uint32 for frame in masked)


def _round_with_phone3(pool: LiveGateway, run: dict[str, Any],
                       kind: type[ProtocolDevice]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One secure pool round of phone0-2 (reference devices) and phone3 of ``kind``, all polling."""
    phone3 = kind(gateway=pool.url, name="phone3", key=pool.allow / "phone3.key", data=run["shards"][3],
                  trust=run["trust"], ca=run["keys"].ca_cert, state_dir=pool.root / "phone3", secure=True)
    polling = Polling([*(pool.device(f"phone{index}", index, secure=True) for index in range(3)), phone3])
    try:
        return pool.round(secure=SECURE)
    finally:
        polling.close()


class LeavingDevice(ProtocolDevice):
    """A phone that goes away after sharing its secrets: it refuses the masked step."""

    def _masked(self, *args: Any, **kwargs: Any) -> Any:
        raise ProtocolViolation("the app was closed")


def test_a_device_that_leaves_after_sharing_is_a_dropout_and_its_masks_are_removed(
        pool: LiveGateway, run: dict[str, Any]) -> None:
    # Prepare: three phones that stay and one that leaves after the share step
    names = ["phone0", "phone1", "phone2"]
    # Execute
    header, arrays = _round_with_phone3(pool, run, LeavingDevice)
    # Assert: the three stayers' mean (the leaver's pairwise masks rebuilt from its shares and removed)
    mean, examples = _expected_mean(pool, run, names)
    assert header["secure-pool"] == 3 and header["num-examples"] == examples and header["rejected"] == 1
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5


class LosingDevice(ProtocolDevice):
    """A phone whose first answer to the masked step is lost on the way (a POST that times out before the
    gateway has it), as on a loaded machine or a flaky network: the gateway then sends the step again."""

    lost = False

    def _result_answer(self, frame: bytes) -> tuple[int, dict[str, Any]]:
        if not LosingDevice.lost and b"secagg-received" in frame:
            LosingDevice.lost = True
            raise TimeoutError("the answer to the masked step timed out on the way")
        return super()._result_answer(frame)


def test_a_secure_step_sent_again_after_its_answer_was_lost_gets_the_same_answer(
        pool: LiveGateway, run: dict[str, Any]) -> None:
    # Prepare: four phones; one loses its masked answer once (before: the step came again, the phone refused it as
    # a replay and the whole pool's round failed)
    names = ["phone0", "phone1", "phone2"]
    LosingDevice.lost = False
    # Execute
    header, arrays = _round_with_phone3(pool, run, LosingDevice)
    # Assert: the answer was lost once, and the round is the mean of all four, none rejected
    mean, examples = _expected_mean(pool, run, [*names, "phone3"])
    assert LosingDevice.lost
    assert header["secure-pool"] == 4 and header["num-examples"] == examples and header["rejected"] == 0
    assert max(float(np.max(np.abs(arrays[k] - mean[k]))) for k in mean) <= 1e-5


def test_a_device_that_requires_secure_aggregation_refuses_a_plain_train_task(live: LiveGateway) -> None:
    # Prepare: a gateway that offers a plain round of 3 (it would see each update); one phone requires secure
    # aggregation
    careful = live.device("phone0", 0, secure=True)
    careful.check_in()
    others = [live.device(f"phone{index}", index) for index in (1, 2, 3)]
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(result=live.round()), daemon=True)
    thread.start()
    while live.gateway.round is None:
        threading.Event().wait(0.02)
    # Execute: the careful phone polls first, then the others answer the round
    outcome = careful.poll()
    outcomes = [device.poll() for device in others]
    thread.join()
    header, _ = box["result"]
    # Assert: the careful phone sent nothing; the round holds the other three
    assert outcome == Outcome("refused", 5.0, 1)
    assert [o.kind for o in outcomes] == ["train"] * 3 and header["devices"] == 3 and header["secure-pool"] == 0


def test_a_pool_too_small_for_secure_aggregation_fails_the_round_naming_why(tmp_path: Path,
                                                                           run: dict[str, Any]) -> None:
    # Prepare: two phones only (each would learn the other's update from the sum)
    small = LiveGateway(tmp_path, run, GatewaySettings(name="gw-small", devices_per_round=0,
                                                                       min_devices=1, round_deadline_s=0.5,
                                                                       idle_poll_s=1200))
    try:
        for name in ("phone0", "phone1"):
            small.device(name).check_in()
        # Execute / Assert
        with pytest.raises(FedgeError, match="at least 3 devices in a gateway's pool, 2 are checked in"):
            small.round(secure=SECURE)
    finally:
        small.close()


@pytest.mark.parametrize(("case", "settings"), [
    ("not an object", None), ("a missing key", {k: v for k, v in SECURE.items() if k != "bits"}),
    ("a text value", {**SECURE, "clip": "big"}), ("a boolean", {**SECURE, "neighbours": True}),
])
def test_malformed_secure_settings_are_refused(case: str, settings: Any) -> None:
    with pytest.raises(FedgeError, match="'secure' must hold numbers"):
        check_secure_settings(settings if settings is not None else "secure")


def _check_in_body(live: LiveGateway, name: str, capabilities: list[str] | None) -> dict[str, Any]:
    from fedge.clients.gateway.protocol import b64, check_in_message  # noqa: PLC0415
    from fedge.clients.protocol_device import load_private_key, sign  # noqa: PLC0415

    issued, nonce = int(time.time()), b64(os.urandom(16))
    signature = sign(load_private_key(live.allow / f"{name}.key"),
                     check_in_message(device=name, gateway="gw-test", issued_at=issued, nonce=nonce))
    body = {"device": name, "time": issued, "nonce": nonce, "signature": b64(signature)}
    return body if capabilities is None else {**body, "capabilities": capabilities}


@pytest.mark.parametrize(("capabilities", "secure_run", "outcome"), [
    (None, True, "secure"),  # a device that does not say: it implements everything (the Python reference client)
    (["fp32", "int8-delta", "secure-aggregation"], True, "secure"),
    (["fp32", "int8-delta"], False, "plain"),  # a browser, while the run is not secure: admitted, left out of pools
    (["fp32", "int8-delta"], True, "this run uses secure aggregation, which this device does not implement"),
    ("secure-aggregation", False, "'capabilities' must be a list of names"),
])
def test_a_device_that_cannot_do_secure_aggregation_is_refused_at_check_in_by_a_secure_run(
        pool: LiveGateway, capabilities: Any, secure_run: bool, outcome: str) -> None:
    # Prepare: a gateway whose coordinator has (or has not yet) asked for a secure round
    sessions = pool.gateway.sessions
    sessions.secure_run = secure_run
    body = _check_in_body(pool, "phone0", capabilities)
    # Execute / Assert
    if outcome in ("secure", "plain"):
        _, _, session = sessions.check_in(body)
        assert session.secure == (outcome == "secure")
        assert sessions.live_devices(60, secure=True) == (["phone0"] if outcome == "secure" else [])
    else:
        with pytest.raises(DeviceProtocolError, match=re.escape(outcome)):
            sessions.check_in(body)


def test_during_a_secure_round_only_its_pool_is_told_to_come_back_soon(tmp_path: Path) -> None:
    # Prepare: a gateway idling at 30 s between polls, in a secure round whose pool is phone0
    (tmp_path / "allow").mkdir()
    gateway = Gateway(GatewaySettings(idle_poll_s=30), tmp_path / "allow", None)
    gateway.exchange = SecureExchange(lambda device: 0)
    gateway.exchange.members.add("phone0")
    # Execute
    member, outsider = gateway.next_in_s("phone0"), gateway.next_in_s("phone9")
    # Assert: the pool within a second, the others at the idle pace (0.5-1.5 x 30 s)
    assert 0.2 <= member <= 1.0 and 15.0 <= outsider <= 45.0
