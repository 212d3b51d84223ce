"""``fedge export``, ``fedge verify``, ``fedge predict``, ``fedge pull``: signed edge bundles.

``verify``, ``predict`` and ``pull`` import no torch: they run where only onnxruntime is.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any

from fedge.cli.workdir import importable_here
from fedge.errors import BundleVerificationError, ConfigError


def add_parsers(sub: Any) -> None:
    """Register the edge subcommands on ``sub``."""
    export = sub.add_parser("export", help="sign an edge bundle of a run's global model")
    export.add_argument("run_dir", type=Path)
    export.add_argument("--round", type=int, help="which round's model (default: the last)")
    export.add_argument("--key", required=True, type=Path, help="Ed25519 private key (PEM)")
    export.add_argument("-o", "--output", required=True, type=Path, help="bundle directory to write")
    export.add_argument("--zip", action="store_true", help="also write OUTPUT.zip")
    export.add_argument("--valid-days", type=float, metavar="DAYS",
                        help="the bundle expires DAYS after signing (default: never)")
    export.set_defaults(handler=_export)

    verify = sub.add_parser("verify", help="check a bundle's signature, file hashes, expiry and freshness")
    verify.add_argument("bundle", type=Path)
    verify.add_argument("--trusted", action="append", required=True, type=Path,
                        help="a trusted signer's public key (repeatable)")
    _add_freshness_arguments(verify, "and record its version as accepted")
    verify.set_defaults(handler=_verify)

    predict = sub.add_parser("predict", help="run a verified bundle on inputs from a .npy (or .npz) file")
    predict.add_argument("bundle", type=Path)
    predict.add_argument("inputs", type=Path,
                         help=".npy with one example or a batch of the bundle's one input; .npz with an "
                              "array per input name for a bundle of several inputs")
    predict.add_argument("--trusted", action="append", default=[], type=Path)
    predict.add_argument("--variant", choices=["int8", "fp32"],
                         help="model to run (default: int8, or fp32 when the bundle has no int8 model)")
    predict.add_argument("--raw", action="store_true",
                         help="inputs are raw; apply the manifest's (affine) preprocessing first")
    predict.add_argument("--allow-unsigned", action="store_true",
                         help="DEVELOPMENT ONLY: accept a bundle without a signature")
    _add_freshness_arguments(predict, "and record its version once it is loaded")
    predict.set_defaults(handler=_predict)
    _add_pull_parser(sub)


def _add_pull_parser(sub: Any) -> None:
    pull = sub.add_parser("pull", help="fetch the coordinator's latest signed bundles as a device",
                          description="Fetch, verify and atomically install the coordinator's inference bundle "
                                      "and training graph (DIR/inference.zip, DIR/training.zip); unchanged "
                                      "bundles cost no download.")
    pull.add_argument("--coordinator", required=True, metavar="HOST:PORT",
                      help="the bundle service (`fedge coordinator start` prints it; default port: device port + 1)")
    pull.add_argument("--key", type=Path, help="this device's key (`fedge keys add-device`)")
    pull.add_argument("--ca", type=Path, help="the coordinator's ca.crt")
    pull.add_argument("--trust", action="append", required=True, type=Path, metavar="SIGNING_PUBLIC_KEY",
                      help="a trusted bundle signer's public key (repeatable)")
    pull.add_argument("--kind", choices=["inference", "training", "all"], default="all")
    pull.add_argument("--width", type=float, default=None,
                      help="a width-scaled sub-model's bundles (sub-models runs): e.g. 0.25")
    pull.add_argument("--dir", type=Path, help="where bundles are kept (default: $FEDGE_DEVICE_HOME/bundles, "
                                               "else ~/.fedge-device/bundles)")
    pull.add_argument("--state-dir", type=Path, metavar="DIR",
                      help="freshness store refusing rollbacks (default: DIR/.freshness)")
    pull.add_argument("--model-id", metavar="NAME",
                      help="accept the bundles of this lineage (signed model_id) only, and follow it from now on; "
                           "without it the lineage of the first pull is pinned and any other refused")
    pull.add_argument("--timeout", type=float, default=60.0, help="seconds a connection or read may stall")
    pull.add_argument("--insecure", action="store_true",
                      help="plain HTTP, no device key: only for a coordinator started --insecure")
    pull.set_defaults(handler=_pull)


def _add_freshness_arguments(parser: Any, recording: str) -> None:
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="freshness store (created 0700): refuse a bundle older than the highest version "
                             f"of its model_id accepted before (rollback), {recording}")
    parser.add_argument("--model-id", metavar="ID",
                        help="refuse a bundle of any other model_id (pin this device's model lineage)")


def _export(args: argparse.Namespace) -> int:
    from fedge.server.export_run import export_run_round

    importable_here()  # the run's task, if it is package.module:object, imports from here as under simulate
    if args.valid_days is not None and not 0 < args.valid_days <= 36500:
        raise ConfigError(f"--valid-days {args.valid_days} must be more than 0 and at most 36500")
    valid_for = dt.timedelta(days=args.valid_days) if args.valid_days is not None else None
    built = export_run_round(args.run_dir, server_round=args.round, key_path=args.key,
                             out_dir=args.output, make_zip=args.zip, valid_for=valid_for)
    manifest = built.manifest
    print(f"bundle: {built.path}" + (f" (+ {built.path.with_suffix('.zip')})" if args.zip else ""))
    print(f"model {manifest['model_id']} version {manifest['version']}, issued {manifest['issued_at']}, "
          f"expires {manifest['expires_at'] or 'never'}")
    print(f"round {manifest['round']}: {_quality(manifest)}")
    return 0


def _quality(manifest: dict[str, Any]) -> str:
    """``fp32 accuracy 0.9500, int8 0.9472, agreement 0.9900`` (or why there is no int8 model)."""
    metrics = manifest["metrics"]
    names = [key[len("fp32_"):] for key in metrics if key.startswith("fp32_")]
    headline = manifest.get("headline")
    name = headline if headline in names else (names[0] if names else None)
    parts = [f"fp32 {name} {_number(metrics[f'fp32_{name}'])}"] if name is not None else []
    skipped = manifest["variants"]["int8"].get("skipped")
    if skipped is not None:
        parts.append(f"no int8 model ({skipped})")
    elif name is not None and f"int8_{name}" in metrics:
        parts.append(f"int8 {_number(metrics[f'int8_{name}'])}")
    if "int8_top1_agreement" in metrics:
        parts.append(f"agreement {_number(metrics['int8_top1_agreement'])}")
    parts.append(f"torch/onnx max diff {metrics['torch_onnx_max_abs_diff']:.1e}")
    return ", ".join(parts)


def _number(value: float | None) -> str:
    """``0.9500``, or ``n/a`` for a metric that was not finite (null in the manifest)."""
    return "n/a" if value is None else f"{value:.4f}"


def _verify(args: argparse.Namespace) -> int:
    from fedge.edge.bundle import FreshnessStore, read_bundle, verify_bundle

    store = FreshnessStore(args.state_dir) if args.state_dir else None
    manifest = verify_bundle(read_bundle(args.bundle), trusted_keys=args.trusted, freshness=store,
                             model_id=args.model_id)
    print(f"OK: {args.bundle} is signed by a trusted key and every file matches its hash")
    if store is not None:
        store.record(manifest)
        print(f"fresh: version {manifest['version']} of {manifest['model_id']}; highest accepted now "
              f"{store.accepted_version(manifest['model_id'])} (in {args.state_dir})")
    shown = ("model_name", "source_run", "round", "model_id", "version", "issued_at", "expires_at", "metrics")
    print(json.dumps({k: manifest[k] for k in shown if k in manifest}, indent=2))
    return 0


def _predict(args: argparse.Namespace) -> int:
    from fedge.edge.bundle import FreshnessStore
    from fedge.edge.runtime import EdgeModel

    if not args.trusted and not args.allow_unsigned:
        raise BundleVerificationError("give --trusted PUBLIC_KEY (or --allow-unsigned in development)")
    inputs = _read_inputs(args.inputs)
    model = EdgeModel.load(args.bundle, trusted_keys=args.trusted, variant=args.variant,
                           allow_unsigned=args.allow_unsigned, model_id=args.model_id,
                           freshness=FreshnessStore(args.state_dir) if args.state_dir else None)
    if args.raw:
        inputs = _preprocessed(model, inputs)
    else:
        _refuse_raw_looking(model, inputs)
    if _gives_class_scores(model):
        prediction = model.predict(inputs)
        for name, probs in zip(prediction.label_names, prediction.probabilities, strict=True):
            print(f"{name}\t{float(probs.max()):.4f}")
        return 0
    for row in _rows(model.run(inputs)):
        print(row)
    return 0


def _gives_class_scores(model: Any) -> bool:
    """Whether the bundle's model gives one (batch, classes) output (else its outputs are printed as numbers)."""
    return bool(model.is_classifier and len(model.outputs) <= 1
                and (not model.outputs or len(model.outputs[0]["shape"]) == 2))


def _refuse_raw_looking(model: Any, inputs: Any) -> None:
    """Inputs that look unscaled for a bundle that declares scaling: integers, or whole numbers beyond
    what the scaling gives (digits' 0..16 for x / 16), are refused with the fix (``--raw``) instead of
    a confident wrong answer (issue 26 item 10)."""
    import numpy as np

    spec = model.manifest.get("preprocessing") or {}
    scale, offset = spec.get("scale"), spec.get("offset", 0.0)
    if not isinstance(scale, int | float) or (scale == 1 and offset == 0):
        return
    arrays = inputs.values() if isinstance(inputs, dict) else [inputs]
    floats = [np.asarray(a) for a in arrays if np.asarray(a).dtype.kind in "iuf" and np.asarray(a).size]
    whole = [a for a in floats if a.dtype.kind in "iu" or (np.all(a == np.round(a)) and np.abs(a).max() > 1)]
    if whole:
        top = max(float(np.abs(a).max()) for a in whole)
        raise ConfigError(f"the inputs look unscaled (whole numbers up to {top:g}) but this bundle's model expects "
                          f"x * {scale:g} + {offset:g} ({spec.get('description', 'its declared preprocessing')}): "
                          "pass --raw to apply it, or scale the inputs yourself")


def _preprocessed(model: Any, inputs: Any) -> Any:
    """The manifest's preprocessing applied to the input (to each float input of a .npz)."""
    if not isinstance(inputs, dict):
        return model.preprocess(inputs)
    floats = {spec.name for spec in model.inputs if spec.dtype.startswith("float")}
    return {name: model.preprocess(array) if name in floats else array for name, array in inputs.items()}


def _read_inputs(path: Path) -> Any:
    """The array of a .npy file, or ``{name: array}`` of a .npz file."""
    import numpy as np

    from fedge.npy import UNREADABLE_FILE_ERRORS

    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {name: loaded[name] for name in loaded.files}
        return loaded
    except UNREADABLE_FILE_ERRORS as exc:
        raise ConfigError(f"cannot read '{path}' as .npy or .npz ({type(exc).__name__}: {exc}); "
                          "write it with numpy.save or numpy.savez") from None


def _rows(outputs: list[Any]) -> list[str]:
    """One line per example: every output's values (flattened), tab-separated, outputs split by ``|``."""
    count = len(outputs[0]) if outputs and outputs[0].ndim else 0
    return [" | ".join("\t".join(f"{float(v):.6g}" for v in out[index].reshape(-1)) for out in outputs)
            for index in range(count)]


def _pull(args: argparse.Namespace) -> int:
    import os

    from fedge.edge.delivery import KINDS, NotPublished, inference_kind, pull

    if not args.insecure and (args.key is None or args.ca is None):
        raise ConfigError("give --key (this device's key from `fedge keys add-device`) and --ca (the coordinator's "
                          "ca.crt), or --insecure against a coordinator started --insecure")
    if args.model_id is not None and args.kind == "all":
        raise ConfigError("--model-id names one lineage, and inference and training bundles have their own: "
                          "use it with --kind inference or --kind training")
    home = Path(os.environ.get("FEDGE_DEVICE_HOME", Path.home() / ".fedge-device"))
    directory = args.dir or home / "bundles"
    kinds = KINDS if args.kind == "all" else (args.kind,)
    if args.width is not None:
        kinds = tuple(inference_kind(args.width, kind) for kind in kinds)
    for kind in kinds:
        try:
            result = pull(url_or_address=args.coordinator, kind=kind, directory=directory, device_key=args.key,
                          ca=args.ca, trusted_keys=args.trust, freshness_dir=args.state_dir, timeout=args.timeout,
                          insecure=args.insecure, model_id=args.model_id)
        except NotPublished:
            if args.kind != "all":
                raise
            print(f"{kind} none published yet", flush=True)
            continue
        version = "" if result.version is None else f" v{result.version}"
        state = "updated" if result.changed else "unchanged"
        print(f"{kind}{version} {state} ({size_text(result.bytes_downloaded)})", flush=True)
    return 0


def size_text(count: int) -> str:
    """``0 bytes``, ``812 bytes``, ``14.2 kB``, ``1.2 MB``."""
    if count < 1000:
        return f"{count} bytes"
    return f"{count / 1e3:.1f} kB" if count < 1e6 else f"{count / 1e6:.1f} MB"
