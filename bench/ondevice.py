"""On-device training: torch devices vs onnx devices (the signed training graph on onnxruntime + numpy).

Six sections, each behind its own flag (none given: all six), every number measured in
this run against a torch baseline measured in the same run:

1. ``--steps``: time of one training step (forward, loss, backward, SGD + momentum) per
   built-in model, 1 thread: torch eager (``train_local``'s step) vs the exported graph
   (``OnnxTrainer.gradients`` + ``MomentumUpdate.step``), batch 1/16/32, median of N steps
   after warm-up; peak RSS of a fresh subprocess that runs only that runtime's steps.
2. ``--startup``: a device process that imports what a torch device imports and trains one
   local round (the demo's digits CNN, 5 epochs, batch 16) vs one that imports the onnx
   device path only (torch must stay out of ``sys.modules``) and trains the same round
   from a signed training bundle: time to the first step done, total wall, peak RSS.
3. ``--install``: fresh virtualenvs per extra (``pip install /work/main[EXTRA]``; torch pinned
   first as the Makefile does), their size on disk and the pip time; cached in
   ``.cache/bench-venvs`` (``--rebuild-venvs`` starts over).
4. ``--deploy``: round latency of a real coordinator and 2 devices on 127.0.0.1
   (:class:`fedge.simulation.loopback.LoopbackFederation`, as ``bench/deploy_latency.py``),
   the demo model, torch devices vs ``fedge device --runtime onnx`` devices (run from the
   ``device`` venv of section 3 when it exists: no torch installed at all).
5. ``--accuracy``: the demo (``fedge simulate`` defaults: digits CNN, 50 rounds) with a torch
   fleet vs an onnx fleet (``runtime='onnx'``), seeds 0, 1, 2: final accuracy.
6. ``--browser``: the web SDK in headless Chromium (onnxruntime-web's WebAssembly build in a Web
   Worker) vs the Python onnx device on the demo device's shard and signed bundle: bundle verify
   and graph load, one 16-example step (median), one local round, the bundle's download size; and
   the browser's secure round (``web/secagg.js``): each of one device's five steps at 100,000
   parameters in a pool of 10 (the page plays all ten; the masked step without its training), the
   extra time over a plain round, and secure / plain with the demo's local round measured here.

Usage: python bench/ondevice.py [--steps] [--startup] [--install] [--deploy] [--accuracy] [--browser] [options]
Writes bench/results/ondevice.json (sections run now replace their entry; others are kept)
and prints a table per section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Only the standard library at module level: the workers below run this file in processes
# (and virtualenvs) that must not load torch, psutil or rich.
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "ondevice.json"
VENVS = REPO / ".cache" / "bench-venvs"
TORCH_PIN = "torch==2.13.0"
MODELS: dict[str, dict[str, Any]] = {
    "digits-cnn": {"task": "digits", "model": "cnn"},
    "digits-mlp": {"task": "digits", "model": "mlp"},
    "digits-logreg": {"task": "digits", "model": "logreg"},
    "synthetic-mlp": {"task": "synthetic", "model": "mlp"},
    "images": {"task": "images"},
    "chars": {"task": "chars"},
    "diabetes": {"task": "diabetes"},
}
DEMO_ROUND = {"epochs": 5, "batch_size": 16, "learning_rate": 0.05, "momentum": 0.9, "seed": 0}
DEPLOY_CONFIG = "model='cnn' export-onnx=false round-timeout=60.0 grid-poll-interval=0.1"
DEPLOY_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}


# =========================================================================== workers
# Each worker runs in a fresh interpreter (``python bench/ondevice.py --worker KIND SPEC OUT``),
# reads a JSON spec and writes a JSON result; its peak RSS is its own ``VmHWM``.


def _peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss``, not inherited from the forking parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _median_ms(step: Callable[[], object], warmup: int, steps: int) -> dict[str, float]:
    """Median and p90 milliseconds of ``step`` over ``steps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * (len(times) - 1))]}


def worker_step_torch(spec: dict[str, Any]) -> dict[str, Any]:
    """Torch eager training steps (``train_local``'s body) at each batch size, 1 thread."""
    import numpy as np
    import torch

    from fedge.config import resolve_run_config
    from fedge.task.api import seeded_model
    from fedge.task.loading import load_task
    from fedge.task.training import MomentumSGD

    torch.set_num_threads(1)
    task = load_task(resolve_run_config(spec["config"]))
    batch = np.load(spec["batch"])
    inputs = [torch.from_numpy(batch[f"x{i}"]) for i in range(spec["num_inputs"])]
    targets = torch.from_numpy(batch["y"])
    out: dict[str, Any] = {"batches": {}}
    for size in spec["batch_sizes"]:
        model = seeded_model(task, 0).train()
        optimizer = task.optimizer(list(model.parameters()), lr=0.01, momentum=0.9)
        assert isinstance(optimizer, MomentumSGD)
        xs, y = [x[:size] for x in inputs], targets[:size]

        def step(model: Any = model, optimizer: Any = optimizer, xs: Any = xs, y: Any = y) -> float:
            model.zero_grad(set_to_none=True)
            loss = task.loss(task.forward(model, xs), y)
            loss.backward()
            optimizer.step()
            return float(loss.item())

        first_loss = step()
        out["batches"][str(size)] = {**_median_ms(step, spec["warmup"], spec["steps"]), "first_loss": first_loss}
    out["peak_rss_mib"] = _peak_rss_mib()
    out["torch_threads"] = torch.get_num_threads()
    return out


def worker_step_onnx(spec: dict[str, Any]) -> dict[str, Any]:
    """Training-graph steps (``OnnxTrainer.gradients`` + the numpy momentum update), 1 ORT thread."""
    import numpy as np

    from fedge.edge.trainer import MomentumUpdate, OnnxTrainer

    folder = Path(spec["graphs"])
    manifest = json.loads((folder / "manifest.json").read_text())
    trainer = OnnxTrainer((folder / "train.onnx").read_bytes(), (folder / "eval.onnx").read_bytes(), manifest,
                          threads=1)
    initial = dict(np.load(folder / "weights.npz"))
    batch = np.load(spec["batch"])
    inputs = [batch[f"x{i}"] for i in range(spec["num_inputs"])]
    out: dict[str, Any] = {"batches": {}}
    for size in spec["batch_sizes"]:
        state = {name: value.copy() for name, value in initial.items()}
        update = MomentumUpdate(learning_rate=0.01, momentum=0.9)
        xs, y = [x[:size] for x in inputs], batch["y"][:size]

        def step(state: dict[str, Any] = state, update: Any = update, xs: Any = xs, y: Any = y) -> float:
            loss, grads = trainer.gradients(state, xs, y)
            update.step(state, grads)
            return loss

        first_loss = step()
        out["batches"][str(size)] = {**_median_ms(step, spec["warmup"], spec["steps"]), "first_loss": first_loss}
    out["peak_rss_mib"] = _peak_rss_mib()
    out["torch_loaded"] = "torch" in sys.modules
    return out


def worker_round_torch(spec: dict[str, Any]) -> dict[str, Any]:
    """What a torch device imports, then one local round of ``train_local`` on its shard."""
    import numpy as np
    import torch

    import fedge.clients.app  # noqa: F401 - the ClientApp a device runs
    import fedge.clients.torch_client  # noqa: F401
    from fedge.config import resolve_run_config
    from fedge.task.api import TaskData
    from fedge.task.loading import load_task
    from fedge.task.training import train_local

    torch.set_num_threads(1)
    imported = time.time() - spec["t0"]
    task = load_task(resolve_run_config(spec["config"]))
    model = task.build_model()
    weights = np.load(spec["weights"])
    model.load_state_dict({name: torch.from_numpy(weights[name]) for name in weights.files})
    shard = np.load(spec["data"])
    data = TaskData.from_xy(shard["x"], shard["y"])
    cpu, args = torch.device("cpu"), spec["round"]
    train_local(task, task.build_model(), data, epochs=1, batch_size=args["batch_size"],
                learning_rate=args["learning_rate"], momentum=args["momentum"], device=cpu, seed=0, max_steps=1)
    first_step = time.time() - spec["t0"]
    stats = train_local(task, model, data, epochs=args["epochs"], batch_size=args["batch_size"],
                        learning_rate=args["learning_rate"], momentum=args["momentum"], device=cpu, seed=args["seed"])
    return {"imported_s": imported, "first_step_s": first_step, "total_s": time.time() - spec["t0"],
            "steps": stats.steps, "loss": stats.loss, "peak_rss_mib": _peak_rss_mib(),
            "torch_loaded": "torch" in sys.modules, "python": sys.executable}


def worker_round_onnx(spec: dict[str, Any]) -> dict[str, Any]:
    """What an onnx device imports, then one local round with the verified signed training bundle."""
    import numpy as np

    import fedge.clients.app  # noqa: F401 - the ClientApp a device runs
    import fedge.clients.onnx_client  # noqa: F401
    from fedge.edge.trainer import OnnxTrainer
    from fedge.edge.training_bundle import read_training_bundle

    imported = time.time() - spec["t0"]
    bundle = read_training_bundle(Path(spec["bundle"]), trusted_keys=[Path(spec["trust"])])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    weights = dict(np.load(spec["weights"]))
    shard = np.load(spec["data"])
    inputs, targets, args = (shard["x"],), shard["y"], spec["round"]
    trainer.train(weights, inputs, targets, epochs=1, batch_size=args["batch_size"],
                  learning_rate=args["learning_rate"], momentum=args["momentum"], seed=0, max_steps=1)
    first_step = time.time() - spec["t0"]
    _, stats = trainer.train(weights, inputs, targets, epochs=args["epochs"], batch_size=args["batch_size"],
                             learning_rate=args["learning_rate"], momentum=args["momentum"], seed=args["seed"])
    return {"imported_s": imported, "first_step_s": first_step, "total_s": time.time() - spec["t0"],
            "steps": stats.steps, "loss": stats.loss, "peak_rss_mib": _peak_rss_mib(),
            "torch_loaded": "torch" in sys.modules, "python": sys.executable}


def worker_browser_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    """The Python onnx device's side of section 6: one step of 16 examples (median) and one local round."""
    import numpy as np

    from fedge.edge.trainer import OnnxTrainer
    from fedge.edge.training_bundle import read_training_bundle

    started = time.perf_counter()
    bundle = read_training_bundle(Path(spec["bundle"]), trusted_keys=[Path(spec["trust"])])
    trainer = OnnxTrainer(bundle.train_onnx, bundle.eval_onnx, bundle.manifest)
    verified_ms = (time.perf_counter() - started) * 1000
    weights, shard, args = dict(np.load(spec["weights"])), np.load(spec["data"]), spec["round"]
    inputs, targets = (shard["x"],), shard["y"]

    def step() -> object:
        return trainer.train(weights, (inputs[0][:16],), targets[:16], epochs=1, batch_size=16,
                             learning_rate=args["learning_rate"], momentum=args["momentum"], seed=0)
    timing = _median_ms(step, spec["warmup"], spec["steps"])
    started = time.perf_counter()
    _, stats = trainer.train(weights, inputs, targets, epochs=args["epochs"], batch_size=args["batch_size"],
                             learning_rate=args["learning_rate"], momentum=args["momentum"], seed=args["seed"])
    return {"load_ms": verified_ms, "step_ms": timing["median_ms"], "round_s": time.perf_counter() - started,
            "steps": stats.steps, "peak_rss_mib": _peak_rss_mib()}


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "step-torch": worker_step_torch, "step-onnx": worker_step_onnx,
    "round-torch": worker_round_torch, "round-onnx": worker_round_onnx,
    "browser-baseline": worker_browser_baseline,
}


def run_worker(kind: str, spec: dict[str, Any], scratch: Path, python: str = sys.executable) -> dict[str, Any]:
    """Run worker ``kind`` in a fresh ``python``; its result plus wall time and peak tree RSS (sampled)."""
    from sim_vs_flower import run_watched  # bench/ is the script's folder, first on sys.path

    spec_path, out_path = scratch / f"{kind}-spec.json", scratch / f"{kind}-out.json"
    out_path.unlink(missing_ok=True)
    spec = {**spec, "t0": time.time()}
    spec_path.write_text(json.dumps(spec))
    wall, peak = run_watched([python, str(Path(__file__).resolve()), "--worker", kind, str(spec_path), str(out_path)])
    result = json.loads(out_path.read_text())
    result["wall_s"] = wall
    result["peak_rss_mib"] = max(result["peak_rss_mib"], peak / 2**20)
    return result


# =========================================================================== helpers


def progress_bar() -> Any:
    """A rich progress bar (the orchestrator only)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn())


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A rich table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*map(escape, row))
    Console(width=160).print(table)


def load_setup(config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(task, run config, seeded model) of a built-in task."""
    from fedge.config import resolve_run_config
    from fedge.task.api import seeded_model
    from fedge.task.loading import load_task

    run_config = resolve_run_config(config)
    task = load_task(run_config)
    return task, run_config, seeded_model(task, 0)


def save_graphs(task: Any, run_config: Any, model: Any, folder: Path) -> dict[str, Any]:
    """Export the task's training graphs into ``folder`` (graphs, manifest, initial weights); their sizes."""
    import numpy as np

    from fedge.edge.training_bundle import training_manifest
    from fedge.server.training_bundle import TRAINING_FIELDS, export_training_graph

    started = time.perf_counter()
    graphs, metrics = export_training_graph(task, model, run_config)
    export_s = time.perf_counter() - started
    manifest = training_manifest({field: getattr(graphs, field) for field in TRAINING_FIELDS}, task=task.name,
                                 metrics=metrics, model_id=f"{task.name}-training", version=0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.onnx").write_bytes(graphs.train_onnx)
    (folder / "eval.onnx").write_bytes(graphs.eval_onnx)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    np.savez(folder / "weights.npz", **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    return {"export_s": export_s, "train_onnx_kib": len(graphs.train_onnx) / 1024,
            "eval_onnx_kib": len(graphs.eval_onnx) / 1024, "parity_max_abs_diff": graphs.max_abs_diff}


def save_batch(task: Any, path: Path, size: int) -> int:
    """The first ``size`` training examples (repeated if fewer) as ``x0.. y`` in ``path``; the input count."""
    import numpy as np

    data = task.train_data()
    index = np.arange(size) % len(data)
    picked = data.take(index)
    np.savez(path, y=picked.targets, **{f"x{i}": array for i, array in enumerate(picked.inputs)})
    return len(picked.inputs)


def parameters(model: Any) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def environment() -> dict[str, Any]:
    """Where the numbers came from."""
    import numpy
    import onnxruntime
    import torch

    return {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def venv_python(extra: str) -> Path:
    """The interpreter of the cached ``extra`` venv (it may not exist)."""
    return VENVS / extra / "bin" / "python"


# =========================================================================== 1. step time


def section_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Per model: torch eager vs training-graph step time and per-runtime peak RSS."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        bar = progress.add_task("step time", total=len(args.models))
        for name in args.models:
            progress.update(bar, description=f"step time: {name}")
            rows.append(measure_model(name, Path(tmp) / name, args))
            progress.advance(bar)
    return {"settings": {"batch_sizes": args.batch_sizes, "warmup": args.warmup, "steps": args.step_count,
                         "threads": 1, "optimizer": "SGD lr 0.01 momentum 0.9", "models": MODELS},
            "rows": rows}


def measure_model(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model's row: export, both runtimes' steps in their own processes, ratios."""
    folder.mkdir(parents=True)
    task, run_config, model = load_setup(MODELS[name])
    row: dict[str, Any] = {"model": name, "task": task.name, "parameters": parameters(model)}
    try:
        row["export"] = save_graphs(task, run_config, model, folder)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        row["export_error"] = f"{type(exc).__name__}: {exc}"
        return row
    num_inputs = save_batch(task, folder / "batch.npz", max(args.batch_sizes))
    spec = {"config": MODELS[name], "batch": str(folder / "batch.npz"), "graphs": str(folder),
            "num_inputs": num_inputs, "batch_sizes": args.batch_sizes, "warmup": args.warmup,
            "steps": args.step_count}
    row["torch"] = run_worker("step-torch", spec, folder)
    row["onnx"] = run_worker("step-onnx", spec, folder)
    row["ratio_onnx_over_torch"] = {size: row["onnx"]["batches"][size]["median_ms"]
                                    / row["torch"]["batches"][size]["median_ms"] for size in row["torch"]["batches"]}
    row["memory_ratio_onnx_over_torch"] = row["onnx"]["peak_rss_mib"] / row["torch"]["peak_rss_mib"]
    return row


def print_steps(result: dict[str, Any]) -> None:
    sizes = [str(size) for size in result["settings"]["batch_sizes"]]
    rows = []
    for row in result["rows"]:
        if "export_error" in row:
            rows.append([row["model"], f"{row['parameters']:,}", "export failed: " + row["export_error"][:90],
                         *[""] * (len(sizes) + 1)])
            continue
        torch_, onnx = row["torch"], row["onnx"]
        cells = [f"{torch_['batches'][s]['median_ms']:.3f} / {onnx['batches'][s]['median_ms']:.3f} "
                 f"({row['ratio_onnx_over_torch'][s]:.2f}x)" for s in sizes]
        rows.append([row["model"], f"{row['parameters']:,}", *cells,
                     f"{torch_['peak_rss_mib']:.0f} / {onnx['peak_rss_mib']:.0f} "
                     f"({row['memory_ratio_onnx_over_torch']:.2f}x)",
                     "yes" if onnx["torch_loaded"] else "no"])
    print_table("1. training step, 1 thread: torch eager / onnx graph ms, median (onnx/torch)",
                ["model", "params", *[f"batch {s}" for s in sizes], "peak MiB torch / onnx", "onnx loads torch"],
                rows)


# =========================================================================== 2. start-up


SHARDS = {"demo device 0": {}, "IID half (section 4's device)": {"partitioner": "iid"}}


def demo_shard(folder: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """Device 0's shard (the demo's 100-device split, or 2 devices when ``overrides`` is IID as in section 4),
    the initial global weights and a signed training bundle, in ``folder``."""
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fedge.profiles import parse_fleet
    from fedge.server.training_bundle import export_training_graph, write_run_training_bundle

    task, run_config, model = load_setup(overrides)
    devices = 2 if overrides else parse_fleet(run_config.text("fleet"), "").size
    shard = task.partition(0, devices, run_config)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "shard.npz", x=shard.inputs[0], y=shard.targets)
    np.savez(folder / "weights.npz", **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})
    graphs, metrics = export_training_graph(task, model, run_config)
    write_run_training_bundle(graphs, metrics, task, folder, private_key=Ed25519PrivateKey.generate())
    return {"config": overrides, "data": str(folder / "shard.npz"), "weights": str(folder / "weights.npz"),
            "bundle": str(folder / "bundles" / "training.zip"), "trust": str(folder / "keys" / "signing.pub"),
            "round": DEMO_ROUND, "examples": len(shard), "devices": devices}


def section_startup(args: argparse.Namespace) -> dict[str, Any]:
    """Cold device processes: torch vs onnx (and onnx from the torch-free ``device`` venv when built)."""
    runs = [("torch", "round-torch", sys.executable), ("onnx", "round-onnx", sys.executable)]
    if venv_python("device").exists():
        runs.append(("onnx (device venv)", "round-onnx", str(venv_python("device"))))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        bar = progress.add_task("device start-up", total=len(SHARDS) * len(runs) * args.repeats)
        for index, (shard_name, overrides) in enumerate(SHARDS.items()):
            folder = Path(tmp) / f"shard{index}"
            spec = demo_shard(folder, overrides)
            shard_rows = []
            for label, kind, python in runs:
                samples = []
                for _ in range(args.repeats):
                    samples.append(run_worker(kind, spec, folder, python))
                    progress.advance(bar)
                keys = ("imported_s", "first_step_s", "total_s", "wall_s", "peak_rss_mib")
                shard_rows.append({"shard": shard_name, "examples": spec["examples"], "runtime": label,
                                   "python": python, "torch_loaded": samples[0]["torch_loaded"],
                                   "steps": samples[0]["steps"], "loss": samples[0]["loss"],
                                   **{key: statistics.median(s[key] for s in samples) for key in keys},
                                   "samples": samples})
            for row in shard_rows:
                row["ratio_vs_torch"] = {key: row[key] / shard_rows[0][key]
                                         for key in ("first_step_s", "wall_s", "peak_rss_mib")}
            rows.extend(shard_rows)
    return {"settings": {"model": "digits cnn (the demo)", "shards": SHARDS, **DEMO_ROUND, "repeats": args.repeats,
                         "statistic": "median", "threads": "torch 1 / onnxruntime 1",
                         "timed_from": "just before the subprocess is spawned"}, "rows": rows}


def print_startup(result: dict[str, Any]) -> None:
    rows = [[f"{row['shard']} ({row['examples']} ex.)", row["runtime"], f"{row['imported_s']:.2f}",
             f"{row['first_step_s']:.2f}",
             f"{row['wall_s']:.2f}", f"{row['peak_rss_mib']:.0f}", str(row["steps"]), f"{row['loss']:.4f}",
             "yes" if row["torch_loaded"] else "no",
             f"{row['ratio_vs_torch']['first_step_s']:.2f}x / {row['ratio_vs_torch']['wall_s']:.2f}x / "
             f"{row['ratio_vs_torch']['peak_rss_mib']:.2f}x"] for row in result["rows"]]
    print_table("2. device process, cold: imports + one local round (demo CNN, 5 epochs, batch 16)",
                ["shard", "runtime", "imports s", "first step s", "total s", "peak MiB", "steps", "round loss", "torch",
                 "vs torch: first / total / MiB"], rows)


# =========================================================================== 3. install size


def pip_install(python: Path, *requirements: str) -> float:
    """``python -m pip install`` (quiet); seconds."""
    started = time.perf_counter()
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           *requirements], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"pip install {' '.join(requirements)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def build_venv(extra: str, rebuild: bool) -> dict[str, Any]:
    """The cached venv of ``extra`` (built now if missing or ``rebuild``) and how it was built."""
    folder = VENVS / extra
    record = folder / "bench-install.json"
    if record.exists() and not rebuild:
        return {**json.loads(record.read_text()), "cached": True}
    shutil.rmtree(folder, ignore_errors=True)
    interpreter = shutil.which("python3.11") or sys.executable
    subprocess.run([interpreter, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    empty_mib = du_mib(folder)
    steps = {}
    if extra in ("torch", "sim", "all"):
        steps[TORCH_PIN] = pip_install(python, TORCH_PIN)
    steps[f"fedge[{extra}]"] = pip_install(python, f"{REPO}[{extra}]")
    info = {"extra": extra, "interpreter": interpreter, "pip_s": sum(steps.values()), "pip_steps_s": steps,
            "empty_venv_mib": empty_mib, "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    record.write_text(json.dumps(info, indent=2))
    return {**info, "cached": False}


def du_mib(folder: Path) -> float:
    """Disk use of ``folder`` in MiB (``du -sk``)."""
    out = subprocess.run(["du", "-sk", str(folder)], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0]) / 1024


def imports_torch(python: Path) -> bool:
    """Whether ``torch`` is importable in that venv."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 1)"
    return subprocess.run([str(python), "-c", probe], check=False).returncode == 0


def top_packages(folder: Path, count: int = 4) -> list[tuple[str, float]]:
    """The largest entries of the venv's site-packages, MiB."""
    site = next((folder / "lib").glob("python*/site-packages"))
    sizes = [(entry.name, du_mib(entry)) for entry in site.iterdir() if entry.is_dir()]
    return sorted(sizes, key=lambda item: -item[1])[:count]


def section_install(args: argparse.Namespace) -> dict[str, Any]:
    """Venv size and pip time per extra."""
    rows = []
    with progress_bar() as progress:
        bar = progress.add_task("install", total=len(args.extras))
        for extra in args.extras:
            progress.update(bar, description=f"install: {extra}")
            info = build_venv(extra, args.rebuild_venvs)
            folder = VENVS / extra
            rows.append({**info, "venv_mib": du_mib(folder), "has_torch": imports_torch(folder / "bin" / "python"),
                         "largest": top_packages(folder)})
            progress.advance(bar)
    base = next((row for row in rows if row["extra"] == "torch"), rows[-1])
    for row in rows:
        row["size_vs_torch"] = row["venv_mib"] / base["venv_mib"]
    return {"settings": {"venvs": str(VENVS.relative_to(REPO)), "torch_pin": TORCH_PIN,
                         "pip": "pip install --quiet /work/main[EXTRA] (pip's cache as found)"}, "rows": rows}


def print_install(result: dict[str, Any]) -> None:
    rows = [[f"fedge[{row['extra']}]", f"{row['venv_mib']:.0f}", f"{row['size_vs_torch']:.2f}x",
             f"{row['pip_s']:.0f}" + (" (cached venv)" if row["cached"] else ""),
             "yes" if row["has_torch"] else "no",
             ", ".join(f"{name} {mib:.0f}" for name, mib in row["largest"])] for row in result["rows"]]
    print_table("3. install size per extra (fresh venv, du)",
                ["extra", "venv MiB", "vs torch", "pip s", "torch", "largest packages (MiB)"], rows)


# =========================================================================== 4. deployment latency


def section_deploy(args: argparse.Namespace) -> dict[str, Any]:
    """Round wall times with torch devices vs onnx devices on loopback."""
    device_fedge = VENVS / "device" / "bin" / "fedge"
    configs = [("torch", None), ("onnx", device_fedge if device_fedge.exists() else None)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        bar = progress.add_task("deployment rounds", total=len(configs))
        for runtime, fedge in configs:
            rows.append(deploy_once(runtime, fedge, Path(tmp) / runtime, args.deploy_rounds))
            progress.advance(bar)
    base = rows[0]["median_round_s"]
    for row in rows:
        row["ratio_vs_torch"] = row["median_round_s"] / base
    return {"settings": {"devices": 2, "rounds": args.deploy_rounds, "run_config": DEPLOY_CONFIG,
                         "env": DEPLOY_ENV, "data": "IID digits halves (LoopbackFederation)",
                         "rounds_timed": "2..N (round 1 includes start-up)", "target_round_s": 2.0}, "rows": rows}


def deploy_once(runtime: str, fedge: Path | None, root: Path, rounds: int) -> dict[str, Any]:
    """One loopback federation whose devices run ``runtime`` (``fedge`` from another venv when given)."""
    from fedge.simulation.loopback import LoopbackFederation

    federation = LoopbackFederation(root, num_devices=2, env=DEPLOY_ENV)
    executable = str(fedge) if fedge else str(Path(sys.executable).with_name("fedge"))
    try:
        federation.start_coordinator("--rounds", str(rounds), "--clients-per-round", "2", "--run-config",
                                     DEPLOY_CONFIG)
        extra: list[str] = []
        if runtime == "onnx":
            trust = federation.keys.directory / "bundle-signing" / "signing.pub"
            published = federation.root / "state" / "published" / "training.zip"
            federation.wait_for(lambda: trust.exists() and published.exists() and listening(federation.port + 1),
                                300, "the coordinator's training bundle service")
            extra = ["--runtime", "onnx", "--trust", str(trust)]
        for index in range(2):
            start_device(federation, index, executable, extra)
        federation.wait_for(lambda: (federation.run_dir / "summary.json").exists(), 600, f"{runtime} run")
        walls = [row["wall_time_s"] for row in federation.rows()]
        summary = json.loads((federation.run_dir / "summary.json").read_text())
        logs = {name: federation.log(name)[-1500:] for name in ("coordinator", "device0", "device1")}
    finally:
        federation.close()
    per_round = [b - a for a, b in zip(walls[1:], walls[2:], strict=False)]
    return {"runtime": runtime, "device_fedge": executable, "round_s": per_round,
            "median_round_s": statistics.median(per_round), "first_round_s": walls[1] - walls[0],
            "final_accuracy": summary.get("final_accuracy"), "log_tails": logs}


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    import socket

    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def start_device(federation: Any, index: int, executable: str, extra: list[str]) -> None:
    """``fedge device`` number ``index`` run by ``executable`` (LoopbackFederation.start_device's command)."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", **federation.extra_env}
    argv = [executable, "device", "--coordinator", f"127.0.0.1:{federation.port}", "--profile", "laptop",
            "--data", str(federation.root / f"dev{index}.npz"),
            "--key", str(federation.root / "keys" / "devices" / f"dev{index}.key"),
            "--ca", str(federation.keys.ca_cert), "--state-dir", str(federation.root / f"device{index}"), *extra]
    with (federation.root / f"device{index}.log").open("ab") as out:
        federation.devices[index] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                     start_new_session=True)


def print_deploy(result: dict[str, Any]) -> None:
    rows = [[row["runtime"], f"{row['median_round_s']:.2f}", ", ".join(f"{v:.2f}" for v in row["round_s"]),
             f"{row['first_round_s']:.2f}", f"{row['ratio_vs_torch']:.2f}x",
             "met" if row["median_round_s"] <= 2.0 else "missed", row["device_fedge"]] for row in result["rows"]]
    print_table("4. deployment round latency, 2 devices on loopback, demo CNN",
                ["devices", "median round s", "rounds 2..N s", "round 1 s", "vs torch", "<= 2 s", "device fedge"],
                rows)


# =========================================================================== 5. accuracy


def section_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """The demo with a torch fleet vs an onnx fleet, per seed."""
    from sim_vs_flower import run_watched

    fedge = Path(sys.executable).with_name("fedge")
    runs = []
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        bar = progress.add_task("demo runs", total=len(args.seeds) * 2)
        for seed in args.seeds:
            for runtime in ("torch", "onnx"):
                run_dir = Path(tmp) / f"{runtime}-{seed}"
                command = [str(fedge), "simulate", "--quiet", "--seed", str(seed), "--rounds", str(args.rounds),
                           "--run-dir", str(run_dir), "--run-config", f"runtime='{runtime}'"]
                wall, peak = run_watched(command)
                summary = json.loads((run_dir / "summary.json").read_text())
                runs.append({"seed": seed, "runtime": runtime, "final_accuracy": summary["final_accuracy"],
                             "best_accuracy": summary["best_accuracy"], "wall_s": wall,
                             "run_wall_s": summary["wall_time_s"], "peak_rss_mib": peak / 2**20,
                             "command": " ".join(command)})
                progress.advance(bar)
    return {"settings": {"demo": "fedge simulate defaults (digits CNN, 100 devices, 10 a round, 5 local epochs)",
                         "rounds": args.rounds, "seeds": args.seeds, "target_points": 0.5},
            "runs": runs, "summary": accuracy_summary(runs, args.seeds)}


def accuracy_summary(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Mean ± std per runtime and the per-seed difference in points."""
    by = {(run["runtime"], run["seed"]): run for run in runs}
    out: dict[str, Any] = {}
    for runtime in ("torch", "onnx"):
        values = [by[runtime, seed]["final_accuracy"] for seed in seeds]
        out[runtime] = {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                        "wall_s_mean": statistics.mean(by[runtime, seed]["wall_s"] for seed in seeds)}
    diffs = {str(seed): 100 * (by["onnx", seed]["final_accuracy"] - by["torch", seed]["final_accuracy"])
             for seed in seeds}
    out["points_onnx_minus_torch"] = diffs
    out["max_abs_points"] = max(abs(value) for value in diffs.values())
    out["within_target"] = out["max_abs_points"] <= 0.5
    return out


def print_accuracy(result: dict[str, Any]) -> None:
    summary, seeds = result["summary"], result["settings"]["seeds"]
    by = {(run["runtime"], run["seed"]): run for run in result["runs"]}
    rows = [[runtime, *[f"{by[runtime, seed]['final_accuracy']:.4f}" for seed in seeds],
             f"{summary[runtime]['mean']:.4f} ± {summary[runtime]['std']:.4f}",
             f"{summary[runtime]['wall_s_mean']:.1f}"]
            for runtime in ("torch", "onnx")]
    rows.append(["onnx - torch (points)", *[f"{summary['points_onnx_minus_torch'][str(s)]:+.2f}" for s in seeds],
                 f"max |diff| {summary['max_abs_points']:.2f}", ""])
    print_table(f"5. demo final accuracy, {result['settings']['rounds']} rounds (target: within 0.5 points)",
                ["fleet", *[f"seed {s}" for s in seeds], "mean ± std", "wall s"], rows)


# =========================================================================== main

# =========================================================================== 6. the browser
BROWSER_PAGE = """
const [spec, done] = arguments;
(async () => {
  const {importBundleKey, verifyTrainingBundle} = await import("./bundle.js");
  let started = performance.now();
  const body = await (await fetch(spec.bundle, {cache: "no-store"})).arrayBuffer();
  const bundle = await verifyTrainingBundle(body, await importBundleKey(spec.key));
  const worker = new Worker("worker.js");
  const call = (message) => new Promise((resolve, reject) => {
    worker.onmessage = (e) => e.data.error ? reject(new Error(e.data.error)) : resolve(e.data);
    worker.postMessage({...message, id: 1});
  });
  await call({type: "load", ortBase: new URL("ort/", location.href).href, train: bundle.train, eval: bundle.eval,
              manifest: bundle.manifest});
  const loadMs = performance.now() - started;
  const data = await (await fetch(spec.data, {cache: "no-store"})).json();
  const decode = (e) => ({data: new ({float32: Float32Array, int64: BigInt64Array})[e.dtype](
    Uint8Array.from(atob(e.b64), (c) => c.charCodeAt(0)).buffer), dims: e.dims});
  const inputs = data.inputs.map(decode), targets = decode(data.targets);
  const weights = {};  // as the SDK holds them: typed arrays (converted once, outside the timing)
  for (const [name, values] of Object.entries(spec.weights)) weights[name] = Float32Array.from(values);
  const width = inputs[0].dims.slice(1).reduce((a, b) => a * b, 1);
  const few = {inputs: [{data: inputs[0].data.slice(0, 16 * width), dims: [16, ...inputs[0].dims.slice(1)]}],
               targets: {data: targets.data.slice(0, 16), dims: [16]}};
  const config = (epochs, batch) => ({"local-epochs": epochs, "batch-size": batch,
                                      "learning-rate": spec.round.learning_rate, momentum: spec.round.momentum});
  const steps = [];
  for (let i = 0; i < spec.warmup + spec.steps; i++) {
    started = performance.now();
    await call({type: "train", weights: weights, config: config(1, 16), seed: "0", ...few});
    if (i >= spec.warmup) steps.push(performance.now() - started);
  }
  steps.sort((a, b) => a - b);
  started = performance.now();
  const round = await call({type: "train", weights: weights, seed: String(spec.round.seed), inputs: inputs,
                            targets: targets, config: config(spec.round.epochs, spec.round.batch_size)});
  done({load_ms: loadMs, step_ms: steps[Math.floor(steps.length / 2)], round_s: (performance.now() - started) / 1000,
        steps: round.stats.steps, bundle_bytes: body.byteLength, user_agent: navigator.userAgent});
})().catch((error) => done({error: String(error.message || error)}));
"""


# The secure round's device side (web/secagg.js) at `parameters` parameters in a pool of `pool`: one page plays every
# device of the pool (the gateway's relaying is plain record copies), and only device 0's steps are timed. Its
# "training" returns a fixed update (the demo's plain round, timed above, is the training both rounds share);
# the plain round's own extra work is the fp32 result frame.
SECURE_PAGE = """
const [spec, done] = arguments;
(async () => {
  const S = await import("./secagg.js");
  const {encodeFrame} = await import("./frame.js");
  const round = 1, n = spec.pool, size = spec.parameters;
  const nodes = Array.from({length: n}, (_, i) => 1000 + i);
  const threshold = S.minimumThreshold(n - 1);
  const times = {};
  const timed = async (label, i, fn) => {
    const started = performance.now();
    const out = await fn();
    if (i === 0) times[label] = performance.now() - started;
    return out;
  };
  const global = new Float32Array(size).map((_, i) => 0.1 * Math.sin(i));
  const trained = global.map((v, i) => v + 0.001 * Math.cos(i));
  const arrays = [{name: "w", shape: [size], data: global}];
  const config = {"server-round": round, "local-epochs": 1, "batch-size": 32, "learning-rate": 0.05, momentum: 0.9,
                  "proximal-mu": 0.0, seed: 7};
  const typed = S.parsePython(JSON.stringify({config: config, secagg: spec.params}).replace(/"proximal-mu":0/,
                                                                                           '"proximal-mu":0.0'));
  const states = [], keys = [];
  for (let i = 0; i < n; i++) {
    const made = await timed("setup", i, () => S.setup(round));
    states.push(made.state);
    keys.push(made.keys);
  }
  const sealed = [];
  for (let i = 0; i < n; i++) {
    const peers = {"server-round": round, neighbours: nodes.filter((_, j) => j !== i), threshold: threshold};
    nodes.forEach((node, j) => {
      if (j !== i) for (const kind of S.PUBLIC_KEYS) peers[kind + "/" + node] = keys[j][kind];
    });
    sealed.push(await timed("share", i, () => S.share(states[i], peers, nodes[i])));
  }
  const received = [];
  let frameMs = 0;
  for (let i = 0; i < n; i++) {
    const inbox = {};
    nodes.forEach((node, j) => { if (j !== i) inbox["from/" + node] = sealed[j]["to/" + nodes[i]]; });
    const answer = await timed("masked", i, () => S.masked(states[i], {
      inbox: inbox, params: spec.params, config: config, typedRecords: [typed.config, typed.secagg],
      globalArrays: arrays, me: nodes[i],
      train: async () => ({arrays: {w: trained}, numExamples: 100, steps: 4})}));
    if (i === 0) {
      const started = performance.now();
      encodeFrame({task: "t", kind: "secagg", records: S.recordsToJson({"secagg-received": answer.received})},
                  {"masked/vector": {data: answer.vector, shape: [answer.vector.length]}});
      frameMs = performance.now() - started;
    }
    received.push(answer.received.signature);
  }
  times.masked += frameMs;
  const check = {"server-round": round, survivors: nodes};
  nodes.forEach((node, j) => { check["received/" + node] = received[j]; });
  const signatures = [];
  for (let i = 0; i < n; i++) {
    signatures.push(await timed("consistency", i, () => S.consistency(states[i], check, nodes[i])));
  }
  const ask = {"server-round": round, survivors: nodes};
  nodes.forEach((node, j) => { ask["sig/" + node] = signatures[j]; });
  for (let i = 0; i < n; i++) await timed("unmask", i, () => S.unmask(states[i], ask, nodes[i]));
  let started = performance.now();
  encodeFrame({task: "t", kind: "train"}, {w: {data: trained, shape: [size]}});
  const plainMs = performance.now() - started;
  done({steps_ms: times, plain_frame_ms: plainMs, threshold: threshold});
})().catch((error) => done({error: String(error.stack || error)}));
"""
SECURE_STEPS = ("setup", "share", "masked", "consistency", "unmask")
SECURE_PARAMS = {"clip": 2000.0, "scale": 1048576.0, "bits": 32, "update-clip": 0.5, "count-clip": 1000.0,
                 "weight-clip": 100.0, "weight-scale": 1024.0, "work-clip": 1000.0, "work-scale": 1024.0,
                 "work-cap": 1000.0, "work-momentum": -1.0}  # secagg-update.json's parameters


class _QuietFiles(__import__("http.server").server.SimpleHTTPRequestHandler):
    """Static files for the browser section on 127.0.0.1 (a secure context: WebCrypto works), quietly."""

    extensions_map = {".js": "text/javascript", ".wasm": "application/wasm", ".mjs": "text/javascript",
                      ".html": "text/html", ".json": "application/json", ".zip": "application/zip"}

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def section_browser(args: argparse.Namespace) -> dict[str, Any]:
    """The demo device's local round and one 16-example step: the web SDK in headless Chromium (onnxruntime-web's
    WebAssembly build, in a Web Worker) vs the Python onnx device, on the same signed bundle and shard."""
    import base64
    import functools
    import http.server
    import threading

    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from chromium import start_chromium

    from fedge.web import ASSETS, ORT_FILES, SDK_FILES, VENDOR_FILES

    ort = REPO / os.environ.get("FEDGE_ORTWEB_DIR", ".cache/ortweb") / "node_modules" / "onnxruntime-web" / "dist"
    with tempfile.TemporaryDirectory() as tmp:
        folder, site = Path(tmp) / "shard", Path(tmp) / "site"
        spec = {**demo_shard(folder, SHARDS["IID half (section 4's device)"]), "warmup": args.warmup,
                "steps": min(args.step_count, 50)}
        python = run_worker("browser-baseline", spec, folder)
        (site / "ort").mkdir(parents=True)
        for name in (*SDK_FILES, *VENDOR_FILES):
            (site / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ASSETS / name, site / name)
        for name in ORT_FILES:
            shutil.copyfile(ort / name, site / "ort" / name)
        shutil.copyfile(spec["bundle"], site / "training.zip")
        shard, weights = np.load(spec["data"]), dict(np.load(spec["weights"]))
        def entry(array: Any) -> dict[str, Any]:
            array = np.ascontiguousarray(array)
            return {"dtype": str(array.dtype), "dims": list(array.shape),
                    "b64": base64.b64encode(array.tobytes()).decode()}
        (site / "data.json").write_text(json.dumps({"inputs": [entry(shard["x"])], "targets": entry(shard["y"])}))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(site)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        driver = start_chromium()
        try:
            driver.set_script_timeout(600)
            driver.get(f"http://127.0.0.1:{server.server_address[1]}/demo.html?name=bench")
            browser = driver.execute_async_script(BROWSER_PAGE, {
                "bundle": "training.zip", "key": Path(spec["trust"]).read_text(), "data": "data.json",
                "weights": {name: value.astype(np.float32).ravel().tolist() for name, value in weights.items()},
                "round": spec["round"], "warmup": spec["warmup"], "steps": spec["steps"]})
            runs = [driver.execute_async_script(SECURE_PAGE, {"pool": 10, "parameters": 100_000,
                                                              "params": SECURE_PARAMS}) for _ in range(3)]
            secure = next((run for run in runs if "error" in run), None) or {
                "steps_ms": {step: statistics.median(run["steps_ms"][step] for run in runs) for step in SECURE_STEPS},
                "plain_frame_ms": statistics.median(run["plain_frame_ms"] for run in runs),
                "threshold": runs[0]["threshold"], "runs": 3}
        finally:
            driver.quit()
            server.shutdown()
    if "error" in browser or "error" in secure:
        raise RuntimeError(f"the browser failed: {browser.get('error') or secure.get('error')}")
    ratios = {key: browser[key] / python[key] for key in ("load_ms", "step_ms", "round_s")}
    overhead_s = (sum(secure["steps_ms"].values()) - secure["plain_frame_ms"]) / 1000
    secure.update(parameters=100_000, pool=10, overhead_s=overhead_s,
                  ratio_secure_over_plain=(browser["round_s"] + overhead_s) / browser["round_s"])
    return {"settings": {"model": "digits cnn (the demo)", "shard": "IID half", "examples": spec["examples"],
                         **spec["round"], "step": "16 examples, 1 step, median", "threads": "1 (both)",
                         "browser": browser.get("user_agent", "")},
            "python": python, "browser": browser, "ratio_browser_over_python": ratios, "secure": secure}


def print_browser(result: dict[str, Any]) -> None:
    python, browser, ratio = result["python"], result["browser"], result["ratio_browser_over_python"]
    rows = [["verify bundle + load graphs (ms)", f"{python['load_ms']:.0f}", f"{browser['load_ms']:.0f}",
             f"{ratio['load_ms']:.2f}x"],
            ["one step, 16 examples (ms, median)", f"{python['step_ms']:.2f}", f"{browser['step_ms']:.2f}",
             f"{ratio['step_ms']:.2f}x"],
            [f"one local round, {python['steps']} steps (s)", f"{python['round_s']:.2f}", f"{browser['round_s']:.2f}",
             f"{ratio['round_s']:.2f}x"],
            ["training bundle downloaded (bytes)", "", f"{browser['bundle_bytes']:,}", ""]]
    print_table("6. the browser (web SDK, onnxruntime-web wasm, Web Worker) vs the Python onnx device",
                ["measure", "python onnx", "browser", "browser / python"], rows)
    secure = result.get("secure")
    if secure:
        rows = [[f"secagg_{step} (ms, median of {secure['runs']})", f"{secure['steps_ms'][step]:.1f}"]
                for step in SECURE_STEPS]
        rows += [["plain round's fp32 result frame (ms)", f"{secure['plain_frame_ms']:.1f}"],
                 ["secure round's extra device time (s)", f"{secure['overhead_s']:.3f}"],
                 [f"secure / plain, with the demo's local round ({browser['round_s']:.2f} s)",
                  f"{secure['ratio_secure_over_plain']:.2f}x"]]
        print_table(f"6b. the browser's secure round (web/secagg.js): one device's steps at {secure['parameters']:,} "
                    f"parameters in a pool of {secure['pool']} (threshold {secure['threshold']}); the masked step "
                    "without training", ["measure", "browser"], rows)


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "steps": (section_steps, print_steps),
    "startup": (section_startup, print_startup),
    "install": (section_install, print_install),
    "deploy": (section_deploy, print_deploy),
    "accuracy": (section_accuracy, print_accuracy),
    "browser": (section_browser, print_browser),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in SECTIONS:
        parser.add_argument(f"--{name}", action="store_true", help=f"run section '{name}' (none given: all)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--warmup", type=int, default=10, help="steps before timing (section 1)")
    parser.add_argument("--step-count", type=int, default=100, help="timed steps per batch size (section 1)")
    parser.add_argument("--repeats", type=int, default=3, help="cold device processes per runtime (section 2)")
    parser.add_argument("--extras", nargs="+", default=["edge", "device", "torch"], help="section 3")
    parser.add_argument("--rebuild-venvs", action="store_true", help="rebuild the cached venvs (section 3)")
    parser.add_argument("--deploy-rounds", type=int, default=6, help="section 4")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="section 5")
    parser.add_argument("--rounds", type=int, default=50, help="demo rounds (section 5)")
    parser.add_argument("--print-only", action="store_true", help="print the tables of the saved JSON")
    return parser.parse_args(argv)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        kind, spec, out = sys.argv[2:]
        Path(out).write_text(json.dumps(WORKERS[kind](json.loads(Path(spec).read_text()))))
        return
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    args = parse_args()
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    record: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.print_only:
        for name in chosen:
            started = time.perf_counter()
            result = SECTIONS[name][0](args)
            result.update(measured_at=time.strftime("%Y-%m-%d %H:%M:%S"), section_wall_s=time.perf_counter() - started,
                          command=" ".join(["python", "bench/ondevice.py", *sys.argv[1:]]), environment=environment())
            record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # another section may have run
            record[name] = result
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    for name in chosen:
        if name in record:
            SECTIONS[name][1](record[name])
    print(f"wrote {RESULTS}" if not args.print_only else f"read {RESULTS}")


if __name__ == "__main__":
    main()
