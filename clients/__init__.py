"""The client SDK a device app embeds: ``make_client_app(model_fn, data_fn)``."""

from fedge.profiles import BUILTIN_PROFILES, DeviceProfile, Fleet, parse_fleet

__all__ = ["BUILTIN_PROFILES", "DeviceProfile", "Fleet", "parse_fleet"]
