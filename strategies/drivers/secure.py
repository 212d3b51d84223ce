"""Coordinator side of fedge's secure aggregation: SecAgg+ over Flower's Message API.

Flower 1.42's SecAgg+ runs only through its legacy workflow (it cannot drive the
Message-API strategies fedge uses) and expands masks from a seed folded to 32 bits,
so fedge runs its own five steps (``train.secagg_setup|share|masked|consistency|unmask``
actions of the same ClientApp), after Bonawitz et al. (CCS 2017, §4: AdvertiseKeys,
ShareKeys, MaskedInputCollection, ConsistencyCheck, Unmasking) and Bell et al. (CCS
2020: sparse neighbourhoods), with the math in :mod:`fedge.secagg`. The coordinator
checks and relays public keys and sealed shares, sums masked vectors (each signed over
the digests of the model and config its device was sent, checked against what was sent),
relays those signatures to each survivor's neighbours, collects the survivors'
signatures over the survivor set, asks the signers to unmask, removes the masks and
applies ``sum(w * delta) / sum(w)`` to the model: the weights ``w`` travel masked, so
only their sum is revealed (as only the round's totals of what devices clipped are:
:class:`Clipping`). Devices that name a neighbour whose sealed shares do not
open make the round start again without that neighbour (:meth:`SecureAggregation._attempts`).

Threat model: see :mod:`fedge.secagg`. Devices enforce the protocol themselves
(:mod:`fedge.clients.secure`), so this side cannot make them reveal more than the sum
even if it were modified; what it checks here protects the round from devices: public
keys of small order (which would make every honest neighbour fail) are refused in the
setup step and their sender named, invalid signatures are left out. Every field a device
sends is read by one ``_read_*`` function of this module: a malformed message raises
:class:`~fedge.errors.ProtocolError` there, its sender is named in the round's failures and
the round goes on without that message; a round that cannot finish raises
:class:`~fedge.errors.SecureRoundFailed` and keeps the global model. Nothing else is caught,
so a bug in this module surfaces instead of passing for a failed round. Individual updates
are never visible here, so per-update validation (NaN, shapes) is replaced by checks on
the decoded aggregate; median, trimmed mean and Krum cannot be combined with it
(refused at start).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedge import wire
from fedge.aggregate import c_contiguous
from fedge.distributed_noise import DP_CLIP, DP_MIN_SURVIVORS, DP_SCALE, DP_STDDEV, DistributedNoise
from fedge.errors import ConfigError, ProtocolError, SecureRoundFailed, UpdateRejected
from fedge.secagg import (
    PUBLIC_KEYS,
    SHARE_BYTES,
    STEPS,
    FixedPoint,
    InvalidPublicKey,
    Received,
    arrays_digest,
    bits_needed,
    check_ed25519_public,
    check_x25519_public,
    config_digest,
    derive,
    minimum_threshold,
    neighbour_graph,
    rebuild_secret,
    ring_accumulate,
    ring_dtype,
    ring_range,
    survivors_message,
    unmask,
    valid_received_signature,
    valid_signature,
)
from fedge.strategies.drivers.base import RoundReport
from fedge.strategies.drivers.sync import SyncDriver
from fedge.strategies.policies import let_go
from fedge.strategies.registry import names_where
from fedge.strategies.rounds import NoiseLayer
from fedge.strategies.rule import LinearRule
from fedge.strategies.validation import Rejection, decode_arrays
from fedge.submodels import CoverageMean

if TYPE_CHECKING:
    from fedge.strategies.rounds import Rounds

log = logging.getLogger("fedge.strategies.secure")

ACTIONS = STEPS

Keys = dict[str, bytes]
"""A device's public keys for one round, by kind (:data:`fedge.secagg.PUBLIC_KEYS`)."""
T = TypeVar("T")


class SecureAggregation(SyncDriver):
    """The secure driver: synchronous rounds that run the secure-aggregation protocol around any
    linear rule (``FedAvg(driver=SecureAggregation())``, FedProx, FedNova, FedAvgM, FedAdam, ...).

    The strategy's own ``configure_train`` (FedProx's ``proximal-mu``, stragglers' partial
    work) shapes the instructions, and the round policy decides which masked inputs
    count (with a deadline, late devices are treated as dropouts). Devices send
    ``w * clip(delta / a)`` and the tail ``[w, w * a]`` (``a``: FedNova's normalised local
    work, 1 otherwise) and their clipping counts (:class:`Clipping`); the weighted mean
    ``global + sum(w delta / a) / sum(w) * sum(w a) / sum(w)`` goes to the rule's server step
    (:meth:`fedge.strategies.rule.LinearRule.step`). A driver runs one strategy (:meth:`bind`).

    Parameters
    ----------
    threshold : float
        Shares needed to rebuild a secret: ``floor(threshold * k) + 1`` of a device's ``k`` neighbours
        (at least 2, and more than half of them).
    neighbours : int
        Neighbours per device (0: all pairs; SecAgg+ uses O(log n)).
    clip : float
        Largest ``|delta / a|`` per entry a device contributes (secagg-clip): devices clip their
        update there, then weight it; the weighted value travels in a range of ``clip x
        weight_clip`` (or what the ring holds for the round's devices, if that is less).
        Whatever is clipped is counted (:attr:`clipping`).
    precision : float
        Quantisation step of the fixed-point encoding of ``w * delta / a``.
    bits : int
        Ring width: arithmetic is in Z_{2^bits}.
    weight_clip : float
        Largest weight ``w`` (weights are encoded on their own scale; fedge passes ``max-num-examples``).
    work_cap : float
        Largest normalised local work ``a`` (FedNova; 1 for the others).

    Raises
    ------
    ConfigError
        A setting outside the range the protocol works in (the run config's ``secagg-*`` keys
        have the same ranges).
    """

    def __init__(self, *, threshold: float = 0.5, neighbours: int = 0, clip: float = 1000.0,
                 precision: float = 1e-4, bits: int = 32, weight_clip: float = 1e5, work_cap: float = 1.0) -> None:
        _check_settings(threshold=threshold, neighbours=neighbours, clip=clip, precision=precision, bits=bits,
                        weight_clip=weight_clip, work_cap=work_cap)
        self.threshold_fraction, self.neighbours = threshold, neighbours
        self.clip, self.precision, self.bits, self.weight_clip = clip, precision, bits, weight_clip
        self.requested_work_cap = self.work_cap = work_cap
        self.rounds: Rounds | None = None
        self.rule: LinearRule | None = None
        self.noise_layer: NoiseLayer | None = None  # distributed DP: the devices add noise to what they mask
        self.clipping: dict[int, Clipping] = {}
        """What the devices' encodings clipped, by round (the round's totals, summed securely)."""

    def bind(self, rounds: Rounds) -> None:
        """Run ``rounds``; refuse a rule that is not linear (secure aggregation reveals only a sum).

        Raises
        ------
        ConfigError
            Naming why, and the linear strategies.
        """
        rule = rounds.rule
        if not rule.linear or not isinstance(rule, LinearRule):
            why = ("it needs each update, which secure aggregation hides" if rule.needs_each_update else
                   "its step is not one on the updates' weighted mean, the only thing secure aggregation reveals")
            raise ConfigError(
                f"secure-aggregation works with linear rules, not {rounds.name}'s "
                f"{type(rule).__name__}: {why}; use {names_where(lambda each: each.linear)}, or drop "
                "secure-aggregation")
        privacy = rounds.privacy
        if privacy is not None and not isinstance(privacy, NoiseLayer):
            raise ConfigError("central dp (the coordinator clips the updates and adds the noise) cannot work on "
                              "updates secure aggregation hides; use dp = 'distributed' (the devices clip and add "
                              "the noise inside secure aggregation), or turn one of them off")
        if privacy is not None and rounds.submodels is not None:
            raise ConfigError("dp = 'distributed' with width-scaled sub-models is not supported yet (each width "
                              "group's sum would be a release of its own); drop sub-models or dp")
        self.noise_layer = privacy
        self.rounds, self.rule = rounds, rule
        self.work_cap = self.requested_work_cap if rule.work_momentum is not None else 1.0  # FedNova's a_i

    def train_round(self, rounds: Rounds, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The five protocol steps; the model changes only if enough devices finish them.

        Under width-scaled sub-models (``rounds.submodels``) the devices of one window (width and
        offset) form a group, and each group runs its own protocol instance over its sub-model's
        vector: the coordinator learns each group's sum and nothing finer, then averages each
        entry over the groups that held it (:class:`fedge.submodels.CoverageMean`).
        """
        if rounds is not self.rounds:
            self.bind(rounds)
        rule = self._rule
        instructions = {m.metadata.dst_node_id: m.content
                        for m in rounds.train_messages(server_round, arrays, config, grid)}
        report = rounds.state.reports[-1]
        if rounds.submodels is not None:
            return self._grouped_round(rounds, grid, server_round, arrays, instructions, timeout, report)
        try:
            sums = self._group_sum(grid, server_round, instructions, arrays, timeout, report)
        except SecureRoundFailed as exc:  # malformed messages were handled where they were read
            log.warning("round %d: secure aggregation failed (%s); global model kept", server_round, exc)
            return None, MetricRecord({"accepted": 0, "failed": len(report.failed), "late": report.late})
        report.accepted, report.aggregated = len(sums.survivors), True
        self._note_clipping(server_round, sums.clipping, report)
        delta = sums.summed / sums.weight * (sums.weighted_work / sums.weight)
        if sums.noise is not None:  # DP's uniform mean over a fixed denominator: the devices asked
            delta = sums.summed / len(instructions)
            self._note_release(server_round, sums, report)
        rule.begin(rounds.round_context())
        new = rule.step(self._apply(arrays, delta))
        return ArrayRecord({name: Array(c_contiguous(new[name])) for name in arrays}), MetricRecord(
            {"accepted": len(sums.survivors), "failed": len(report.failed), "late": report.late,
             "weight": sums.weight if sums.noise is None else len(instructions),  # DP: the fixed denominator
             **sums.clipping.metrics()})

    def _group_sum(self, grid: Grid, server_round: int, instructions: dict[int, RecordDict], sent: ArrayRecord,
                   timeout: float, report: RoundReport) -> _Sums:
        """One protocol instance over ``instructions``' devices, who were all sent ``sent`` (the model or one
        width's sub-model, before any downlink codec): the unmasked sums and the survivors."""
        entries = sum(int(np.prod(array.shape)) for array in sent.values())
        codecs = self._codecs(len(instructions), entries)
        length = entries + TAIL  # update, w, w * a, the clipping counts
        total, survivors = self._attempts(grid, server_round, instructions, codecs, timeout, report, length)
        return self._decoded(total, codecs, survivors)

    def group_mean(self, grid: Grid, server_round: int, instructions: dict[int, RecordDict], sent: ArrayRecord,
                   timeout: float, report: RoundReport) -> tuple[dict[str, np.ndarray], float, list[int], Clipping]:
        """One protocol instance over a group of devices the caller formed (``instructions``' devices, all
        sent ``sent``): the group's weighted mean model, its summed weight, its survivors and what its devices
        clipped; nothing finer is revealed (:mod:`fedge.strategies.drivers.secure_groups` runs one per group).

        Raises
        ------
        SecureRoundFailed
            The group's instance could not finish (its devices' failures are in ``report``).
        """
        sums = self._group_sum(grid, server_round, instructions, sent, timeout, report)
        mean = self._apply(sent, sums.summed / sums.weight * (sums.weighted_work / sums.weight))
        return mean, sums.weight, list(sums.survivors), sums.clipping

    def _note_release(self, server_round: int, sums: _Sums, report: RoundReport) -> None:
        """Account a distributed-DP sum and show what it spent and what it brought back into range."""
        assert self.noise_layer is not None and sums.noise is not None
        dimension = len(sums.summed)
        epsilon = self.noise_layer.release_sum(sums.noise, survivors=len(sums.survivors), dimension=dimension)
        report.epsilon = epsilon if math.isfinite(epsilon) else None
        report.dp_out_of_range = sums.outside
        log.info("round %d: distributed DP: %d devices' noise shares (sigma %.4g each, %.4g in the sum, L2 clip %g): "
                 "%s", server_round, len(sums.survivors), sums.noise.stddev / sums.noise.scale,
                 sums.noise.stddev / sums.noise.scale * math.sqrt(len(sums.survivors)), sums.noise.clip,
                 f"epsilon {epsilon:.3f} so far" if math.isfinite(epsilon) else "accounted by the coordinator")
        if sums.outside:
            log.warning("round %d: %d entries of the noised sum lay outside what %d clipped devices and the noise can "
                        "reach (a device that did not clip?); brought back into range", server_round, sums.outside,
                        len(sums.survivors))

    def _grouped_round(self, rounds: Rounds, grid: Grid, server_round: int, arrays: ArrayRecord,
                       instructions: dict[int, RecordDict], timeout: float,
                       report: RoundReport) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One protocol instance per window group; each entry averaged over the groups that held it.

        A group of fewer than :data:`MIN_DEVICES` devices is not run (the sum of two would tell
        each its partner's update): its devices are left out of the round, with the reason.
        """
        assert rounds.submodels is not None
        windows = rounds.submodels.windows
        groups: dict[tuple[Any, Any], dict[int, RecordDict]] = {}
        for node, content in instructions.items():
            groups.setdefault((windows[node].width, windows[node].offset), {})[node] = content
        self._rule.begin(rounds.round_context())
        entries = CoverageMean({name: tuple(array.shape) for name, array in arrays.items()})
        accepted, weight_total, clipping = 0, 0.0, Clipping()
        for _, group in sorted(groups.items(), key=lambda item: item[0]):
            window = windows[next(iter(group))]
            if len(group) < MIN_DEVICES:
                reason = (f"its width group ({window.describe()}) had {len(group)} devices this round; secure "
                          f"aggregation needs {MIN_DEVICES}")
                report.rejected.extend(Rejection(node, reason) for node in group)
                log.warning("round %d: width group %s has %d devices (< %d): left out", server_round,
                            window.describe(), len(group), MIN_DEVICES)
                continue
            sent = rounds.submodels.reference_of(next(iter(group))) or arrays
            try:
                sums = self._group_sum(grid, server_round, group, sent, timeout, report)
            except SecureRoundFailed as exc:
                log.warning("round %d: secure aggregation of width group %s failed (%s); its devices are left out",
                            server_round, window.describe(), exc)
                continue
            entries.add(self._apply(sent, sums.summed / sums.weight * (sums.weighted_work / sums.weight)), window,
                        sums.weight)
            accepted, weight_total = accepted + len(sums.survivors), weight_total + sums.weight
            clipping += sums.clipping
        self._note_clipping(server_round, clipping, report)
        metrics = {"accepted": accepted, "failed": len(report.failed), "late": report.late, "weight": weight_total,
                   **clipping.metrics()}
        if not entries.count or accepted < rounds.min_train_replies:
            log.warning("round %d: %d devices in aggregated width groups (min-train-replies %d); global model kept",
                        server_round, accepted, rounds.min_train_replies)
            return None, MetricRecord(metrics)
        report.accepted, report.aggregated = accepted, True
        global_numpy = {name: array.numpy() for name, array in arrays.items()}
        new = self._rule.step_entries(entries, global_numpy)
        return ArrayRecord({name: Array(c_contiguous(new[name])) for name in arrays}), MetricRecord(metrics)

    @property
    def _rounds(self) -> Rounds:
        if self.rounds is None:
            raise RuntimeError("SecureAggregation runs a strategy's rounds: give it as FedAvg(driver=...), or bind it")
        return self.rounds

    @property
    def _rule(self) -> LinearRule:
        if self.rule is None:
            raise RuntimeError("SecureAggregation runs a strategy's rounds: give it as FedAvg(driver=...), or bind it")
        return self.rule

    def _attempts(self, grid: Grid, server_round: int, instructions: dict[int, RecordDict],
                  codecs: _Codecs, timeout: float,
                  report: RoundReport, length: int) -> tuple[Any, list[int]]:
        """:meth:`_protocol`, run again without the devices whose sealed shares did not open.

        A device that gets a share that does not open or is malformed names its sender at the
        masked step and masks nothing (:func:`fedge.clients.secagg_device.open_shares`); the devices
        blamed (:func:`_blame`) are named in the round's failures and the protocol starts
        again without them (fresh keys and shares; devices train again), at most
        :data:`RERUNS` times. Nothing was unmasked in the attempt given up.
        """
        for _ in range(RERUNS + 1):
            try:
                return self._protocol(grid, server_round, instructions, codecs, timeout, report, length)
            except _BadShares as exc:
                for node, reason in sorted(exc.blamed.items()):
                    report.rejected.append(Rejection(node, reason))
                instructions = {n: content for n, content in instructions.items() if n not in exc.blamed}
                log.warning("round %d: devices %s sent shares that do not open (or reported too many); secure "
                            "aggregation starts again without them", server_round, sorted(exc.blamed))
        raise SecureRoundFailed(f"bad shares in {RERUNS + 1} attempts in a row")

    def _decoded(self, total: Any, codecs: _Codecs, survivors: list[int]) -> _Sums:
        """The unmasked sums, checked: a wrong share unmasks to noise, which lands out of range."""
        count, outside = len(survivors), 0
        if codecs.noise is not None:
            summed, outside = codecs.noise.decode_sum(total[:-TAIL], count)
        else:
            summed = codecs.values.decode_sum(total[:-TAIL], count)
        weight = float(codecs.weights.decode_sum(total[-TAIL:-TAIL + 1], count)[0])
        weighted_work = float(codecs.works.decode_sum(total[-TAIL + 1:-TAIL + 2], count)[0])
        entries, devices, capped = (int(c) for c in codecs.counts.decode_sum(total[-TAIL + 2:], count))
        plausible = (0 < weight <= count * codecs.weights.clip * (1 + 1e-6) and weighted_work > 0
                     and np.all(np.isfinite(summed))
                     and np.abs(summed).max(initial=0.0) <= count * codecs.values.clip
                     and 0 <= entries <= count * codecs.counts.clip and 0 <= devices <= min(count, entries)
                     and 0 <= capped <= count)
        if codecs.noise is not None:  # every device sends weight 1, work 1 and no clipping counts (a wrong share
            # unmasks the tail to noise too; the update's entries out of range were counted and brought back)
            plausible = (abs(weight - count) < 0.5 and abs(weighted_work - count) < 0.5
                         and entries == devices == capped == 0)
        if not plausible:
            raise SecureRoundFailed("the unmasked sum is out of range (a wrong share or a tampered input)")
        return _Sums(summed, weight, weighted_work, survivors, Clipping(entries, devices, capped), codecs.noise,
                     outside)

    def _codecs(self, selected: int, entries: int) -> _Codecs:
        """Fixed point for the weighted update, for ``w`` and ``w * a`` (as fine as fits), for the counts.

        The update's step is ``precision``; its range is what a device may send, ``clip x
        weight_clip`` (devices clip ``delta / a`` at ``clip``, then weight it by ``w <=
        weight_clip``), or the ring's whole range shared by the selected devices if that is
        less: then a device with many examples and a large update is clipped there (and counts
        it). The ring must hold at least ``clip`` per device (:func:`fedge.secagg.bits_needed`, the
        check at start).
        """
        scale = 1.0 / self.precision
        if not FixedPoint(self.clip, scale, self.bits).fits(max(selected, 1)):
            raise ConfigError(f"secagg-bits = {self.bits} is too small for {selected} devices: it needs "
                              f"{bits_needed(selected, self.clip, self.precision)} bits")
        values = FixedPoint(min(self.clip * self.weight_clip, ring_range(selected, scale, self.bits)), scale,
                            self.bits)
        counted = min(max(entries, 1), ring_range(selected, 1.0, self.bits))  # entries clipped, 0/1 flags
        if counted < 1:
            raise ConfigError(f"secagg-bits = {self.bits} is too small for {selected} devices to count what they "
                              "clip (one per device)")
        work_clip = self.weight_clip * self.work_cap
        def finest(clip: float) -> FixedPoint:
            return FixedPoint(clip, (2 ** (self.bits - 1) - 1) / (max(selected, 1) * clip) * (1 - 1e-9), self.bits)
        return _Codecs(values, finest(self.weight_clip), finest(work_clip), FixedPoint(counted, 1.0, self.bits),
                       self._noise(selected, entries, scale))

    def _noise(self, selected: int, entries: int, scale: float) -> DistributedNoise | None:
        """Distributed DP's encoding for a round of ``selected`` devices, or ``None`` without it."""
        if self.noise_layer is None:
            return None
        noise = self.noise_layer.noise(scale=scale, dimension=entries, min_survivors=self._needed(), bits=self.bits)
        if not noise.fits(selected):
            raise ConfigError(f"secagg-bits = {self.bits} cannot hold the noised sum of {selected} devices (clip "
                              f"{noise.clip} at secagg-precision {self.precision}, noise sigma {noise.stddev:.4g} "
                              "ring units each): raise secagg-bits or secagg-precision")
        return noise

    def _needed(self) -> int:
        """The fewest masked inputs a round goes on with (sub-models: per width group)."""
        rounds = self._rounds
        return MIN_DEVICES if rounds.submodels is not None else max(MIN_DEVICES, rounds.min_train_replies)

    def _note_clipping(self, server_round: int, clipping: Clipping, report: RoundReport) -> None:
        """Keep the round's clipping counts (:attr:`clipping`, the round report where it has the
        fields) and say so on the console when anything was clipped."""
        self.clipping[server_round] = clipping
        have = {field.name for field in dataclasses.fields(report)}
        for name, value in clipping.report_fields().items():  # RoundReport's columns, once it declares them
            if name in have:
                setattr(report, name, value)
        if clipping.entries:
            log.warning("round %d: secure aggregation clipped %d update entries on %d device(s) (|delta| above "
                        "secagg-clip = %g, or |w * delta| above the ring's range at secagg-bits = %d): the model "
                        "differs from plaintext aggregation there; raise secagg-clip (or secagg-bits)", server_round,
                        clipping.entries, clipping.devices, self.clip, self.bits)
        if clipping.weights:
            log.warning("round %d: secure aggregation capped %d device weight(s) at %g examples (max-num-examples)",
                        server_round, clipping.weights, self.weight_clip)

    def _protocol(self, grid: Grid, server_round: int, instructions: dict[int, RecordDict],
                  codecs: _Codecs, timeout: float,
                  report: RoundReport, length: int) -> tuple[Any, list[int]]:
        """Run the five steps; the masked vectors' sum without masks (``length`` entries), and who is in it.

        Sets, as in Bonawitz et al. §4: ``alive`` (valid keys, U1), ``shared`` (sent
        shares, U2), ``survivors`` (sent masked inputs, U3: the sum is over them),
        ``signers`` (signed U3, U4) and the signers that will accept the unmask request
        (``t`` neighbours among the signers). Nothing is revealed unless every secret
        the sum needs can be rebuilt from the latter.
        """
        setup = self._step(grid, "secagg_setup", {n: RecordDict({"config": _relayed(
            {wire.SERVER_ROUND: server_round})}) for n in instructions}, timeout, report)
        keys = _read_each(setup, _read_keys, "secagg_setup", "the round goes on without it", server_round, report)
        alive = _distinct_keys(list(keys), keys, server_round, report)
        graph = neighbour_graph(alive, self.neighbours or len(alive), seed=self._rounds.selector.seed + server_round)
        threshold = self._threshold(graph)
        peers = {n: RecordDict({"peers": _peer_record(keys, graph[n], server_round, threshold)}) for n in alive}
        sealed = _read_each(self._step(grid, "secagg_share", peers, timeout, report),
                            lambda node, reply: _read_sealed(node, reply, graph[node]), "secagg_share",
                            "the round goes on without it", server_round, report)
        shared = [n for n in alive if n in sealed]
        inboxes = {n: _relayed({f"from/{p}": sealed[p][n] for p in graph[n] if p in shared}) for n in shared}
        few = [n for n, inbox in inboxes.items() if len(inbox) < threshold]
        if few:  # it would refuse to mask (its self-mask alone would hide its input): a dropout
            log.warning("round %d: devices %s got shares from fewer than %d neighbours; left out", server_round,
                        few, threshold)
        maskers = {n: inbox for n, inbox in inboxes.items() if n not in few}
        masked, expected = self._masked_step(grid, server_round, instructions, maskers, codecs, timeout, report)
        checks = _Expected(set(maskers), expected, keys, graph, server_round)
        folded = self._sum_masked(masked, checks, length, server_round, report)
        total, summed = folded.total, folded.received
        if folded.bad_shares:
            raise _BadShares(_blame(folded.bad_shares, graph, threshold))
        survivors = [n for n in shared if n in summed]
        if len(survivors) < self._needed():  # sub-models: min-train-replies counts the round's groups together
            raise SecureRoundFailed(f"{len(survivors)} devices sent masked inputs, need {MIN_DEVICES} and "
                                    f"min-train-replies {self._rounds.min_train_replies}")
        _enough_holders(graph, shared, survivors, threshold, "sent masked inputs")
        signatures = self._consistency(grid, server_round, survivors, keys, summed, graph, timeout, report)
        signers = set(signatures)
        unmaskers = [n for n in survivors if n in signers and len(graph[n] & signers) >= threshold]
        _enough_holders(graph, shared, unmaskers, threshold, "signed the survivor set")
        asks = {n: RecordDict({"ask": _relayed({"survivors": survivors, wire.SERVER_ROUND: server_round,
                                                **{f"sig/{p}": signatures[p] for p in graph[n] & signers}})})
                for n in unmaskers}
        index = {owner: {holder: x for x, holder in enumerate(sorted(holders), start=1)}  # each share's Shamir x
                 for owner, holders in graph.items()}
        revealed = _read_each(
            self._step(grid, "secagg_unmask", asks, timeout, report),
            lambda node, reply: _read_revealed(node, reply, {owner: index[owner][node] for owner in graph[node]}),
            "secagg_unmask", "its shares are not used", server_round, report)
        seeds = [self._rebuild(revealed, f"b/{u}", threshold, u) for u in survivors]
        leftovers: list[tuple[int, int, bytes]] = []
        for gone in (n for n in shared if n not in survivors):
            private = X25519PrivateKey.from_private_bytes(self._rebuild(revealed, f"s/{gone}", threshold, gone))
            for v in graph[gone] & set(survivors):
                leftovers.append((v, gone, derive(private, keys[v]["s-pk"], "mask", str(server_round).encode())))
        return unmask(total, seeds, leftovers, self.bits), survivors

    def _consistency(self, grid: Grid, server_round: int, survivors: list[int], keys: Mapping[int, Keys],
                     received: Mapping[int, bytes], graph: Mapping[int, set[int]], timeout: float,
                     report: RoundReport) -> dict[int, bytes]:
        """The ConsistencyCheck round: every survivor signs the survivor set; the valid signatures.

        Each survivor also gets its surviving neighbours' signatures over what they were sent
        (``received/<node>``, from the masked step): it signs only if they match what it was
        sent. A survivor that does not answer stays in the sum (its self-mask is rebuilt from
        its neighbours' shares) but cannot unmask; a signature that does not verify is
        recorded as a failure of its sender.
        """
        alive = set(survivors)
        checks = {n: RecordDict({"check": _relayed({
            "survivors": survivors, wire.SERVER_ROUND: server_round,
            **{f"received/{p}": received[p] for p in sorted(graph[n] & alive)}})}) for n in survivors}
        replies = self._step(grid, "secagg_consistency", checks, timeout, report)
        signed = survivors_message(server_round=server_round, survivors=survivors)  # what each signs: made once
        return _read_each(
            replies, lambda node, reply: _read_signature(node, reply, keys[node]["g-pk"], signed),
            "secagg_consistency", "it cannot unmask; its input stays in the sum", server_round, report)

    def _sum_masked(self, replies: Iterable[Message], expected: _Expected, length: int, server_round: int,
                    report: RoundReport) -> _Folded:
        """The sum in Z_{2^bits} of the well-formed masked inputs of ``senders`` (each once), folded
        in one at a time; who is in it.

        Each input is read (:func:`_read_masked`), added into one model-sized total and
        let go (its payload is dropped from the reply), so the coordinator never holds a
        decoded array per device: at 1,000 devices and a 1M-parameter model that is 4 GB
        it does not need. A malformed input is named in the round's failures and left out,
        as :func:`_read_each` does; its sender then counts as a dropout. So is one whose
        signed digests of what it was sent (:class:`fedge.secagg.Received`) are not those of what
        this coordinator sent it. A device that names neighbours whose shares did not open
        (and masks nothing) is noted in ``bad_shares``.
        """
        folded = _Folded(np.zeros(length, ring_dtype(self.bits)), {}, {})
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                report.failed.append(Rejection(node, f"secagg_masked: {reply.error.reason}"))
                continue
            if node in expected.senders and node not in folded.received and node not in folded.bad_shares:
                self._fold(reply, node, folded, expected, length, server_round, report)  # never twice
            let_go(reply)  # the only copy the coordinator kept of this input: freed now, not at the next gc
            if "masked" in reply.content:
                del reply.content["masked"]
        return folded

    def _fold(self, reply: Message, node: int, folded: _Folded, expected: _Expected, length: int,
              server_round: int, report: RoundReport) -> None:
        """Add ``node``'s masked input to ``folded`` or note its bad-share report; a malformed one is named."""
        if self.rounds is not None and self.rounds.submodels is not None:  # its public meta names its profile
            self.rounds.submodels.learn([reply])
        if _config(reply, wire.SECAGG_BAD_SHARES) is not None:
            folded.bad_shares.update(_read_each(
                {node: reply}, lambda node, reply: _read_bad_shares(node, reply, expected.graph[node]),
                "secagg_masked", "its report is ignored", server_round, report))
            return
        read = _read_each({node: reply}, lambda node, reply: _read_masked(node, reply, length, self.bits, expected),
                          "secagg_masked", "it is left out of the sum", server_round, report).get(node)
        if read is not None:
            ring_accumulate(folded.total, read[0], self.bits)
            folded.received[node] = read[1]

    def _masked_step(self, grid: Grid, server_round: int, instructions: dict[int, RecordDict],
                     inboxes: dict[int, ConfigRecord], codecs: _Codecs,
                     timeout: float, report: RoundReport) -> tuple[Iterator[Message], dict[int, Received]]:
        """Train and send masked inputs, under the round policy (late or dropped: a dropout).

        The replies, errors included, one at a time as they arrive, for :meth:`_sum_masked`
        to fold in and let go: the coordinator never holds a round's masked inputs. And the
        digests of what each device was sent, which it must sign back.
        """
        values, weights, works = codecs.values, codecs.weights, codecs.works
        params = ConfigRecord({"clip": values.clip, "scale": values.scale, "bits": self.bits,
                               "update-clip": self.clip, "count-clip": codecs.counts.clip,
                               "weight-clip": weights.clip, "weight-scale": weights.scale,
                               "work-clip": works.clip, "work-scale": works.scale, "work-cap": self.work_cap,
                               "work-momentum": _work_momentum(self._rule), **_noise_params(codecs.noise)})
        targets = [n for n in inboxes if not self._rounds.drops(n)]
        report.late += len(inboxes) - len(targets)  # FedAvg leaves stragglers out: they count as dropouts
        messages = [Message(RecordDict({wire.ARRAYS: instructions[n][wire.ARRAYS],
                                        wire.CONFIG: instructions[n][wire.CONFIG],
                                        "inbox": inboxes[n], "secagg": params}),
                            dst_node_id=n, message_type=f"{MessageType.TRAIN}.secagg_masked") for n in targets]
        expected = _sent_digests(instructions, targets, params)
        # masked replies carry no metrics (a device's loss would leak): the selector learns nothing here
        stream = self._rounds.policy.stream(grid, messages, timeout, self._rounds.state.round_target)
        return _counting_late(stream, len(messages), report), expected

    def _step(self, grid: Grid, action: str, contents: dict[int, RecordDict], timeout: float,
              report: RoundReport) -> dict[int, Message]:
        messages = [Message(content, dst_node_id=node, message_type=f"{MessageType.TRAIN}.{action}")
                    for node, content in contents.items()]
        replies = {}
        for reply in grid.send_and_receive(messages, timeout=timeout):
            if reply.has_error():
                report.failed.append(Rejection(reply.metadata.src_node_id, f"{action}: {reply.error.reason}"))
            else:
                replies[reply.metadata.src_node_id] = reply
        return replies

    def _threshold(self, graph: dict[int, set[int]]) -> int:
        """One threshold for the round that every device accepts (see :func:`shares_needed`)."""
        smallest = min((len(peers) for peers in graph.values()), default=0)
        largest = max((len(peers) for peers in graph.values()), default=0)
        if smallest < 2:
            raise SecureRoundFailed("too few devices to share secrets (each needs 2 neighbours or more)")
        threshold = max(shares_needed(self.threshold_fraction, smallest), minimum_threshold(largest))
        if threshold > smallest:
            raise SecureRoundFailed(f"neighbourhoods of {smallest} to {largest} devices admit no common threshold "
                                    "(more than half of the largest, at most the smallest)")
        return threshold

    @staticmethod
    def _rebuild(revealed: Mapping[int, Mapping[str, bytes]], name: str, threshold: int, owner: int) -> bytes:
        """The secret ``name`` of ``owner`` from the shares its neighbours revealed (read by
        :func:`_read_revealed`: well formed, each at its holder's index, so distinct)."""
        shares = [held[name] for held in revealed.values() if name in held]
        if len(shares) < threshold:
            raise SecureRoundFailed(f"only {len(shares)} of {threshold} shares to unmask device {owner}")
        secret = rebuild_secret(shares[:threshold])
        if len(shares) > threshold and rebuild_secret(shares[-threshold:]) != secret:
            raise SecureRoundFailed(f"the shares revealed for device {owner} disagree (a wrong share)")
        return secret

    @staticmethod
    def _apply(arrays: ArrayRecord, delta: np.ndarray) -> dict[str, np.ndarray]:
        """The weighted mean: ``arrays`` plus the unmasked mean change (laid out by sorted name)."""
        new, offset = {}, 0
        for name in sorted(arrays):
            current = arrays[name].numpy()
            size = current.size
            new[name] = (current + delta[offset:offset + size].reshape(current.shape)).astype(current.dtype)
            offset += size
        return new


MIN_DEVICES = 3  # with 2, each device learns the other's update from the sum
RERUNS = 2  # times a round starts again without devices whose shares did not open
TAIL = 5  # ring elements after the update: w, w * a and the clipping counts (fedge.clients.secagg_device.COUNTS)


@dataclass(frozen=True)
class Clipping:
    """What the devices' encodings clipped in one round: totals over the devices in the sum (each
    device's counts travel masked, like its weight, so no device's own is revealed)."""

    entries: int = 0  # update entries clipped: |delta / a| above secagg-clip, or |w delta / a| above the range
    devices: int = 0  # devices that clipped at least one entry
    weights: int = 0  # devices whose weight was capped at weight_clip (max-num-examples)

    def __add__(self, other: Clipping) -> Clipping:
        return Clipping(self.entries + other.entries, self.devices + other.devices, self.weights + other.weights)

    def metrics(self) -> dict[str, int]:
        """The round's train metrics' keys for these counts."""
        return {"secagg-clipped-entries": self.entries, "secagg-clipped-devices": self.devices,
                "secagg-capped-weights": self.weights}

    def report_fields(self) -> dict[str, int]:
        """:class:`~fedge.strategies.drivers.base.RoundReport`'s fields (metrics.jsonl's columns) for these counts."""
        return {"secagg_clipped_entries": self.entries, "secagg_clipped_devices": self.devices,
                "secagg_capped_weights": self.weights}


@dataclass(frozen=True)
class _Codecs:
    """A protocol instance's fixed-point encodings: the weighted update, ``w``, ``w * a``, the counts,
    and distributed DP's encoding of the update when it is on."""

    values: FixedPoint
    weights: FixedPoint
    works: FixedPoint
    counts: FixedPoint
    noise: DistributedNoise | None = None


def _noise_params(noise: DistributedNoise | None) -> dict[str, float | int]:
    """The ``secagg`` parameters that tell devices to clip and noise (:func:`fedge.clients.secagg_device.dp_noise`)."""
    if noise is None:
        return {}
    return {DP_CLIP: noise.clip, DP_SCALE: noise.scale, DP_STDDEV: noise.stddev, DP_MIN_SURVIVORS: noise.min_survivors}


@dataclass(frozen=True)
class _Sums:
    """One protocol instance's unmasked, decoded sums and who is in them."""

    summed: Any
    weight: float
    weighted_work: float
    survivors: list[int]
    clipping: Clipping
    noise: DistributedNoise | None = None  # distributed DP: the encoding the devices noised with
    outside: int = 0  # ... entries of the sum brought back into range


@dataclass(frozen=True)
class _Expected:
    """What the masked step's replies are checked against."""

    senders: set[int]  # asked for a masked input
    digests: Mapping[int, Received]  # of what each was sent
    keys: Mapping[int, Keys]
    graph: Mapping[int, set[int]]
    server_round: int


@dataclass
class _Folded:
    """The masked step's outcome: the sum, who is in it (with its signature over what it was sent),
    and who reported bad shares instead (with the senders it named)."""

    total: Any
    received: dict[int, bytes]
    bad_shares: dict[int, list[int]]


class _BadShares(SecureRoundFailed):
    """Devices reported shares that do not open: the round starts again without ``blamed``
    (:meth:`SecureAggregation._attempts` catches it; this attempt failed, the round may not)."""

    def __init__(self, blamed: dict[int, str]) -> None:
        super().__init__(sorted(blamed))
        self.blamed = blamed


def _blame(reports: Mapping[int, list[int]], graph: Mapping[int, set[int]], threshold: int) -> dict[int, str]:
    """Who leaves the round for bad shares, and why: the senders named, except that a device
    naming more than ``k - t`` of its ``k`` neighbours is left out itself, its report ignored.

    An honest device names only neighbours that sealed it bad shares; more than ``k - t`` of
    them would be a dishonest majority around it, which the protocol assumes away
    (:func:`fedge.secagg.minimum_threshold`). So one lying device cannot clear its whole
    neighbourhood out of a round; it can name up to ``k - t`` honest neighbours, who then
    sit this round out (see the module's threat model).
    """
    blamed: dict[int, str] = {}
    for reporter, senders in sorted(reports.items()):
        if len(senders) > len(graph[reporter]) - threshold:
            blamed[reporter] = (f"secagg_masked: it reported bad shares from {len(senders)} of its "
                                f"{len(graph[reporter])} neighbours, more than {len(graph[reporter]) - threshold} "
                                "(an honest majority allows); report ignored")
    for reporter, senders in sorted(reports.items()):
        if reporter not in blamed:
            for sender in senders:
                blamed.setdefault(sender, f"secagg_share: the share it sealed for device {reporter} does not open "
                                          "or is malformed (reported by that device)")
    return blamed


def _sent_digests(instructions: Mapping[int, RecordDict], targets: Iterable[int],
                  params: ConfigRecord) -> dict[int, Received]:
    """The digests of the model and config each target is sent (each hashed once per distinct record: the
    instructions hold them, so their ids stay theirs meanwhile)."""
    by_record: dict[int, bytes] = {}
    by_config: dict[int, bytes] = {}
    digests = {}
    for node in targets:
        arrays, config = instructions[node][wire.ARRAYS], instructions[node][wire.CONFIG]
        if id(arrays) not in by_record:
            by_record[id(arrays)] = arrays_digest({name: array.numpy() for name, array in arrays.items()})  # type: ignore[union-attr]
        if id(config) not in by_config:
            by_config[id(config)] = config_digest(config, params)
        digests[node] = Received(by_record[id(arrays)], by_config[id(config)])
    return digests


def shares_needed(fraction: float, neighbours: int) -> int:
    """Shares needed to rebuild a secret: more than ``fraction`` of ``neighbours``, more than
    half of them, and at least 2 (capped at ``neighbours``).

    At least 2 so that no single neighbour holds a secret (with t = 1 every share is the
    secret, and one colluding neighbour could unmask anyone); more than half because devices
    refuse anything less (:func:`fedge.secagg.minimum_threshold`: with a minority threshold a
    coordinator that lies about dropouts could collect both secrets of one device).
    """
    return min(neighbours, max(minimum_threshold(neighbours), math.floor(fraction * neighbours) + 1))


def _enough_holders(graph: dict[int, set[int]], shared: list[int], holders: list[int], threshold: int,
                    what: str) -> None:
    """Stop before anything is revealed unless every secret the sum needs has ``threshold``
    holders among ``holders`` (the self-mask seed of a survivor, the mask key of a dropout)."""
    able = set(holders)
    short = [n for n in shared if len(graph[n] & able) < threshold]
    if short:
        raise SecureRoundFailed(f"{len(holders)} of {len(shared)} devices {what}; device {short[0]} has fewer than "
                                f"{threshold} such neighbours to rebuild its secret")


def _check_settings(*, threshold: float, neighbours: int, clip: float, precision: float, bits: int,
                    weight_clip: float, work_cap: float) -> None:
    """Refuse settings the protocol cannot run with, naming the run-config key to change."""
    checks = [
        (0.5 <= threshold <= 1, f"secagg-threshold = {threshold}: give a fraction in [0.5, 1] (devices refuse "
                                "a threshold of half their neighbours or less)"),
        (neighbours == 0 or neighbours >= 2, f"secagg-neighbours = {neighbours}: give 0 (all pairs) or 2 or more"),
        (clip > 0, f"secagg-clip = {clip}: give a clipping bound above 0"),
        (precision > 0, f"secagg-precision = {precision}: give a quantisation step above 0"),
        (8 <= bits <= 64, f"secagg-bits = {bits}: give a ring width in [8, 64]"),
        (weight_clip > 0, f"weight_clip = {weight_clip} (max-num-examples): give a largest weight above 0"),
        (work_cap > 0, f"work_cap = {work_cap}: give a largest normalised local work above 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _read_each(replies: Mapping[int, Message], read: Callable[[int, Message], T], step: str, consequence: str,
               server_round: int, report: RoundReport) -> dict[int, T]:
    """``read`` applied to each device's reply at ``step``; a malformed one is named and left out.

    ``read`` raises :class:`ProtocolError` for a malformed message; its sender is recorded
    as a failure of the round (``step: reason``) and logged with ``consequence``. Any other
    exception is a bug of this module and propagates.
    """
    accepted = {}
    for node, reply in replies.items():
        try:
            accepted[node] = read(node, reply)
        except ProtocolError as exc:
            report.failed.append(Rejection(node, f"{step}: {exc.reason}"))
            log.warning("round %d: device %d sent an %s; %s", server_round, node, exc.reason, consequence)
    return accepted


def _read_keys(node: int, reply: Message) -> Keys:
    """``node``'s three public keys from its setup reply, each usable, else :class:`ProtocolError`.

    A key of small order (e.g. all zeros) passes a length check but makes every honest
    neighbour's key agreement with it fail: without this check one device could make
    every secure round fail and have the errors land on honest devices.
    """
    record = _config(reply, "keys")
    if record is None:
        raise ProtocolError("invalid public key: no keys record", node_id=node)
    try:
        return {"c-pk": check_x25519_public(record.get("c-pk"), name="c-pk"),
                "s-pk": check_x25519_public(record.get("s-pk"), name="s-pk"),
                "g-pk": check_ed25519_public(record.get("g-pk"), name="g-pk")}
    except InvalidPublicKey as exc:
        raise ProtocolError(f"invalid public key: {exc}", node_id=node) from None


def _read_sealed(node: int, reply: Message, neighbours: set[int]) -> dict[int, bytes]:
    """The ciphertext ``node`` sealed for each of its ``neighbours``, by neighbour."""
    record = _config(reply, "sealed")
    if record is None:
        raise ProtocolError("invalid share reply: it has no sealed record", node_id=node)
    sealed = {peer: record.get(f"to/{peer}") for peer in sorted(neighbours)}
    missing = [peer for peer, value in sealed.items() if not isinstance(value, bytes)]
    if missing:
        raise ProtocolError(f"invalid share reply: no sealed shares for neighbours {missing}", node_id=node)
    return sealed  # type: ignore[return-value]  # every value checked to be bytes


def _read_masked(node: int, reply: Message, length: int, bits: int,
                 expected: _Expected) -> tuple[np.ndarray, bytes]:
    """``node``'s masked input (``length`` ring elements of Z_{2^bits}, header checked before
    decoding) and its signature over the digests of what it was sent (:func:`_read_received`)."""
    record = reply.content.get("masked")
    record = record if isinstance(record, ArrayRecord) else None
    if record is None:
        raise ProtocolError("invalid masked input: the reply has no masked record", node_id=node)
    signature = _read_received(node, reply, expected)
    try:
        decoded = decode_arrays(record, {"vector": ((length,), np.dtype(ring_dtype(bits)).name)})
    except UpdateRejected as exc:
        raise ProtocolError(f"invalid masked input: {exc.reason}", node_id=node) from None
    return decoded["vector"], signature


def _read_received(node: int, reply: Message, expected: _Expected) -> bytes:
    """``node``'s signature over the digests of the model and config this coordinator sent it.

    A device that signs other digests would make every neighbour refuse the survivor set
    (and the round fail); named here, it is left out of the sum instead.
    """
    record = _config(reply, wire.SECAGG_RECEIVED)
    if record is None:
        raise ProtocolError("invalid masked input: no signed digests of what it was sent", node_id=node)
    sent, signature = expected.digests[node], record.get("signature")
    if record.get("arrays") != sent.arrays or record.get("config") != sent.config:
        raise ProtocolError("invalid masked input: its digests are not those of the model and config it was sent",
                            node_id=node)
    if not valid_received_signature(expected.keys[node]["g-pk"], signature, server_round=expected.server_round,
                                    received=sent):
        raise ProtocolError("invalid masked input: its signature over what it was sent does not verify", node_id=node)
    return signature  # type: ignore[return-value]  # a valid signature is bytes


def _read_bad_shares(node: int, reply: Message, neighbours: set[int]) -> list[int]:
    """The neighbours ``node`` says sealed it shares that do not open: node ids among its neighbours."""
    senders = reply.content[wire.SECAGG_BAD_SHARES].get("senders")  # a ConfigRecord: _fold checked
    if (not isinstance(senders, list) or not senders or len(set(senders)) != len(senders)
            or not all(isinstance(p, int) and not isinstance(p, bool) and p in neighbours for p in senders)):
        raise ProtocolError("invalid bad-share report: not a list of distinct neighbours", node_id=node)
    return [int(p) for p in senders]


def _read_signature(node: int, reply: Message, public: bytes, signed: bytes) -> bytes:
    """``node``'s signature over this round's survivor set (``signed``: :func:`fedge.secagg.survivors_message`),
    verified with its signing key ``public``."""
    record = _config(reply, "consistency")
    signature = record.get("signature") if record is not None else None
    if not isinstance(signature, bytes) or not valid_signature(public, signature, signed):
        raise ProtocolError("invalid signature over the survivor set", node_id=node)
    return signature


def _read_revealed(node: int, reply: Message, holds: Mapping[int, int]) -> dict[str, bytes]:
    """The shares ``node`` revealed (``b/<owner>``, ``s/<owner>``) for the owners it ``holds``, each checked.

    ``holds`` maps each of ``node``'s neighbours to the index of the share ``node`` holds of
    its secrets: owners share with their neighbours in ascending order of node id (the
    order of the share step's ``neighbours``), the first at index 1. A share with another
    index was copied or forged. Shares of devices that are not ``node``'s neighbours are
    never read.
    """
    record = _config(reply, "revealed")
    if record is None:
        raise ProtocolError("invalid unmask reply: it has no revealed record", node_id=node)
    shares = {}
    for owner, index in sorted(holds.items()):
        for name in (f"b/{owner}", f"s/{owner}"):
            share = record.get(name)
            if share is None:
                continue
            if not isinstance(share, bytes) or len(share) != SHARE_BYTES:
                raise ProtocolError(f"invalid unmask reply: share {name} is not {SHARE_BYTES} bytes", node_id=node)
            if int.from_bytes(share[:2], "big") != index:
                raise ProtocolError(f"invalid unmask reply: share {name} carries index "
                                    f"{int.from_bytes(share[:2], 'big')}, not this device's {index}", node_id=node)
            shares[name] = share
    return shares


def _peer_record(keys: Mapping[int, Keys], neighbours: set[int], server_round: int,
                 threshold: int) -> ConfigRecord:
    """What one device needs for the share step: its neighbours and their public keys."""
    values: dict[str, Any] = {wire.SERVER_ROUND: server_round, "threshold": threshold, "neighbours": sorted(neighbours)}
    for peer in neighbours:
        for kind in PUBLIC_KEYS:
            values[f"{kind}/{peer}"] = keys[peer][kind]
    return _relayed(values)


def _relayed(values: dict[str, Any]) -> ConfigRecord:
    """A ``ConfigRecord`` of ``values``, the same as ``ConfigRecord(values)`` (items in the same order).

    What the coordinator relays (public keys, sealed shares, signatures, node ids, the round) was
    checked where it was read: bytes, ints and lists of ints. Flower's constructor type-checks
    each value again at ~3 us a value, and a round relays ~40 values per device per step (at 50
    devices, ~4,000 values: 10-15 ms of the coordinator's critical path); so values of exactly
    those types go straight into the record, anything else (or a Flower whose record no longer
    keeps a plain ``_data`` dict) through the checked constructor.
    """
    record = ConfigRecord()
    data = record.__dict__.get("_data")
    if type(data) is not dict or not all(_plain(value) for value in values.values()):
        return ConfigRecord(values)
    data.update(values)
    return record


def _plain(value: object) -> bool:
    kind = type(value)
    return kind is bytes or kind is int or (kind is list and all(type(item) is int for item in value))  # type: ignore[attr-defined]


def _config(reply: Message, name: str) -> ConfigRecord | None:
    """``reply.content.config_records.get(name)``, without the view of every record Flower builds on
    each such access (~20 us, and a view that refers to itself: :func:`fedge.strategies.policies.let_go`)."""
    record = reply.content.get(name)
    return record if isinstance(record, ConfigRecord) else None


def _distinct_keys(nodes: list[int], keys: Mapping[int, Keys], server_round: int,
                   report: RoundReport) -> list[int]:
    """``nodes`` less those whose public key another device also sent, each named.

    Devices refuse neighbours with equal keys (Bonawitz et al. §4, ShareKeys), so one device
    that copied another's public key would make its neighbours fail; the coordinator cannot
    tell the copy from the original and leaves both out.
    """
    holders: dict[bytes, set[int]] = {}
    for node in nodes:
        for kind in PUBLIC_KEYS:
            holders.setdefault(keys[node][kind], set()).add(node)
    clashing = {node for group in holders.values() if len(group) > 1 for node in group}
    for node in sorted(clashing):
        others = sorted({peer for group in holders.values() if node in group for peer in group} - {node})
        report.failed.append(Rejection(node, f"secagg_setup: a public key also sent by device {others[0]}"))
        log.warning("round %d: device %d sent a public key that device %d also sent; both left out", server_round,
                    node, others[0])
    return [node for node in nodes if node not in clashing]


def _work_momentum(rule: LinearRule) -> float:
    """FedNova's momentum in ``a_i`` for the devices; -1 for rules without a local-work norm."""
    momentum = rule.work_momentum
    return -1.0 if momentum is None else float(momentum)


def _counting_late(replies: Iterable[Message], sent: int, report: RoundReport) -> Iterator[Message]:
    """``replies`` passed on; once used up, the round counts the rest of ``sent`` as late (late,
    surplus to the deadline's K, or gone)."""
    kept = 0
    for reply in replies:
        kept += 1
        yield reply
    report.late += sent - kept
