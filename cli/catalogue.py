"""What ``fedge simulate --help`` lists: every registered strategy, round policy, selector and codec.

The names come from the registries themselves, read only when help is printed (importing the
strategies loads Flower, which ``fedge --version`` or ``fedge device`` should not pay for).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


class Lazy:
    """A string computed when first formatted (argparse formats help with ``%``)."""

    def __init__(self, make: Callable[[], str]) -> None:
        self._make = make

    def __str__(self) -> str:
        return self._make()


def strategy_names() -> str:
    """The strategies ``fedge.strategies`` registers, comma-separated."""
    import fedge.strategies  # noqa: F401 - registers every strategy
    from fedge.strategies.registry import REGISTRY

    return ", ".join(sorted(REGISTRY))


def catalogue() -> str:
    """Round policies, selectors and codecs, with where to read about each."""
    from fedge.codec import QUANTISERS
    from fedge.knobs import KNOBS, ROUND_POLICY, SELECTOR

    policies = ", ".join(KNOBS[ROUND_POLICY].choices or ())
    selectors = ", ".join(KNOBS[SELECTOR].choices or ())
    codecs = ", ".join(QUANTISERS)
    return (f"round policies (round-policy=): {policies} (docs/simulation.md); selectors (selector=): {selectors}; "
            f"codecs (codec.PROFILE=, downlink.PROFILE=): {codecs}, topk:F, topk:F+CODEC (docs/compression.md)")


def describe(action: argparse.Action, **names: Callable[[], str]) -> argparse.Action:
    """Give ``action`` lazily computed help fields (``%(NAME)s`` in its help)."""
    for name, make in names.items():
        setattr(action, name, Lazy(make))
    return action


def no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Refuse abbreviated options (``--round`` for ``--rounds``) in ``parser`` and every sub-command."""
    parser.allow_abbrev = False
    for action in parser._actions:  # argparse keeps sub-commands here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                no_abbreviations(child)


# The extra that brings what each command needs (pyproject's [project.optional-dependencies]).
EXTRA_OF_COMMAND = {"simulate": "sim", "coordinator": "sim", "dashboard": "dashboard", "export": "torch",
                    "new": "sim", "compare": "sim", "device": "device", "pull": "edge", "verify": "edge",
                    "predict": "edge"}
# Modules that only an extra installs (the base install has numpy and cryptography).
OPTIONAL_MODULES = frozenset({"torch", "flwr", "onnx", "onnxruntime", "onnxscript", "ray", "sklearn", "matplotlib",
                              "rich", "starlette", "uvicorn", "psutil"})


def missing_extra(command: str, exc: ModuleNotFoundError) -> str | None:
    """One line naming the extra to install, when ``exc`` is a module an extra brings (else None)."""
    module = (exc.name or "").split(".", 1)[0]
    if module not in OPTIONAL_MODULES:
        return None
    extra = EXTRA_OF_COMMAND.get(command, "all")
    return (f"'fedge {command}' needs {module}, which this install lacks: install the '{extra}' extra "
            f"(pip install 'fedge[{extra}]')")
