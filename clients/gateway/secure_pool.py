"""Secure aggregation inside a gateway's pool: the gateway learns only its devices' sum.

When the run asks for ``secure-aggregation`` over gateways, each gateway runs SecAgg+
(Bonawitz et al., CCS 2017; Bell et al., CCS 2020) over the protocol devices it serves,
and replies to the coordinator with the unmasked pool mean and its total weight: the
coordinator sees gateways' sums, the gateway its pool's sum, nobody one device's update.

Nothing of the protocol is written again here. The gateway runs the coordinator's own
side, :class:`fedge.strategies.drivers.secure.SecureAggregation` (every check of who
sent what, dropouts, bad-share reruns, the unmasking), over a :class:`PoolGrid`: a Flower
``Grid`` whose nodes are the gateway's checked-in devices and whose messages travel as
device-protocol frames (the step's records as JSON, its arrays as tensors; see
``docs/device-protocol.md``, "Secure aggregation"). The devices run the device side,
:mod:`fedge.clients.secagg_device`, the same functions a SuperNode's ClientApp runs.

Threat model: as :mod:`fedge.secagg`, with the gateway in the coordinator's seat. Devices
enforce the protocol themselves, so a gateway that deviates learns no more than the sum of
the devices that finished; a device that requires secure aggregation refuses plain train
tasks (:class:`fedge.clients.protocol_device.ProtocolDevice`), so a gateway cannot ask it
for its update in the clear. What the protocol does not stop without a PKI (key
substitution, Sybil devices the gateway makes up) it does not stop here either; the
coordinator only knows the pool's size from the gateway's word.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedge import knobs
from fedge.clients.gateway.pool import refused
from fedge.clients.gateway.protocol import (
    DEVICE_SEED,
    TASK_ID,
    Frame,
    assemble_frame,
    frame_tensors,
    records_from_json,
    records_to_json,
)
from fedge.distributed_noise import DP_CLIP, DistributedNoise
from fedge.errors import ConfigError
from fedge.strategies.drivers.secure import MIN_DEVICES, SecureAggregation
from fedge.strategies.rounds import FixedSampling, Rounds
from fedge.strategies.rule import Mean
from fedge.strategies.selection import RandomSelector
from fedge.strategies.validation import POOL_CLIPPING

log = logging.getLogger("fedge.gateway")
DEVICE_ERROR = 1  # the code of a device's refusal as the driver sees it (Flower's ClientApp exception)
SECURE_KEYS = ("threshold", "neighbours", "clip", "precision", "bits", "weight-clip")
DP_MULTIPLIER = "dp-multiplier"
DP_KEYS = (DP_MULTIPLIER, DP_CLIP)
"""Distributed DP's settings in ``secure`` (both or neither): the noise multiplier and the L2 clip."""


def pool_node_id(device: str) -> int:
    """A device's node id inside its gateway's pool: stable, from its name (1 .. 2^48, exact as a JSON
    number in every language: JavaScript's numbers hold integers up to 2^53)."""
    return int.from_bytes(hashlib.sha256(device.encode()).digest()[:6], "big") + 1


@dataclass
class Step:
    """One message of a secure round waiting for its device: the frame it is sent as, and the reply."""

    task: str
    message: Message
    frame: bytes
    reply: Message | None = None


class SecureExchange:
    """The steps in flight between a gateway's :class:`PoolGrid` and its devices' polls.

    The grid posts one :class:`Step` per device and waits; a device's ``GET /v1/task`` gets
    its step's frame, its ``POST /v1/result`` becomes the reply (a malformed one is refused
    with 422 and the device counts as a dropout of that step).
    """

    def __init__(self, seeds: Callable[[str], int], graph: str = "") -> None:
        self._steps: dict[str, Step] = {}  # by device name
        self._seeds, self.graph = seeds, graph
        self.members: set[str] = set()  # the devices this round posted steps to (they are paced to come back soon)
        self._changed = threading.Condition()

    def post(self, messages: Iterable[Message], devices: Mapping[int, str], server_round: int) -> list[Step]:
        """Post each message for its device (replacing any step it had not answered).

        The frames are built before the lock is taken (devices' polls wait on it), and each
        distinct array record is encoded once (the masked step sends every device the same model).
        """
        encoded: dict[tuple[int, ...], tuple[list[dict[str, Any]], bytes]] = {}
        posted = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid4().hex
            device, task = devices[message.metadata.dst_node_id], secrets.token_hex(8)
            posted.append((device, Step(task, message, _step_frame(message, task, server_round, self._seeds(device),
                                                                   self.graph, encoded))))
        with self._changed:
            for device, step in posted:
                self._steps[device] = step
                self.members.add(device)
        return [step for _, step in posted]

    def wait(self, steps: list[Step], timeout: float) -> list[Message]:
        """The replies to ``steps`` once all came, or those that came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while any(step.reply is None for step in steps):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 1.0))
            for device in [d for d, s in self._steps.items() if s in steps]:
                del self._steps[device]
        return [step.reply for step in steps if step.reply is not None]

    def task_for(self, device: str) -> bytes | None:
        """The frame of ``device``'s unanswered step, if any."""
        with self._changed:
            step = self._steps.get(device)
            return None if step is None or step.reply is not None else step.frame

    def answer(self, device: str, frame: Frame) -> None:
        """Take ``device``'s reply to its step; :class:`DeviceProtocolError` (409/422) if it is not one."""
        with self._changed:
            step = self._steps.get(device)
            if step is None or step.reply is not None or frame.header.get(TASK_ID) != step.task:
                raise refused(409, "this result answers no secure-aggregation step of this device in flight "
                                    "(the step it belonged to is over); ask for the current task")
            step.reply = _reply_message(step.message, frame)
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Steps posted and not answered yet."""
        with self._changed:
            return sum(step.reply is None for step in self._steps.values())


def _step_frame(message: Message, task: str, server_round: int, seed: int, graph: str,
                encoded: dict[tuple[int, ...], tuple[list[dict[str, Any]], bytes]]) -> bytes:
    """A secure-aggregation step as a device-protocol frame: records as JSON, arrays as tensors (``encoded``
    keeps each set of array records' tensors, encoded once, by the records' identities)."""
    action = message.metadata.message_type.partition(".")[2]
    records = list(message.content.array_records.items())
    key = tuple(id(record) for _, record in records)
    if key not in encoded:
        encoded[key] = frame_tensors({f"{name}/{k}": array.numpy() for name, record in records
                                      for k, array in record.items()})
    header = {"kind": "secagg", "action": action, TASK_ID: task, "node": message.metadata.dst_node_id,
              "server-round": server_round, DEVICE_SEED: seed, "graph": graph,
              "records": records_to_json({name: dict(record) for name, record in
                                          message.content.config_records.items()})}
    return assemble_frame(header, *encoded[key])


def _reply_message(message: Message, frame: Frame) -> Message:
    """A device's answer to a step as the Flower reply the driver reads (its refusal as an error reply)."""
    refusal = frame.header.get("error")
    if refusal is not None:
        return Message(Error(code=DEVICE_ERROR, reason=f"the device refused: {str(refusal)[:300]}"), reply_to=message)
    records = records_from_json(frame.header.get("records", {}), "records")
    content = RecordDict()
    try:
        for name, values in records.items():
            content[name] = ConfigRecord(values)  # type: ignore[arg-type]  # checked by records_from_json
        arrays: dict[str, dict[str, Array]] = {}
        for key, tensor in frame.tensors.items():
            name, _, array = key.partition("/")
            arrays.setdefault(name, {})[array] = Array(np.ascontiguousarray(tensor))
        for name, values in arrays.items():
            content[name] = ArrayRecord(values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise refused(422, f"the step's records are malformed ({exc})") from None
    return Message(content, reply_to=message)


def _adopt_identity() -> None:
    """Give this process a Flower task identity if it has none (Flower messages need one).

    The gateway's SuperNode runs its ClientApp in another process, so the gateway process
    has none: its pool is run 0, and this process speaks as its coordinator (node 1).
    """
    try:
        TaskIdentity.run_id  # noqa: B018 - the property raises when unset
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 1


class PoolGrid(Grid):
    """A Flower ``Grid`` over one gateway's devices: what :class:`SecureAggregation` drives.

    Its nodes are the pool's devices (:func:`pool_node_id`); ``send_and_receive`` posts each
    message to its device's next poll and returns the replies that came within ``timeout``.
    """

    def __init__(self, exchange: SecureExchange, devices: Mapping[int, str], server_round: int) -> None:
        self.exchange, self.devices, self.server_round = exchange, dict(devices), server_round
        self._run = Run.create_empty(0)
        _adopt_identity()

    def get_node_ids(self) -> Iterable[int]:
        """The pool's devices."""
        return list(self.devices)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Post each message to its device, wait for the replies (up to ``timeout`` seconds)."""
        steps = self.exchange.post(messages, self.devices, self.server_round)
        return self.exchange.wait(steps, 3600.0 if timeout is None else timeout)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Not used by the secure driver (it sends and receives a step at a time)."""
        raise NotImplementedError("a PoolGrid sends a step at a time: use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Not used by the secure driver."""
        raise NotImplementedError("a PoolGrid sends a step at a time: use send_and_receive")

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        """Deprecated in Flower; kept because ``Grid`` declares it abstract."""
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl, group_id=group_id)

    def set_run(self, run: Run) -> None:
        """A pool has no Flower run of its own."""

    @property
    def run(self) -> Run:
        """An empty run (the pool is not a Flower federation)."""
        return self._run


@dataclass(frozen=True)
class PoolSum:
    """A secure pool round's outcome: the new weights (global + the pool's weighted mean change),
    the pool's total weight, and how many devices' masked inputs are in the sum."""

    arrays: dict[str, np.ndarray]
    weight: float
    devices: int
    clipping: dict[str, int] = field(default_factory=dict)  # what the devices' encodings clipped (POOL_CLIPPING)


def check_secure_settings(raw: object) -> dict[str, float]:
    """The coordinator's secure-aggregation settings from a control header, each a number."""
    if not isinstance(raw, dict) or not all(_number(raw.get(key)) for key in SECURE_KEYS):
        raise refused(400, f"control: 'secure' must hold numbers {', '.join(SECURE_KEYS)}")
    if any(key in raw for key in DP_KEYS) and not all(_number(raw.get(key)) and raw[key] > 0 for key in DP_KEYS):
        raise refused(400, f"control: distributed DP in 'secure' needs positive numbers {', '.join(DP_KEYS)}")
    return {key: float(raw[key]) for key in (*SECURE_KEYS, *DP_KEYS) if key in raw}


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class PoolNoise:
    """Distributed DP over a gateway's pool: the coordinator's multiplier and clip, calibrated to this pool.

    Each pool's sum, which its gateway unmasks, carries the calibrated noise on its own (at
    least :data:`MIN_DEVICES` shares, or ``min-train-replies``): a gateway sees no noise-free
    sum, and the coordinator, which sees the sum of pools, accounts each round at this floor
    (:meth:`fedge.server.privacy.DistributedPrivacy.release_pools`). The gateway accounts nothing.
    """

    wrapper = None
    client_side = False

    def __init__(self, *, multiplier: float, clip: float, devices: int) -> None:
        self.multiplier, self.clipping_norm, self.num_sampled = multiplier, clip, devices

    def noise(self, *, scale: float, dimension: int, min_survivors: int, bits: int) -> DistributedNoise:
        """The pool's encoding: shares calibrated so ``min_survivors`` of them make the multiplier."""
        return DistributedNoise.calibrated(multiplier=self.multiplier, clip=self.clipping_norm, scale=scale,
                                           dimension=dimension, min_survivors=min_survivors, bits=bits)

    def release_sum(self, noise: DistributedNoise, *, survivors: int, dimension: int) -> float:
        """Nothing to account here (the coordinator does): NaN, the gateway's "not accounted"."""
        return float("nan")

    def release_pools(self) -> float:
        """Not used in a pool (the coordinator releases the round of pools)."""
        return float("nan")

    def attach(self, strategy: Any) -> None:
        """No Flower strategy to wrap in a gateway's pool."""

    def release(self) -> float:
        """Not used: the secure driver releases through :meth:`release_sum`."""
        return float("nan")

    def state_dict(self) -> dict[str, Any]:
        """No state: a pool round starts from the coordinator's settings."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state to restore."""


def secure_pool_round(exchange: SecureExchange, devices: Mapping[int, str], *, server_round: int,
                      weights: Mapping[str, np.ndarray], config: Mapping[str, Any], secure: Mapping[str, float],
                      step_timeout_s: float) -> PoolSum:
    """Run SecAgg+ over ``devices`` with the coordinator's driver; the unmasked pool result.

    Raises
    ------
    DeviceProtocolError
        (503) Fewer than 3 devices, or the protocol could not finish (too many dropouts,
        bad shares three times); the gateway then fails the coordinator's round, keeping
        the global model, as a failed secure round does.
    """
    if len(devices) < MIN_DEVICES:
        raise refused(503, f"secure aggregation needs at least {MIN_DEVICES} devices in a gateway's pool, "
                            f"{len(devices)} are checked in (with 2, each learns the other's update from the sum)")
    count = len(devices)
    try:
        driver = SecureAggregation(threshold=secure["threshold"], neighbours=int(secure["neighbours"]),
                                   clip=secure["clip"], precision=secure["precision"], bits=int(secure["bits"]),
                                   weight_clip=secure["weight-clip"])
        privacy = (PoolNoise(multiplier=secure[DP_MULTIPLIER], clip=secure[DP_CLIP], devices=count)
                   if DP_MULTIPLIER in secure else None)
        rounds = Rounds("the gateway's secure pool", Mean(), clients_per_round=count, min_train_replies=MIN_DEVICES,
                        sampling=FixedSampling(min_train_nodes=count, min_available_nodes=count, fraction_evaluate=0.0),
                        wait_for_nodes_s=0.0, flower_lines=False, privacy=privacy,
                        selector=RandomSelector(int(config.get(knobs.SEED, 0))))
        driver.bind(rounds)
        grid = PoolGrid(exchange, devices, server_round)
        arrays = ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in weights.items()})
        new, metrics = driver.train_round(rounds, grid, server_round, arrays, ConfigRecord(dict(config)),
                                          step_timeout_s)
    except ConfigError as exc:  # e.g. secagg-bits too narrow for this pool's size
        raise refused(503, f"round {server_round}: secure aggregation over this gateway's {count} devices cannot "
                            f"run: {exc}") from None
    if new is None or metrics is None:
        failures = "; ".join(f"{r.node_id}: {r.reason}" for r in rounds.state.reports[-1].failed[:3])
        raise refused(503, f"round {server_round}: secure aggregation over this gateway's pool did not finish "
                            f"({failures or 'too few devices finished'}); the coordinator keeps its model")
    clipping = {key: int(metrics.get(key, 0)) for key in POOL_CLIPPING}  # type: ignore[call-overload]
    return PoolSum({name: array.numpy() for name, array in new.items()}, float(metrics["weight"]),  # type: ignore[arg-type]
                   int(metrics["accepted"]), clipping)  # type: ignore[arg-type]

