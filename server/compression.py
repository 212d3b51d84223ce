"""The coordinator's side of update compression: the per-profile policy and the downlink.

Devices encode their own uplink (they read the policy from the train instruction and
know their profile); the coordinator decodes replies in validation (see
:mod:`fedge.strategies.validation`) and, for profiles that ask (``downlink.<profile>``),
sends the global model in fp16 or int8, encoded once per codec per round.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedge import knobs, wire
from fedge.codec import codec_for, encode_tensor, parse_codec
from fedge.config import CODEC_PREFIXES, Scalar, codec_policy
from fedge.errors import ConfigError
from fedge.profiles import Fleet
from fedge.strategies.node_profiles import NodeProfiles

log = logging.getLogger("fedge.server.compression")


def check_codecs(config: Mapping[str, Scalar], fleet: Fleet) -> None:
    """Refuse a codec policy that cannot apply: unknown profiles, or combinations fedge cannot run.

    Raises
    ------
    ConfigError
        A ``codec.<profile>`` naming no profile of the fleet, or compression together with
        secure aggregation or differential privacy.
    """
    policy = {key: value for key, value in codec_policy(config).items() if value}
    for key in policy:
        profile = key.split(".", 1)[1]
        if profile != "default" and profile not in fleet.profiles:
            raise ConfigError(f"run-config '{key}' names profile '{profile}', which the fleet does not have; "
                              f"profiles: {', '.join(sorted(fleet.profiles))}")
    lossy = sorted(key for key, value in policy.items() if not parse_codec(str(value), key=key).lossless)
    if lossy and config[knobs.SECURE_AGGREGATION]:
        raise ConfigError(f"{lossy[0]} = '{policy[lossy[0]]}' cannot be combined with secure-aggregation: the protocol "
                          "quantises updates itself; send fewer bytes with a smaller secagg-bits / coarser "
                          "secagg-precision instead")
    if lossy and config[knobs.DP] != "off":
        raise ConfigError(f"{lossy[0]} = '{policy[lossy[0]]}' cannot be combined with dp = '{config[knobs.DP]}' yet "
                          "(Flower's clipping works on plain arrays); drop one of them")


class DownlinkEncoder:
    """Sends each device the global model in the codec its profile asks for.

    A device's profile comes from the grid when it knows it (fedge's simulation) or from
    the profile the device named in its last reply (deployment); until then, the default.
    """

    def __init__(self, config: Mapping[str, Scalar], *, seed: int = 0) -> None:
        self.policy = {k: v for k, v in config.items() if k.startswith(CODEC_PREFIXES)}
        self.rng = np.random.default_rng(seed)
        self.profiles = NodeProfiles()
        self._cache: dict[tuple[int, str, int], tuple[ArrayRecord, ArrayRecord]] = {}

    @property
    def active(self) -> bool:
        """Whether any profile gets a compressed downlink."""
        return any(not parse_codec(str(v)).lossless for k, v in self.policy.items() if k.startswith("downlink."))

    def record_for(self, node: int, record: RecordDict, grid: Grid, server_round: int) -> RecordDict:
        """``record`` with its arrays encoded for ``node``'s profile (unchanged for fp32).

        Encoded once per codec and per model a round sends (the global model, or one
        sub-model per width and window: keyed by the record's identity, which the cache holds).
        """
        codec = codec_for(self.profile_of(node, grid), self.policy, "downlink")
        if codec.lossless:
            return record
        arrays = record.array_records[wire.ARRAYS]
        key = (server_round, codec.name, id(arrays))
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == server_round}
            self._cache[key] = (arrays, ArrayRecord({name: encode_tensor(array.numpy(), codec, self.rng, full=True)
                                                     for name, array in arrays.items()}))
        return RecordDict({wire.ARRAYS: self._cache[key][1], wire.CONFIG: record.config_records[wire.CONFIG]})

    def profile_of(self, node: int, grid: Grid) -> str:
        """The profile of ``node``, as far as the coordinator knows it."""
        return self.profiles.of(node, grid)

    def learn(self, replies: list[Message]) -> None:
        """Remember the profiles devices named in their replies."""
        self.profiles.learn(replies)
