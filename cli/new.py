"""``fedge new NAME``: scaffold a task package, your own model and data, ready to federate.

The project it writes runs unmodified both ways fedge runs an app:

* ``fedge simulate --task NAME.task:Class`` (from inside the project directory), and
* ``flwr run .``: it is a Flower 1.42 app (``[tool.flwr.app]`` in its ``pyproject.toml``)
  whose components are fedge's ServerApp and ClientApp and whose run config names the task.

In Flower 1.42 federations (SuperLink connections) are no longer declared in an app's
``pyproject.toml``: they live in ``$FLWR_HOME/config.toml``, whose default ``local`` connection
(``address = ":local:"``) is a local simulation; a ``[tool.flwr.federations]`` table would be
migrated there by the first ``flwr run`` (rewriting the user's pyproject and global config),
so the template leaves it out and says how to size the simulated fleet instead.

The templates are string constants here (no package data). This module imports only the
standard library and :mod:`fedge.errors`: ``fedge --help`` stays free of torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from fedge.errors import ConfigError

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
MAX_NAME_LENGTH = 32  # Flower's limit on an app's name (flwr.supercore.constant.MAX_NAME_LENGTH)
FLEET = "phone=6,laptop=3,gpu-box=1"  # the scaffold's simulated fleet: 10 devices
FLEET_SIZE = 10
ROUNDS = 10
CLIENTS_PER_ROUND = 5


def add_parsers(sub: Any) -> None:
    """Register ``fedge new`` on ``sub``."""
    p = sub.add_parser(
        "new", help="scaffold a task package (your model and data) that runs with fedge simulate and flwr run",
        description="Create NAME/: a Flower app whose task (NAME/task.py, a working example to edit) runs with "
                    "`fedge simulate --task NAME.task:...` and `flwr run .`.")
    p.add_argument("name", metavar="NAME", help="the package name: a lower-case Python identifier, e.g. my_task")
    p.add_argument("--dir", type=Path, default=Path("."), metavar="PARENT",
                   help="where to create NAME/ (default: the current directory)")
    p.set_defaults(handler=_new)


def _new(args: argparse.Namespace) -> int:
    project = scaffold(args.name, args.dir)
    names = Names.of(args.name)
    print(f"created {project}/ (Flower app '{names.project}', task {names.reference}):")
    for path in sorted(project.rglob("*")):
        if path.is_file():
            print(f"  {path}")
    print("next, from inside the project:")
    print(f"  cd {project}")
    print(f"  {simulate_command(names)}")
    print(f"  {flwr_run_command()}")
    print(f"then edit {project / names.package / 'task.py'} to federate your own model and data "
          f"(see {project / 'README.md'})")
    return 0


@dataclass(frozen=True)
class Names:
    """What a scaffold calls things, from its package name."""

    package: str  # the Python package: my_task
    project: str  # the Flower app / distribution name (letters, digits, hyphens): my-task
    cls: str  # the Task subclass: MyTask

    @classmethod
    def of(cls, name: str) -> Names:
        """The names for package ``name`` (already checked by :func:`check_name`)."""
        camel = "".join(part.capitalize() for part in name.split("_"))
        task_class = camel if camel.endswith("Task") and camel != "Task" else f"{camel}Task"
        return cls(package=name, project=name.replace("_", "-").strip("-"), cls=task_class)

    @property
    def reference(self) -> str:
        """The run-config ``task`` value: ``my_task.task:MyTask``."""
        return f"{self.package}.task:{self.cls}"


def check_name(name: str, parent: Path) -> None:
    """Refuse a package name that cannot become a working project in ``parent``.

    Raises
    ------
    ConfigError
        One line naming what is wrong: not a lower-case identifier, a keyword, too long,
        shadowing an importable module, an existing path, or a parent that is no directory.
    """
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"NAME {name!r} must be a lower-case Python identifier: a letter, then lower-case "
                          "letters, digits or underscores (e.g. my_task)")
    if keyword.iskeyword(name):
        raise ConfigError(f"NAME {name!r} is a Python keyword; choose another name (e.g. {name}_task)")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(f"NAME {name!r} is longer than {MAX_NAME_LENGTH} characters, Flower's limit for app names")
    if importlib.util.find_spec(name) is not None:
        raise ConfigError(f"NAME {name!r} is already an importable module; a package of that name would shadow it "
                          f"(or be shadowed): choose another name (e.g. {name}_task)")
    if not parent.is_dir():
        raise ConfigError(f"--dir '{parent}' is not a directory; create it first or choose another")
    if (parent / name).exists() or (parent / name).is_symlink():
        raise ConfigError(f"'{parent / name}' already exists; choose another NAME or --dir")


def render(name: str) -> dict[str, str]:
    """The scaffold's files for package ``name``: path relative to the project -> text."""
    names = Names.of(name)
    values = {"package": names.package, "project": names.project, "cls": names.cls,
              "reference": names.reference, "fleet": FLEET, "fleet_size": str(FLEET_SIZE),
              "rounds": str(ROUNDS), "clients_per_round": str(CLIENTS_PER_ROUND),
              "simulate": simulate_command(names), "flwr_run": flwr_run_command()}
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        ".gitignore": GITIGNORE,
        f"{name}/__init__.py": INIT,
        f"{name}/task.py": TASK,
        f"{name}/server_app.py": SERVER_APP,
        f"{name}/client_app.py": CLIENT_APP,
    }
    return {path: Template(text).substitute(values) for path, text in files.items()}


def scaffold(name: str, parent: Path) -> Path:
    """Create ``parent/name``: a task package and Flower app. Nothing is written if ``name`` is refused.

    Returns
    -------
    Path
        The new project directory.

    Raises
    ------
    ConfigError
        See :func:`check_name`.
    """
    check_name(name, parent)
    files = render(name)
    project = parent / name
    try:
        project.mkdir()
    except FileExistsError:
        raise ConfigError(f"'{project}' already exists; choose another NAME or --dir") from None
    try:
        for relative, text in files.items():
            path = project / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    except OSError:
        shutil.rmtree(project, ignore_errors=True)  # ours: created above; leave no half project behind
        raise
    return project


def simulate_command(names: Names) -> str:
    """The ``fedge simulate`` command line that runs the scaffold's pyproject settings inline."""
    return (f"fedge simulate --task {names.reference} --rounds {ROUNDS} --fleet {FLEET} "
            f"--clients-per-round {CLIENTS_PER_ROUND}")


def flwr_run_command() -> str:
    """The ``flwr run`` command line for a local simulation as large as the scaffold's fleet."""
    return (f'FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run . local '
            f'--federation-config "num-supernodes={FLEET_SIZE}" --stream')


# ---------------------------------------------------------------------------------------------- templates
# string.Template: $name / ${name} are filled in, $$ is a literal dollar sign.

PYPROJECT = '''\
# A Flower app (Flower 1.42) that federates the task in ${package}/task.py with fedge's
# coordinator (ServerApp) and device (ClientApp). See README.md.

[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "${project}"
version = "1.0.0"
description = "A federated learning task on fedge and Flower"
license = "Apache-2.0"
requires-python = ">=3.11"
dependencies = [
    "fedge",                       # brings torch, numpy and Flower; install it from its source first
    "flwr[simulation]>=1.42,<1.43",
]

[tool.setuptools]
packages = ["${package}"]

# ---------------------------------------------------------------- the Flower app
[tool.flwr.app]
publisher = "your-name"

[tool.flwr.app.components]
serverapp = "${package}.server_app:app"
clientapp = "${package}.client_app:app"

# The run config: fedge's knobs (`python -m fedge.knobs` lists all of them with their defaults).
# Keys left out take fedge's defaults; `flwr run . --run-config "key=value"` can override only
# the keys listed here, so add any knob you want to vary.
[tool.flwr.app.config]
# the task: package.module:object, importable from this folder
task = "${reference}"
num-rounds = ${rounds}
clients-per-round = ${clients_per_round}
# ${fleet_size} simulated devices: run Flower's simulation with num-supernodes = ${fleet_size}
fleet = "${fleet}"
local-epochs = 5
batch-size = 16
learning-rate = 0.05
# how simulated devices split train_data(): "dirichlet" label skew or "iid" equal shares
partitioner = "dirichlet"
seed = 42
# where runs are written: runs-root/<name>, relative to where the ServerApp runs (see
# README.md), or exactly run-dir when set
runs-root = "runs"
run-dir = ""
export-onnx = true

# Federations: in Flower 1.42 these are SuperLink connections in $$FLWR_HOME/config.toml
# (default ~/.flwr/config.toml), not in this file. Its default connection `local`
# (address = ":local:") is a local simulation; size it to the fleet above with
#   flwr run . local --federation-config "num-supernodes=${fleet_size}" --stream
'''

GITIGNORE = '''\
# kept out of git and out of the app bundle `flwr run` uploads
runs/
__pycache__/
*.pyc
*.egg-info/
.venv/
'''

INIT = '''\
"""${package}: a federated learning task for fedge (the task is in ${package}/task.py)."""
'''

SERVER_APP = '''\
"""The coordinator: fedge's Flower ServerApp (``serverapp`` in pyproject.toml).

It reads the run config (``[tool.flwr.app.config]`` plus any ``--run-config`` overrides),
loads the task it names (``task = "${reference}"``), checks it, runs the federated
rounds with the strategy and fleet the config names, evaluates the global model after
every round and writes the run directory (config, metrics.jsonl, summary.json, plots,
checkpoints, model.onnx). Nothing here needs editing for a new model or data set.
"""

from fedge.server.app import make_server_app

# progress=False: under `flwr run` the output is a log stream, not a terminal.
# config_defaults={...} would change fedge's defaults for keys the run config leaves out.
app = make_server_app(progress=False)
'''

CLIENT_APP = '''\
"""The device: fedge's Flower ClientApp (``clientapp`` in pyproject.toml).

Each device builds the task the run names (``task = "${reference}"``), trains its model on
its own data (a simulated device: its partition of ``train_data()``; a deployed device: the
file given by ``fedge device --data``, read by ``device_data()``) and replies with the
update, ``num-examples`` and its metrics. Nothing here needs editing for a new model or data.
"""

from fedge.clients.app import make_client_app

app = make_client_app()
'''

TASK = '''\
"""The ${package} task: what is federated. Edit this file to federate your own model and data.

fedge reaches the model and the data only through the Task below: the coordinator builds
the initial model and scores it on ``central_data()`` after every round, each simulated
device trains on its share of ``train_data()`` (a deployed device on ``device_data(path)``),
and signed ONNX bundles carry ``inputs`` and ``labels``. Everything else (strategies,
secure aggregation, differential privacy, compression, deadlines, checkpoints, the
dashboard) works unchanged on whatever this class declares.

The example: a small MLP classifies 16-feature points into 4 classes, each class being two
clusters of generated points, so it runs anywhere without downloads. Run it from the
folder that holds pyproject.toml:

    ${simulate}
    ${flwr_run}

fedge checks the task at start (the model builds the same from one seed, a batch of data
matches ``inputs``, the output fits the loss, the metrics include ``headline``) and names
the fix when something does not fit.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
from fedge.config import RunConfig
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData, classification_metrics
from torch import nn

# ---- the example's data set: replace with your own (see train_data and central_data)
NUM_FEATURES = 16
NUM_CLASSES = 4
CLUSTERS_PER_CLASS = 2  # two clusters per class: the classes are not convex blobs
CLUSTER_SPREAD = 0.9  # distance scale of the cluster centres (noise is 1): larger is easier
TRAIN_EXAMPLES, TEST_EXAMPLES = 4000, 1000
WORLD_SEED = 20240  # fixes the cluster centres: the same "world" in every process


def generate(num_examples: int, seed: int) -> TaskData:
    """``num_examples`` labelled points: each around one of its class's cluster centres, Gaussian noise."""
    centres = np.random.default_rng(WORLD_SEED).normal(
        scale=CLUSTER_SPREAD, size=(NUM_CLASSES, CLUSTERS_PER_CLASS, NUM_FEATURES))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, num_examples)
    clusters = rng.integers(0, CLUSTERS_PER_CLASS, num_examples)
    points = centres[labels, clusters] + rng.normal(size=(num_examples, NUM_FEATURES))
    return TaskData.from_xy(points.astype(np.float32), labels.astype(np.int64))


class ${cls}(Task):
    """Classify 16-feature points into 4 classes with a one-hidden-layer MLP.

    fedge builds it as ``${cls}(config)`` with the run config (every knob, e.g.
    ``config.integer("seed")``, ``config.text("data-path")``) in every process that needs it.
    """

    # ---- what reports, bundles and the dashboard show
    name = "${package}"
    headline = "accuracy"  # a key of metrics(); e.g. "mse" for a regression
    higher_is_better = True  # False for a loss, an error, a perplexity
    # The model's input signature: model(features) with features float32 [batch, 16]. One
    # InputSpec per argument of forward(); a string names a dynamic axis (the first is the batch).
    inputs = (InputSpec("features", ("batch", NUM_FEATURES)),)
    labels = tuple(f"class-{index}" for index in range(NUM_CLASSES))  # None for a regression
    # For a regression also set target_dtype = "float32" (targets are int64 class indices by default).

    def __init__(self, config: RunConfig | None = None) -> None:
        self.seed = config.integer("seed") if config is not None else 42

    # ---- the model
    def build_model(self) -> nn.Module:
        """A new model with fresh weights. fedge seeds torch first, so that the coordinator and
        every device start from the same weights: create every weight with torch, in here."""
        return nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES))

    # ---- data (made once per process: cached)
    @cached_property
    def _train(self) -> TaskData:
        return generate(TRAIN_EXAMPLES, self.seed)

    @cached_property
    def _test(self) -> TaskData:
        return generate(TEST_EXAMPLES, self.seed + 1)

    def train_data(self) -> TaskData:
        """All training examples; simulation splits them into one partition per device
        (run config ``partitioner``: ``dirichlet`` label skew, or ``iid``).

        Your own: ``TaskData.from_xy(x, y)`` with examples on axis 0, e.g. from
        ``np.load("train.npz")``; ``TaskData((a, b), y)`` for a model of two inputs;
        ``fedge.task.loaders.from_dataset(dataset, self)`` for a torch ``Dataset``. To give
        each simulated device a natural split of its own (per user, per site), override
        ``partition(self, partition_id, num_partitions, config)`` instead.
        """
        return self._train

    def central_data(self) -> TaskData | None:
        """Held-out examples the coordinator scores the global model on after every round.

        Return None when the coordinator has no data of its own: the devices then evaluate
        the global model on theirs (federated evaluation).
        """
        return self._test

    def device_data(self, path: str) -> TaskData:
        """A deployed device's own examples, from the file given by ``fedge device --data PATH``.

        The default reads ``.npz`` (an array per input name, here ``features``, or ``x``; and
        ``y``) or ``.csv`` (a ``label`` column). Override it to read your own format.
        """
        return super().device_data(path)

    # ---- training and evaluation
    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of a batch, a mean over its examples (regression: ``F.mse_loss``)."""
        return nn.functional.cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Named metrics of a batch, as means over its examples; ``headline`` must be one of them."""
        return classification_metrics(outputs, targets)  # {"loss": ..., "accuracy": ...}

    # More you may override (see fedge.task.api.Task): optimizer(params, *, lr, momentum)
    # (any torch.optim optimizer; default SGD with momentum), forward(model, inputs),
    # summarize(metrics) (derived metrics, e.g. perplexity), preprocessing and output
    # (what bundles tell an app about the inputs and the output).
'''

README = '''\
# ${package}

A federated learning task on fedge and Flower 1.42: your model and data in
`${package}/task.py`, trained by a simulated fleet on this machine or by real devices.

| file | what it is |
|---|---|
| `${package}/task.py` | **the task: model, data, loss, metrics. Edit this.** |
| `pyproject.toml` | the Flower app: its components and run config (`task = "${reference}"`) |
| `${package}/server_app.py` | the coordinator: fedge's ServerApp |
| `${package}/client_app.py` | the device: fedge's ClientApp |

The example task classifies generated 16-feature points into 4 classes with a small MLP;
its accuracy climbs from about chance (0.25) to about 0.9 within a few rounds.

## Run it on a simulated fleet

From this folder (the one holding `pyproject.toml`), either way:

```bash
${simulate}
```

fedge's inline simulator: fast, one process. It takes its settings from flags and fedge's
defaults (not from `pyproject.toml`); the flags above match the pyproject's run. More:
`--strategy fedprox`, `--run-config "local-epochs=2 learning-rate=0.1"`, `fedge simulate --help`.
It writes `runs/<name>/` (`summary.json`, `metrics.jsonl`, plots, checkpoints, `model.onnx`);
watch a run with `fedge dashboard runs/<name>`.

```bash
${flwr_run}
```

Flower's own runtime (a local SuperLink and the Ray simulation engine) runs this folder as
a Flower app, with the run config from `pyproject.toml`:

- `num-supernodes` must equal the fleet's size (`fleet` in `pyproject.toml`: ${fleet_size} devices);
  Flower's default is 2.
- `FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1` runs the app with the fedge installed
  here instead of letting Flower install the dependencies into a fresh environment (which
  needs a package index that has fedge). Set it for the first `flwr run`: that one starts
  the local SuperLink, which keeps running in the background (127.0.0.1:39091) for later
  runs. Flower 1.42 has no command to stop it: `pgrep -af flower-superlink`, then `kill PID`.
- Federations (SuperLink connections) live in `$$FLWR_HOME/config.toml` (default
  `~/.flwr/config.toml`), not in `pyproject.toml`; the `local` one is created on first use.
- The ServerApp runs in the SuperLink's working directory, so `runs/` is relative to the
  folder the SuperLink was started from. To choose: `--run-config "run-dir='$$PWD/runs/try-1'"`.
- `--run-config "num-rounds=20 learning-rate=0.1"` overrides keys listed under
  `[tool.flwr.app.config]`; add any fedge knob there first (`python -m fedge.knobs` lists them).

## Make it yours

Everything is in `${package}/task.py`, each part commented:

- `build_model()`: your `torch.nn.Module` (fedge seeds torch before calling it).
- `inputs`: the model's input signature (one `InputSpec` per `forward` argument), `labels`.
- `train_data()` / `central_data()`: your examples as `TaskData` (numpy arrays, examples
  on axis 0); `partition()` for a natural per-device split; `device_data(path)` for what a
  deployed device reads.
- `loss()`, `metrics()`, `headline`, `higher_is_better`: what is minimised and what is reported.

Run `fedge simulate` after each change: a task that cannot work is refused at start with
one line naming the fix.

## Deploy it on real devices

Install this package next to fedge on the coordinator and on every device (`pip install -e .`
from this folder), so that `${package}.task` is importable there. Then, with fedge's
deployment commands (TLS and device authentication on by default):

```bash
# coordinator
fedge keys init keys/ --host coord.example.org
fedge keys add-device phone-001 --dir keys/
fedge coordinator start --keys keys/ --host 0.0.0.0 --rounds ${rounds} --clients-per-round 2 \\
      --run-config "task='${reference}'"
# each device, with its own data file (.npz with features/x and y, or .csv; see device_data)
fedge device --coordinator coord.example.org:9095 --task ${reference} \\
      --data my-data.npz --key phone-001.key --ca ca.crt
```

A device runs a `package.module:object` task only when its owner named it (`--task`), so a
coordinator cannot make devices run code they did not choose. With Flower's own deployment
runtime instead (`flower-superlink`, `flower-supernode`, `flwr run . <connection>`), give
each SuperNode `--node-config "data-path='my-data.npz' task='${reference}'"` and set
`deployment = true` in the run config.
'''
