"""Every device reply is checked here before it can touch the global model.

Threat model: a device may be buggy or hostile. It can send arrays of the wrong
names, shapes or dtypes, NaN/Inf values, an absurd or non-positive sample count
(to dominate a weighted mean), a stale reply from an earlier round, bytes
that do not decode, or meta of the wrong type or out of range (``"lots"`` or
``inf`` samples processed, ``2**62`` local steps: read only through
:func:`fedge.wire.read_reply_meta`). Each such reply is rejected with a reason naming the
problem, logged with the sender's node id, and left out; the rest of the round
goes on. Validation cannot detect a well-formed but poisoned update: that is
what robust aggregation (trimmed mean, median, Krum) is for.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from fedge import wire
from fedge.aggregate import clip_update
from fedge.codec import decode_update, is_encoded
from fedge.errors import UpdateRejected
from fedge.npy import read_npy_header

NUMPY_STYPE = "numpy.ndarray"  # Flower's SType.NUMPY: an .npy blob

log = logging.getLogger("fedge.strategies.validation")

ArraySpec = dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Rejection:
    """One reply that was left out, and why."""

    node_id: int
    reason: str


# a gateway's secure pool reply: what the devices' encodings clipped in its pool (the driver's
# Clipping.metrics(), totals over the pool's devices), in its reply meta; RoundReport's fields with "_" for "-"
POOL_CLIPPING = ("secagg-clipped-entries", "secagg-clipped-devices", "secagg-capped-weights")


@dataclass(frozen=True)
class AcceptedUpdate:
    """A reply that passed validation, decoded."""

    node_id: int
    arrays: dict[str, NDArray[np.generic]]
    weight: float
    content: RecordDict
    meta: wire.ReplyMeta | None = None
    clipped: bool = False  # a gateway's update, clipped to max-update-norm here
    pool_clipping: Mapping[str, int] = field(default_factory=dict)  # a secure pool's counts (POOL_CLIPPING)
    norm: float | None = None  # a gateway's update: its L2 norm before clipping


@dataclass(frozen=True)
class DeviceTierBounds:
    """What bounds a gateway's reply (security round 3): it stands for at most ``max_gateway_devices``
    devices, each weighted at most ``max_device_examples``, and its update is clipped to an L2 norm
    of ``max_update_norm`` (0: not clipped), as its gateway clipped each device's."""

    max_device_examples: int = 10_000
    max_gateway_devices: int = 10_000
    max_update_norm: float = 10.0


@dataclass(frozen=True)
class Failure(Rejection):
    """A device that answered with an error instead of an update.

    ``systematic``: the device's code raised (or could not be loaded), which the next round
    repeats unless something changes; False for a device that was unreachable or crashed.
    """

    systematic: bool = True


# Flower's error codes of a reply whose ClientApp raised, could not load, or refused (a mod's precondition,
# an invalid app): not a device that went away (MESSAGE/REPLY/NODE_UNAVAILABLE, CLIENT_APP_CRASHED)
SYSTEMATIC_ERRORS = frozenset({ErrorCode.UNKNOWN, ErrorCode.LOAD_CLIENT_APP_EXCEPTION,
                               ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.MOD_FAILED_PRECONDITION,
                               ErrorCode.INVALID_FAB})


def spec_of(arrays: ArrayRecord) -> ArraySpec:
    """Names, shapes and dtypes of the global arrays: what every update must match."""
    return {name: (tuple(array.shape), str(array.dtype)) for name, array in arrays.items()}


def check_arrays(arrays: Mapping[str, NDArray[np.generic]], spec: ArraySpec) -> None:
    """Raise :class:`UpdateRejected` unless ``arrays`` match ``spec`` and are finite."""
    missing, extra = sorted(set(spec) - set(arrays)), sorted(set(arrays) - set(spec))
    if missing or extra:
        raise UpdateRejected(f"array names differ from the global model: missing {missing}, "
                             f"extra {extra}")
    for name, value in arrays.items():
        shape, dtype = spec[name]
        if tuple(value.shape) != shape:
            raise UpdateRejected(f"array '{name}' has shape {tuple(value.shape)}, expected {shape}")
        if str(value.dtype) != dtype:
            raise UpdateRejected(f"array '{name}' has dtype {value.dtype}, expected {dtype}")
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            raise UpdateRejected(f"array '{name}' contains NaN or Inf")


StepLimit = Callable[[int], int]


@dataclass(frozen=True)
class CheckedReply:
    """Everything a train reply carries, decoded and checked."""

    arrays: dict[str, NDArray[np.generic]]
    weight: float
    meta: wire.ReplyMeta | None
    metrics: wire.TrainMetrics
    clipped: bool = False
    pool_clipping: Mapping[str, int] = field(default_factory=dict)
    norm: float | None = None  # a gateway's update: its L2 norm before clipping


class ReplyValidator:
    """Checks train replies against the global model and the current round.

    Parameters
    ----------
    max_num_examples : int
        Largest sample count one device may claim (caps its aggregation weight).
    require_round_tag : bool
        Require fedge's reply meta with ``server-round`` equal to the current round.
        Turn off only for Flower clients that are not built with fedge's SDK.
    max_local_steps : Callable[[int], int], optional
        The most local SGD steps the round's instruction allows a device with that many
        examples (``local-epochs * ceil(n / batch-size)``, or the time budget's steps on the
        fastest profile). A reply claiming more is rejected: FedNova scales every update by
        the claimed work, so one inflated ``steps`` would blow up the global model.
    weight_key : str
        The metric updates are weighted by (Flower's ``weighted_by_key``; the strategy sets it).
    accepts_aggregates : bool
        Take replies that are a gateway's mean of several devices' updates (``aggregate-of``
        in the meta). A fedge run takes them only with ``gateways = true``, which first checks
        that the strategy composes hierarchically (:func:`fedge.server.app.check_hierarchical`).
    secure_pool : int
        When above 0, take only a gateway's unmasked secure-aggregation sum over at least this
        many devices (``secure-pool`` in the meta): under ``secure-aggregation`` with gateways
        no reply may be one device's update in the clear.
    device_tier : DeviceTierBounds
        What bounds a gateway's reply (``aggregate-of`` or ``secure-pool`` in its meta): the
        devices it may stand for, their weight (its ``num-examples`` is at most that many times
        ``max_device_examples``, not ``max_num_examples``) and its update's norm (clipped,
        logged, counted). Two nodes claiming one gateway name are refused (the second named).
    """

    def __init__(self, *, max_num_examples: int = 100_000, require_round_tag: bool = True,
                 max_local_steps: StepLimit | None = None, weight_key: str = wire.NUM_EXAMPLES,
                 accepts_aggregates: bool = True, secure_pool: int = 0,
                 device_tier: DeviceTierBounds | None = None) -> None:
        self.device_tier = device_tier or DeviceTierBounds()
        self.gateway_norm_bound = self.device_tier.max_update_norm  # this round's (update-norm-bound moves it)
        self.gateway_nodes: dict[str, int] = {}  # gateway name -> the node that first replied under it
        self.max_num_examples = max_num_examples
        self.secure_pool = secure_pool
        self.accepts_aggregates = accepts_aggregates
        self.weight_key = weight_key
        self.require_round_tag = require_round_tag
        self.max_local_steps = max_local_steps

    def check(
        self, content: RecordDict, *, server_round: int, spec: ArraySpec,
        reference: Mapping[str, NDArray[np.generic]] | None = None,
    ) -> tuple[dict[str, NDArray[np.generic]], float]:
        """Validate one reply's content; return its decoded arrays and weight (see :meth:`read`)."""
        checked = self.read(content, server_round=server_round, spec=spec, reference=reference)
        return checked.arrays, checked.weight

    def read(
        self, content: RecordDict, *, server_round: int, spec: ArraySpec,
        reference: Mapping[str, NDArray[np.generic]] | None = None, node_id: int | None = None,
    ) -> CheckedReply:
        """Validate every field of one reply: arrays, metrics and fedge's meta.

        Compressed updates (fedge codecs, see :mod:`fedge.codec`) are decoded
        here, deltas added to ``reference`` (the model the device started from), and
        then checked like any other update.

        Raises
        ------
        UpdateRejected
            Naming the first check the reply failed.
        """
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise UpdateRejected(
                f"a train reply needs exactly one ArrayRecord and one MetricRecord, got "
                f"{len(content.array_records)} and {len(content.metric_records)}"
            )
        meta = wire.read_reply_meta(content)
        self._check_round(meta, server_round)
        if meta is not None and (meta.aggregate_of or 1) > 1 and not self.accepts_aggregates:
            raise UpdateRejected(f"this reply is a gateway's mean of {meta.aggregate_of} devices' updates; run the "
                                 "coordinator with gateways = true (it checks the strategy composes over gateways)")
        if self.secure_pool and (meta is None or (meta.secure_pool or 0) < self.secure_pool):
            pooled = meta is not None and (meta.aggregate_of or 1) > 1
            what = "a gateway's plain mean" if pooled else "one device's update"
            raise UpdateRejected(f"secure-aggregation over gateways takes only a gateway's unmasked sum over at least "
                                 f"{self.secure_pool} devices ('{wire.SECURE_POOL}' in the meta), and this reply is "
                                 f"{what} in the clear: connect devices through fedge gateways")
        pooled = meta is not None and meta.pooled
        if pooled:
            assert meta is not None
            self._check_gateway(meta, node_id)
        limit = self._pool_weight_limit(meta) if pooled else self.max_num_examples
        metrics = wire.read_train_metrics(content, max_num_examples=limit, weight_key=self.weight_key)
        self._check_steps(meta, metrics.num_examples)
        record = next(iter(content.array_records.values()))
        arrays = decode_update(record, reference) if is_encoded(record) else decode_arrays(record, spec)
        check_arrays(arrays, spec)
        clipped, norm = False, None
        if pooled and reference is not None:
            arrays, clipped, norm = self._bound_gateway(arrays, reference, meta, node_id, server_round)
        counts = pool_clipping(content, meta, sum(value.size for value in arrays.values()))
        return CheckedReply(arrays, float(metrics.num_examples), meta, metrics, clipped, counts, norm)

    def _check_gateway(self, meta: wire.ReplyMeta, node_id: int | None) -> None:
        """A pooled reply stands for at most max-gateway-devices devices, under a name no other node uses."""
        devices = max(meta.aggregate_of or 1, meta.secure_pool or 0)
        if devices > self.device_tier.max_gateway_devices:
            raise UpdateRejected(f"this gateway's reply claims {devices} devices, more than max-gateway-devices = "
                                 f"{self.device_tier.max_gateway_devices} (raise it if one gateway serves more)")
        if meta.gateway is None or node_id is None:
            return
        holder = self.gateway_nodes.setdefault(meta.gateway, node_id)
        if holder != node_id:
            raise UpdateRejected(f"gateway name '{meta.gateway}' is used by node {holder} already; each gateway needs "
                                 "its own name and certificate (`fedge keys add-gateway NAME`), so this reply from "
                                 f"node {node_id} is refused")

    def _pool_weight_limit(self, meta: wire.ReplyMeta | None) -> int:
        """The weight a pooled reply may claim: its devices times max-device-examples."""
        devices = 1 if meta is None else max(meta.aggregate_of or 1, meta.secure_pool or 0)
        return devices * self.device_tier.max_device_examples

    def _bound_gateway(self, arrays: dict[str, NDArray[np.generic]], reference: Mapping[str, NDArray[np.generic]],
                       meta: wire.ReplyMeta | None, node_id: int | None,
                       server_round: int) -> tuple[dict[str, NDArray[np.generic]], bool, float]:
        """A gateway's update, clipped to this round's norm bound; its norm (logged either way) before clipping."""
        bound = self.gateway_norm_bound
        bounded, norm, clipped = clip_update(arrays, reference, bound)
        name = meta.gateway if meta is not None and meta.gateway else f"node {node_id}"
        if clipped:
            log.warning("round %d: gateway %s's update has norm %.4g, clipped to max-update-norm %g", server_round,
                        name, norm, bound)
        else:
            log.info("round %d: gateway %s's update has norm %.4g", server_round, name, norm)
        return bounded, clipped, norm

    def _check_round(self, meta: wire.ReplyMeta | None, server_round: int) -> None:
        if meta is None:
            if self.require_round_tag:
                raise UpdateRejected(f"reply has no '{wire.REPLY_META}' record naming its round")
            return
        if meta.server_round != server_round:
            raise UpdateRejected(f"reply is for round {meta.server_round!r}, current round is {server_round}")

    def _check_steps(self, meta: wire.ReplyMeta | None, num_examples: int) -> None:
        if meta is None or meta.steps is None or self.max_local_steps is None:
            return
        limit = self.max_local_steps(num_examples)
        if meta.steps > limit:
            raise UpdateRejected(f"reply claims {meta.steps} local steps; its instruction allows at most {limit} "
                                 f"for {num_examples} examples")

    def screen(
        self, server_round: int, replies: Iterable[Message], reference: ArrayRecord,
        reference_of: Callable[[int], ArrayRecord | None] | None = None,
    ) -> Iterator[AcceptedUpdate | Rejection]:
        """Judge one round's replies one at a time (lazily, so aggregation can stream).

        Yields an :class:`AcceptedUpdate`, a :class:`Rejection` (failed validation,
        logged) or a :class:`Failure` (the device replied with an error) per reply.
        ``reference_of``: a device sent something else than ``reference`` (a sub-model, see
        :mod:`fedge.strategies.submodels`), which its reply is checked against (None: ``reference``).
        """
        checked_against = {id(reference): (spec_of(reference), DecodedOnUse(reference), reference)}
        for message in replies:
            node_id = message.metadata.src_node_id
            if message.has_error():
                yield Failure(node_id, f"device error: {message.error.reason}",
                              systematic=message.error.code in SYSTEMATIC_ERRORS)
                continue
            own = reference_of(node_id) if reference_of is not None else None
            sent = reference if own is None else own
            if id(sent) not in checked_against:  # one spec and decoded copy per model a round sent
                checked_against[id(sent)] = (spec_of(sent), DecodedOnUse(sent), sent)
            spec, weights, _ = checked_against[id(sent)]
            try:
                checked = self.read(message.content, server_round=server_round, spec=spec, reference=weights,
                                    node_id=node_id)
            except UpdateRejected as exc:
                log.warning("round %d: rejected update from node %d: %s",
                            server_round, node_id, exc.reason)
                yield Rejection(node_id, exc.reason)
                continue
            yield AcceptedUpdate(node_id, checked.arrays, checked.weight, message.content, checked.meta,
                                 checked.clipped, checked.pool_clipping, checked.norm)


def pool_clipping(content: RecordDict, meta: wire.ReplyMeta | None, model_elements: int) -> dict[str, int]:
    """A secure pool reply's clipping counts (:data:`POOL_CLIPPING`; {} for any other reply).

    Each must be a whole number: at most the pool's devices for the device counts, at most the
    pool's devices times the model's elements for the entries.

    Raises
    ------
    UpdateRejected
        Naming the count that has the wrong type or is out of range.
    """
    if meta is None or not meta.secure_pool:
        return {}
    record = wire.reply_meta(content)
    assert record is not None  # meta was read from it
    counts = {}
    for key in POOL_CLIPPING:
        value = record.get(key, 0)
        high = meta.secure_pool * (model_elements if key == "secagg-clipped-entries" else 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise UpdateRejected(f"reply meta '{key}' must be a whole number in [0, {high}] (the gateway's pool of "
                                 f"{meta.secure_pool} devices), got {value!r:.40}")
        counts[key] = value
    return counts


def decode_arrays(record: ArrayRecord, spec: ArraySpec) -> dict[str, NDArray[np.generic]]:
    """Plain numpy arrays, each header checked against ``spec`` before anything is allocated.

    ``Array.numpy()`` allocates whatever the ``.npy`` header claims: a 51-byte reply could
    make the coordinator allocate gigabytes before it is rejected. Every array a device
    sends is decoded here (plain updates, and the masked vectors of secure aggregation).

    Raises
    ------
    UpdateRejected
        Names differ from ``spec``, or an array's bytes do not hold its expected shape and dtype.
    """
    missing, extra = sorted(set(spec) - set(record)), sorted(set(record) - set(spec))
    if missing or extra:
        raise UpdateRejected(f"array names differ from the global model: missing {missing}, extra {extra}")
    arrays = {}
    for name, array in record.items():
        shape, dtype = spec[name]
        if array.stype != NUMPY_STYPE:
            raise UpdateRejected(f"array '{name}' does not decode: serialisation type '{array.stype}' is not "
                                 f"'{NUMPY_STYPE}' (send numpy arrays)")
        declared, offset, fortran = _npy_header(name, array.data)
        if declared != (shape, dtype):
            raise UpdateRejected(f"array '{name}' bytes hold shape {declared[0]}, dtype {declared[1]}; "
                                 f"expected {shape}, {dtype}")
        if tuple(array.shape) != shape or str(array.dtype) != dtype:
            raise UpdateRejected(f"array '{name}' bytes disagree with its declared shape/dtype")
        arrays[name] = _view(name, array.data, offset, shape, dtype, fortran=fortran)
    return arrays


def _view(name: str, data: bytes, offset: int, shape: tuple[int, ...], dtype: str, *,
          fortran: bool = False) -> NDArray[np.generic]:
    """The array a checked ``.npy`` blob holds, as a read-only view of its bytes (no copy).

    A copy per reply would be one more model-sized buffer per reply in flight; the view
    lives exactly as long as the reply's bytes are needed.
    """
    count = int(np.prod(shape, dtype=np.int64))
    try:
        kind = np.dtype(dtype)
        if kind.hasobject:
            raise ValueError("object arrays are not accepted")
        if len(data) - offset < count * kind.itemsize:
            raise ValueError(f"{len(data) - offset} bytes of data for {count} x {kind.itemsize}-byte values")
        flat = np.frombuffer(data, dtype=kind, count=count, offset=offset)
        return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)  # .npy of an F-ordered array
    except (TypeError, ValueError) as exc:
        raise UpdateRejected(f"array '{name}' does not decode: {str(exc)[:200]}") from None


class DecodedOnUse(Mapping[str, NDArray[np.generic]]):
    """An ``ArrayRecord``'s arrays as numpy, decoded the first time one is read.

    Only compressed deltas need the global model as numpy; a round of plain updates
    never pays for a model-sized copy.
    """

    def __init__(self, record: ArrayRecord) -> None:
        self._record = record
        self._arrays: dict[str, NDArray[np.generic]] | None = None

    def _decoded(self) -> dict[str, NDArray[np.generic]]:
        if self._arrays is None:
            self._arrays = {name: array.numpy() for name, array in self._record.items()}
        return self._arrays

    def __getitem__(self, name: str) -> NDArray[np.generic]:
        return self._decoded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._record)

    def __len__(self) -> int:
        return len(self._record)


def _npy_header(name: str, data: bytes) -> tuple[tuple[tuple[int, ...], str], int, bool]:
    """Shape and dtype from a ``.npy`` header, where its data starts and whether it is in Fortran
    order, without touching the data."""
    stream = io.BytesIO(data)
    try:
        shape, fortran_order, dtype = read_npy_header(stream)
    except ValueError as exc:
        raise UpdateRejected(f"array '{name}' does not decode: {exc}") from None
    return (shape, str(dtype)), stream.tell(), fortran_order
