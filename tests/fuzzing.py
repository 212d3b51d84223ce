"""Shared settings for the parser fuzz tests (hypothesis).

The default suite runs a few thousand cases per parser; set ``FEDGE_FUZZ_EXAMPLES``
(for example ``FEDGE_FUZZ_EXAMPLES=50000 make test-fast``) to run more.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES = int(os.environ.get("FEDGE_FUZZ_EXAMPLES", "2000"))


def fuzz(examples: int | None = None) -> settings:
    """Hypothesis settings for a fuzz test: ``examples`` cases (default :data:`FUZZ_EXAMPLES`), no deadline."""
    return settings(max_examples=examples or FUZZ_EXAMPLES, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
