"""Secure aggregation clips the update, not the weighted update, and counts whatever it clips (issue 39 §1).

Before: devices encoded ``w * delta`` clipped at ``secagg-clip``, so with ``secagg-clip = 10`` a device
holding hundreds of examples had its update cut silently (a secure run differed from its plaintext twin
by 0.47 below). Now each device clips ``delta`` per entry at ``secagg-clip``, weights it, and the weighted
value travels in a range of ``secagg-clip x max-num-examples`` (or the ring's whole range, if that is
less); what is still clipped is counted inside the masked vector and only the round's total is revealed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedge import wire
from fedge.clients.secagg_device import Trained, encode_update
from fedge.clients.secure import add_secure_handlers
from fedge.secagg import FixedPoint, ring_add, ring_range
from fedge.server.checkpoint import load_checkpoint
from fedge.simulation.grid import InlineGrid
from fedge.simulation.runner import simulate
from fedge.strategies.drivers.secure import Clipping, SecureAggregation
from fedge.strategies.fedavg import FedAvg
from fedge.strategies.selection import RandomSelector


class StubFleet:
    """Devices running fedge's own secure-aggregation handlers whose training returns a known update and
    weight (``devices[partition] = (examples, delta)``); the global model is zero."""

    def __init__(self, devices: list[tuple[int, list[float]]]) -> None:
        self.devices = devices
        self.app = ClientApp()
        add_secure_handlers(self.app, self._train)

    def _train(self, msg: Message, context: Context) -> RecordDict:
        examples, delta = self.devices[int(context.node_config["partition-id"])]
        return RecordDict({wire.ARRAYS: ArrayRecord({"w": Array(np.array(delta))}),
                           wire.METRICS: MetricRecord({wire.NUM_EXAMPLES: examples}),
                           wire.REPLY_META: ConfigRecord({wire.SERVER_ROUND: 1, wire.PROFILE: "laptop"})})

    def round(self, driver: SecureAggregation) -> tuple[np.ndarray, MetricRecord]:
        """One secure round over every device: the new model (the weighted mean update) and the round's metrics."""
        count = len(self.devices)
        nodes = [{"partition-id": i, "num-partitions": count, "profile": "laptop"} for i in range(count)]
        strategy = FedAvg(driver=driver, clients_per_round=count, min_train_replies=3, fraction_train=1.0,
                          min_train_nodes=count, min_available_nodes=count, wait_for_nodes_s=0.0, flower_lines=False,
                          fraction_evaluate=0.0, selector=RandomSelector(0))
        grid = InlineGrid(self.app, nodes, {})
        new, metrics = driver.train_round(strategy.rounds, grid, 1, ArrayRecord({"w": Array(np.zeros(2))}),
                                          ConfigRecord({}), 30.0)
        assert new is not None and metrics is not None
        return new["w"].numpy(), metrics


def test_a_device_with_hundreds_of_examples_is_not_clipped_at_secagg_clip() -> None:
    # Prepare: secagg-clip = 10; 400, 300 and 200 examples; every |delta| <= 0.5, but w * delta reaches 90
    fleet = StubFleet([(400, [0.05, -0.25]), (300, [0.1, 0.02]), (200, [0.45, 0.5])])
    driver = SecureAggregation(clip=10.0, precision=1e-4, bits=32, weight_clip=1000.0)
    # Execute
    mean, metrics = fleet.round(driver)
    # Assert: the plaintext weighted mean, (20 + 30 + 90) / 900 and (-100 + 6 + 100) / 900, within the
    # quantisation step (half a step of 1e-4 per device on w * delta, over 900 examples); before, each w * delta
    # was clipped to 10: (10 + 10 + 10) / 900 = 0.033, off by 0.12. Nothing was clipped, and the round says so
    np.testing.assert_allclose(mean, [140 / 900, 6 / 900], rtol=0, atol=3 * 0.5e-4 / 900 + 1e-8)
    assert driver.clipping == {1: Clipping(entries=0, devices=0, weights=0)}
    assert (metrics["secagg-clipped-entries"], metrics["secagg-clipped-devices"],
            metrics["secagg-capped-weights"]) == (0, 0, 0)


def test_what_is_still_clipped_is_counted_for_the_round_and_said_on_the_console(
        caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: secagg-clip = 10, at most 1,000 examples, a 32-bit ring at step 1e-6: the ring holds
    # floor((2^31 - 1) / 3) = 715,827,882 steps a device, so |w * delta| up to 715.827882 (< 10 x 1,000).
    # Device 0 (400 examples) sends delta 12 (clipped to 10 on the update, then 400 x 10 = 4,000 beyond the
    # ring's range: one entry, counted once); device 1 claims 1,500 examples (capped at 1,000); device 2 nothing
    fleet = StubFleet([(400, [0.05, 12.0]), (1500, [0.1, 0.02]), (200, [0.45, 0.5])])
    driver = SecureAggregation(clip=10.0, precision=1e-6, bits=32, weight_clip=1000.0)
    # Execute
    with caplog.at_level(logging.WARNING, logger="fedge.strategies.secure"):
        mean, metrics = fleet.round(driver)
    # Assert: the counts are the round's totals (1 entry, 1 device, 1 weight capped), in the driver, the
    # round's metrics and a console line; the mean is what was encoded: (20 + 100 + 90) / 1,600 and
    # (715.827882 + 20 + 100) / 1,600
    assert driver.clipping == {1: Clipping(entries=1, devices=1, weights=1)}
    assert (metrics["secagg-clipped-entries"], metrics["secagg-clipped-devices"],
            metrics["secagg-capped-weights"]) == (1, 1, 1)
    np.testing.assert_allclose(mean, [210 / 1600, 835.827882 / 1600], rtol=0, atol=3 * 0.5e-6 / 1600 + 1e-8)
    lines = [record.getMessage() for record in caplog.records]
    assert ("round 1: secure aggregation clipped 1 update entries on 1 device(s) (|delta| above secagg-clip = 10, "
            "or |w * delta| above the ring's range at secagg-bits = 32): the model differs from plaintext "
            "aggregation there; raise secagg-clip (or secagg-bits)") in lines
    assert "round 1: secure aggregation capped 1 device weight(s) at 1000 examples (max-num-examples)" in lines


def test_a_device_clips_its_update_then_weights_it_and_counts_what_it_clipped() -> None:
    # Prepare: 400 examples; delta 0.05, -0.3, 12 and -20; update clip 10, weighted range 4,500 (of 10 x 1,000
    # at most), counts up to 4 entries a device
    params = {"clip": 4500.0, "scale": 1e4, "bits": 32, "update-clip": 10.0, "count-clip": 4.0,
              "weight-clip": 1000.0, "weight-scale": 2.0**10, "work-clip": 1000.0, "work-scale": 2.0**10,
              "work-cap": 1.0, "work-momentum": -1.0}
    trained = Trained(arrays={"w": np.array([0.05, -0.3, 12.0, -20.0])}, num_examples=400, steps=3)
    # Execute
    vector = encode_update({"w": np.zeros(4)}, trained, params)
    # Assert: 400 x [0.05, -0.3, 10, -10] (before: each 400 x delta cut to the clip: 4,500 for 12 x 400 = 4,800),
    # then w = 400, w * a = 400, and the counts: 2 entries clipped, 1 device that clipped, no weight capped
    decode = FixedPoint(4500.0, 1e4, 32).decode_sum
    np.testing.assert_allclose(decode(vector[:4], 1), [20.0, -120.0, 4000.0, -4000.0], rtol=0, atol=1e-12)
    assert FixedPoint(1000.0, 2.0**10, 32).decode_sum(vector[4:6], 1).tolist() == [400.0, 400.0]
    assert FixedPoint(4.0, 1.0, 32).decode_sum(vector[6:], 1).tolist() == [2.0, 1.0, 0.0]


@pytest.mark.parametrize("bits", [8, 32, 64])
def test_the_rings_range_holds_every_device_at_its_edge(bits: int) -> None:
    # Prepare: 3 devices all at the edge of the range the ring holds for 3 at step 1/2^4
    limit = ring_range(3, 2.0**4, bits)
    codec = FixedPoint(limit, 2.0**4, bits)
    # Execute
    total = codec.encode(np.array([limit, -limit]))
    for _ in range(2):
        total = ring_add(total, codec.encode(np.array([limit * 2, -limit * 2])), bits)  # clipped to the edge
    # Assert: the three sum without overflow
    assert codec.fits(3) and codec.decode_sum(total, 3).tolist() == [3 * limit, -3 * limit]


def test_the_rings_range_is_a_whole_number_of_steps_a_device() -> None:
    # Assert: floor((2^7 - 1) / 3) = 42 steps of 1/16; floor((2^31 - 1) / 3) = 715,827,882 steps of 1e-6
    assert ring_range(3, 2.0**4, 8) == 2.625
    assert ring_range(3, 1e6, 32) == 715.827882


def test_a_secure_run_at_secagg_clip_10_gives_its_plaintext_twins_model(tmp_path: Path) -> None:
    # Prepare: digits on 6 laptops (about 100 to 320 examples each), secagg-clip = 10 (the setting)
    base: dict[str, Any] = {"fleet": "laptop=6", "clients-per-round": 6, "num-rounds": 2, "model": "mlp",
                            "local-epochs": 2, "export-onnx": False, "secagg-clip": 10.0}
    # Execute: the same run with and without secure aggregation
    plain, _ = simulate({**base, "run-dir": str(tmp_path / "plain")}, progress=False)
    secure, _ = simulate({**base, "secure-aggregation": True, "run-dir": str(tmp_path / "secure")}, progress=False)
    # Assert: equal up to quantisation (before: 0.47 apart, every w * delta cut to 10)
    plain_arrays = load_checkpoint(plain / "checkpoint.npz").arrays
    secure_arrays = load_checkpoint(secure / "checkpoint.npz").arrays
    assert max(float(np.abs(secure_arrays[k] - plain_arrays[k]).max()) for k in plain_arrays) < 1e-5
