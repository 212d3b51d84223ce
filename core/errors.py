"""fedge's error hierarchy: every message says what went wrong and what to do."""

from __future__ import annotations


class FedgeError(Exception):
    """Base class of every error fedge raises on purpose."""


class ConfigError(FedgeError, ValueError):
    """A run-config key, CLI flag, fleet or data set that cannot be used as given.

    The CLI prints the message on one line and exits with status 2.
    """


class CheckpointMismatch(ConfigError):
    """A checkpoint whose arrays or config do not match the model being run."""


class DeviceFault(FedgeError):
    """Something a device sent that fedge refused; the sender is left out and the round goes on.

    Parameters
    ----------
    reason : str
        What is wrong, in words an operator can act on.
    node_id : int | None
        The Flower node id of the sender, when known.
    """

    def __init__(self, reason: str, *, node_id: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.node_id = node_id


class UpdateRejected(DeviceFault):
    """A device's reply failed validation and was left out of aggregation."""


class BundleVerificationError(FedgeError):
    """An edge bundle failed signature, trust or hash verification."""


class ExportError(FedgeError):
    """The model could not be exported to ONNX, or the export disagrees with torch.

    The message names the exporter's complaint; the usual fix is a model made of layers
    the ONNX exporter supports (see ``fedge export --help``).
    """


class SecureRoundFailed(FedgeError):
    """A secure-aggregation round that cannot finish: too few devices to unmask, or an
    unmasked sum that is out of range (a wrong share).

    The coordinator keeps the global model, records the round as not aggregated and goes
    on with the next round.
    """


class ProtocolError(DeviceFault):
    """A secure-aggregation protocol message that is malformed or breaks the protocol.

    Raised where the message is read. On the coordinator its sender is named and left out
    of the round (the round goes on without it, as for a dropout).
    """


class DeviceProtocolError(DeviceFault):
    """A request of fedge's device protocol (``docs/device-protocol.md``) that is malformed,
    unauthenticated or out of turn.

    The gateway answers it with an HTTP error whose JSON body says what was wrong and what to
    do; nothing the request carried reaches a round.
    """

    status = 400


class RunFailed(FedgeError):
    """A run that cannot go on, or that ended without a model worth shipping.

    Every update left out for one and the same reason round after round, no update
    accepted in the whole run, or a global model that is not finite. Nothing of it is
    signed or published; the CLI prints the message on one line and exits with status 1.
    """


class Stopped(FedgeError):
    """SIGTERM or SIGINT arrived: stop every process started, say so in one line, exit 0.

    Raised by the signal handlers of ``fedge coordinator start`` and ``fedge device``;
    ``signum`` is the signal's number.
    """

    def __init__(self, signum: int) -> None:
        import signal  # noqa: PLC0415

        super().__init__(signal.Signals(signum).name)
        self.signum = signum
