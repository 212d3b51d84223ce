"""Every Python example in README.md and docs/ runs here, or names the test that runs the same call.

A new example that is neither fails :func:`test_every_python_example_is_run_or_covered`, so the
docs cannot grow snippets that nobody ran (issues 24 and 26: the Houses task and
``EdgeModel.run(features=...)`` failed as written).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# First line of an example -> the test that runs the same call (examples that need a live
# coordinator, a fleet of devices or a Flower Grid).
COVERED_ELSEWHERE = {
    "from pathlib import Path": "tests/test_deployment.py (run_device against a real TLS coordinator)",
    "from fedge.edge.delivery import pull": "tests/test_delivery.py (pull from a real bundle service)",
    "from fedge.clients.protocol_device import ProtocolDevice":
        "tests/test_gateway_deployment.py (ProtocolDevice.run against two live gateways)",
    "from fedge.strategies import FedAvg": "tests/test_flower_dropin.py (strategy.start in a plain Flower app)",
}


def python_examples() -> list[tuple[str, str]]:
    """(page, code) of every ```python block."""
    found = []
    for page in PAGES:
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            found.append((str(page.relative_to(ROOT)), code))
    return found


def _first_line(code: str) -> str:
    line = next(line for line in code.splitlines() if line.strip())
    return line.split("#", 1)[0].strip()


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    here = os.getcwd()
    os.chdir(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "houses_pkg" or m.startswith("houses_pkg.")]:
            del sys.modules[name]
        os.chdir(here)


def _example(page: str, first: str) -> str:
    matches = [code for p, code in python_examples() if p == page and _first_line(code) == first]
    assert len(matches) == 1, f"expected one example in {page} starting {first!r}"
    return matches[0]


def test_every_python_example_is_run_or_covered() -> None:
    # Prepare
    run_here = {
        ("docs/task-api.md", "import numpy as np, torch"),
        ("docs/flower-dropin.md", "from fedge.clients.app import make_client_app"),
        ("README.md", "from fedge.clients.app import make_client_app"),
        ("README.md", "from fedge.edge import EdgeModel"),
        ("docs/edge-bundles.md", "from fedge.edge import EdgeModel"),
        ("docs/edge-bundles.md", "import base64, hashlib, json, pathlib"),
        ("docs/strategies.md", "from typing import Any"),
        ("docs/strategies.md", "from fedge.strategies import AsynchronousDriver, FedAdam, FedAvg, SecureAggregation"),
        ("docs/sub-models.md", "import numpy as np, torch"),
        ("docs/operator.md", "import numpy as np"),
    }
    # Execute
    unaccounted = [(page, _first_line(code)) for page, code in python_examples()
                   if (page, _first_line(code)) not in run_here and _first_line(code) not in COVERED_ELSEWHERE]
    # Assert
    assert not unaccounted, f"examples neither run in tests/test_doc_examples.py nor covered elsewhere: {unaccounted}"


def test_the_operator_snippet_writes_the_training_partitions_and_no_held_out_row(in_tmp: Path) -> None:
    # Prepare
    from fedge.config import resolve_run_config
    from fedge.task.loading import load_task

    task = load_task(resolve_run_config({"task": "digits", "partitioner": "iid"}))
    held_out = {row.tobytes() for row in task.central_data().inputs[0]}  # type: ignore[union-attr]
    # Execute
    exec(_example("docs/operator.md", "import numpy as np"), {})
    # Assert: three files, of the task's training rows only
    shards = [np.load(in_tmp / f"phone{index}.npz") for index in range(3)]
    assert all(len(shard["x"]) == len(shard["y"]) > 0 for shard in shards)
    assert not any(row.tobytes() in held_out for shard in shards for row in shard["x"])


def _write_houses(root: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8))  # float64 on purpose, as a user's np.save would give
    y = x @ rng.normal(size=8) + 0.1 * rng.normal(size=400)
    np.save(root / "x.npy", x)
    np.save(root / "y.npy", y)
    (root / "houses_pkg").mkdir()
    (root / "houses_pkg" / "__init__.py").write_text("")
    (root / "houses_pkg" / "task.py").write_text(_example("docs/task-api.md", "import numpy as np, torch"))


def test_the_task_api_example_trains_as_the_docs_run_it(in_tmp: Path) -> None:
    # Prepare
    from fedge.simulation.runner import simulate

    _write_houses(in_tmp)
    from houses_pkg.task import Houses

    overrides = {"partitioner": "iid", "num-rounds": 3, "fleet": "laptop=6", "clients-per-round": 3,
                 "run-dir": str(in_tmp / "run"), "export-onnx": False}
    # Execute
    _, summary = simulate(overrides, task=Houses(), progress=False)
    # Assert: it trains (the devices' mse falls over the rounds) and stays finite
    import json

    rows = [json.loads(line) for line in (in_tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert summary["headline"] == "mse" and len(rows) == 4 and np.isfinite(summary["final_headline"])
    scored = [row["headline"] for row in rows if row.get("headline") is not None]  # devices evaluate
    assert len(scored) >= 2 and scored[-1] < scored[0]


@pytest.mark.parametrize("page", ["docs/flower-dropin.md", "README.md"])
def test_the_client_app_examples_make_a_flower_client_app(in_tmp: Path, page: str) -> None:
    # Prepare
    from flwr.clientapp import ClientApp

    _write_houses(in_tmp)
    from houses_pkg.task import Houses

    namespace: dict[str, Any] = {"MyTask": Houses}
    # Execute
    exec(_example(page, "from fedge.clients.app import make_client_app"), namespace)
    # Assert
    assert isinstance(namespace["app"], ClientApp)


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (one-round) digits run that signed a bundle."""
    from fedge.simulation.runner import simulate

    root = tmp_path_factory.mktemp("run")
    run_dir, _ = simulate({"model": "mlp", "num-rounds": 1, "fleet": "laptop=4", "clients-per-round": 2,
                           "local-epochs": 1, "run-dir": str(root / "run")}, progress=False)
    return run_dir


def _bundle_here(run_dir: Path, where: Path) -> None:
    bundle = sorted((run_dir / "bundles").iterdir())[-1]
    shutil.copytree(bundle, where / "bundle")
    shutil.make_archive(str(where / "bundle"), "zip", bundle)
    shutil.copy(run_dir / "keys" / "signing.pub", where / "signing.pub")


@pytest.mark.parametrize("page", ["README.md", "docs/edge-bundles.md"])
def test_the_edge_model_examples_run_on_a_signed_bundle(in_tmp: Path, signed_run: Path, page: str) -> None:
    # Prepare
    from sklearn.datasets import load_digits

    _bundle_here(signed_run, in_tmp)
    namespace: dict[str, Any] = {"raw_pixels": load_digits().data[:5]}
    # Execute
    exec(_example(page, "from fedge.edge import EdgeModel"), namespace)
    # Assert
    assert namespace["pred"].labels.shape == (5,)
    if "scores" in namespace:
        assert namespace["scores"].shape == (5, 10)


def test_verifying_without_fedge_example_passes_and_catches_an_altered_file(in_tmp: Path, signed_run: Path) -> None:
    # Prepare
    _bundle_here(signed_run, in_tmp)
    code = _example("docs/edge-bundles.md", "import base64, hashlib, json, pathlib")
    # Execute / Assert: the genuine bundle passes
    exec(code, {})
    with (in_tmp / "bundle" / "model.onnx").open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(AssertionError):
        exec(code, {})


def test_the_strategy_example_is_the_file_itself() -> None:
    # Prepare
    code = _example("docs/strategies.md", "from typing import Any")
    # Assert: the docs show strategies/median.py as it is (importing it registers the strategy)
    assert code in (ROOT / "strategies" / "median.py").read_text()


def test_the_composition_example_builds_what_it_says() -> None:
    # Prepare
    code = _example("docs/strategies.md", "from fedge.strategies import AsynchronousDriver, FedAdam, FedAvg, "
                                          "SecureAggregation")
    namespace: dict[str, Any] = {}
    # Execute
    exec(compile(code, "docs/strategies.md", "exec"), namespace)
    # Assert: FedAvg's rule under the secure driver, FedAdam's under the asynchronous one
    secure, asynchronous = namespace["secure_fedavg"], namespace["asynchronous_fedadam"]
    assert type(secure.driver).__name__ == "SecureAggregation" and type(secure.rule).__name__ == "Mean"
    assert type(asynchronous.driver).__name__ == "AsynchronousDriver"
    assert type(asynchronous.rule).__name__ == "Adaptive"


def test_the_sub_model_example_prints_the_shapes_it_shows(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare
    code = _example("docs/sub-models.md", "import numpy as np, torch")
    shown = re.search(r"print\(plan.sub_shapes\(0.25\)\)\s+# (.*)", code)
    assert shown is not None
    # Execute
    exec(compile(code, "docs/sub-models.md", "exec"), {})
    # Assert: the page's comment is what the code prints; the sub-model has the quarter's layers
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == shown.group(1)
    assert "Linear(in_features=8, out_features=16" in "\n".join(printed[1:])
