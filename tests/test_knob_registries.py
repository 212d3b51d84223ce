"""Lists the core cannot derive from a registry above it stay that registry's list (issue 40 §3).

The ``sub-models`` knob's choices are typed out in :mod:`fedge.knobs` because the core may not
import :mod:`fedge.strategies` (and a device resolves its run config without the strategies);
these tests keep them the extraction registry's names. The gateway's ``--uplink`` choices are
the device protocol's encodings (:data:`fedge.codec.ENCODINGS`).
"""

from __future__ import annotations

import argparse

from fedge.knobs import KNOBS, SUB_MODELS


def test_the_sub_models_knob_offers_off_and_exactly_the_registered_extractions() -> None:
    from fedge.strategies.submodels import EXTRACTIONS  # noqa: PLC0415

    assert KNOBS[SUB_MODELS].allowed() == ("off", *EXTRACTIONS)


def test_the_gateways_uplink_choices_are_the_device_protocols_encodings() -> None:
    from fedge.cli.gateway import add_parsers  # noqa: PLC0415
    from fedge.codec import ENCODINGS  # noqa: PLC0415

    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command"))
    namespaces = [parser]
    choices: list[object] = []
    while namespaces:  # every (sub)parser's --uplink
        current = namespaces.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                namespaces.extend(action.choices.values())
            elif "--uplink" in action.option_strings:
                choices.append(tuple(action.choices or ()))
    assert choices == [tuple(ENCODINGS)]
