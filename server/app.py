"""The coordinator's ``ServerApp``: one federated run, from run config to run report.

The same app runs in fedge's inline simulator, on Flower's Ray simulation
engine and under a SuperLink. It reads the run config, builds the strategy,
evaluates the global model centrally after every round, checkpoints it, and
writes the run directory (see :mod:`fedge.server.report`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedge import knobs, wire
from fedge.behaviour import Behaviour
from fedge.config import RunConfig, config_fingerprint, model_keys, resolve_run_config
from fedge.distributed_noise import DISTRIBUTED
from fedge.errors import CheckpointMismatch, ConfigError, ExportError
from fedge.profiles import Fleet, fleet_of, time_budget_steps
from fedge.secagg import bits_needed
from fedge.server.checkpoint import load_checkpoint
from fedge.server.compression import DownlinkEncoder, check_codecs
from fedge.server.metering import MeteredGrid, reply_seconds
from fedge.server.privacy import build_privacy
from fedge.server.recorder import RoundRecorder
from fedge.server.report import config_summary, run_dir_for, write_json_atomic
from fedge.server.submodels import build_sub_models, trained_widths, width_training_graphs
from fedge.strategies import FedAvg, strategy_spec
from fedge.strategies.drivers.asynchronous import AsynchronousDriver
from fedge.strategies.drivers.secure import MIN_DEVICES, SecureAggregation
from fedge.strategies.drivers.secure_groups import SecureGroups, check_group_size
from fedge.strategies.fedavg import DownlinkLayer, PrivacyLayer
from fedge.strategies.norm_bound import NormBounds
from fedge.strategies.policies import DeadlinePolicy, RoundPolicy, SyncPolicy
from fedge.strategies.registry import names_where
from fedge.strategies.rounds import GATEWAY_NODES
from fedge.strategies.rule import check_groups
from fedge.strategies.selection import OortSelector, RandomSelector
from fedge.strategies.submodels import SubModels
from fedge.strategies.validation import DeviceTierBounds, ReplyValidator
from fedge.submodels import as_fraction
from fedge.task.api import Task, seeded_model
from fedge.task.loading import check_task, load_task
from fedge.task.models import load_arrays, model_arrays
from fedge.work import max_local_steps

if TYPE_CHECKING:
    pass

log = logging.getLogger("fedge.server")

FEDNOVA_WORK_CAP = 1000.0  # largest normalised local work a FedNova device reports under secure aggregation
TRAIN_KEYS = wire.TRAIN_KEYS  # the run-config keys of every train instruction (fedge.wire.TrainInstruction)


def make_server_app(
    config_defaults: Mapping[str, Any] | None = None, *, progress: bool = True, task: Task | None = None
) -> ServerApp:
    """A ServerApp whose run config falls back to ``config_defaults`` then fedge's defaults.

    ``task``: the task to federate (default: the one the run config names).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        config = resolve_run_config({**(config_defaults or {}), **context.run_config})
        run_coordinator(grid, config, progress=progress, simulated=not config[knobs.DEPLOYMENT], task=task)

    return app


app = make_server_app()


def build_strategy(config: RunConfig, num_nodes: int | None = None, *, buffer_names: frozenset[str] | None = None,
                   privacy: PrivacyLayer | None = None, downlink: DownlinkLayer | None = None,
                   submodels: SubModels | None = None) -> FedAvg:
    """The strategy named by ``strategy``, sampling ``clients-per-round`` devices a round.

    Its rule comes from the strategy's class, its driver from the run config (secure
    aggregation, or the strategy's own: synchronous, FedBuff's asynchronous); ``buffer_names``
    (the model's statistics), ``privacy``, ``downlink`` and ``submodels`` are its collaborators.
    ``num_nodes`` (the simulated fleet's size) is checked against ``clients-per-round``;
    in deployment it is unknown and the strategy waits for devices to connect.
    """
    per_round = config.integer(knobs.CLIENTS_PER_ROUND)
    if num_nodes is not None and per_round > num_nodes:
        raise ConfigError(f"clients-per-round = {per_round} exceeds the fleet's {num_nodes} "
                          "devices; lower clients-per-round or enlarge the fleet")
    spec = strategy_spec(config.text(knobs.STRATEGY))
    extra = spec.options(config, num_nodes)
    if config[knobs.SECURE_AGGREGATION] and config[knobs.ASYNCHRONOUS]:
        pools = (" (through gateways too: a pool's masks cancel only in the sum of the devices that shared keys in "
                 "one round, so a device that answers late cannot join a later pool's sum, and pools formed as devices "
                 "arrive are not built)") if config[knobs.GATEWAYS] else ""
        raise ConfigError(f"secure-aggregation runs synchronous rounds (it sums one round's masked updates){pools}; "
                          "turn asynchronous off or drop secure-aggregation")
    groups = config.integer(knobs.SECURE_GROUPS)
    if groups and (not config[knobs.SECURE_AGGREGATION] or config[knobs.GATEWAYS]):
        raise ConfigError(f"secure-groups = {groups} splits secure aggregation into groups: it needs "
                          "secure-aggregation = true and no gateways (each gateway's pool is a group already); "
                          "set secure-groups = 0 or turn secure-aggregation on")
    if config[knobs.SECURE_AGGREGATION] and not config[knobs.GATEWAYS]:  # over gateways: each runs it over its pool
        selected = build_policy(config).selection_size(per_round)
        if groups:  # one instance per group; a group holds at most ceil(selected / groups) devices
            check_group_size(groups, selected)
            extra["driver"] = SecureGroups(groups, SecureAggregation(**secure_options(config, -(-selected // groups))))
        else:
            rule = spec.cls(**spec.options(config, num_nodes)).rule
            if rule.takes_group_means:
                raise ConfigError(f"secure-aggregation works with linear rules, not strategy "
                                  f"'{config[knobs.STRATEGY]}': it needs each update, which secure aggregation "
                                  f"hides; run it over the means of secure groups: secure-groups = K (K >= "
                                  f"{rule.groups_needed()[0]}: {rule.groups_needed()[1]}, and clients-per-round >= "
                                  f"{MIN_DEVICES} x K)")
            extra["driver"] = SecureAggregation(**secure_options(config, selected))
    if config[knobs.ASYNCHRONOUS]:
        extra["driver"] = AsynchronousDriver.from_config(config, num_nodes)
    validator = ReplyValidator(max_num_examples=config.integer(knobs.MAX_NUM_EXAMPLES),
                               max_local_steps=local_step_limit(config),
                               accepts_aggregates=bool(config[knobs.GATEWAYS]),
                               secure_pool=(MIN_DEVICES if config[knobs.GATEWAYS] and config[knobs.SECURE_AGGREGATION]
                                            else 0),
                               device_tier=device_tier_bounds(config))
    with _without_flower(FRACTION_EVALUATE_WARNING):
        strategy: FedAvg = spec.cls(
            clients_per_round=per_round,
            policy=build_policy(config),
            validator=validator,
            selector=build_selector(config),
            min_train_replies=min(config.integer(knobs.MIN_TRAIN_REPLIES), per_round),
            wait_for_nodes_s=config.number(knobs.ROUND_TIMEOUT),
            straggler_fraction=config.number(knobs.STRAGGLER_FRACTION),
            flower_lines=False,  # fedge's console has its own round lines
            fraction_evaluate=config.number(knobs.FRACTION_EVALUATE),
            min_evaluate_nodes=0 if not config[knobs.FRACTION_EVALUATE] else 1,
            min_available_nodes=1,  # evaluation rounds run with the nodes connected (Flower waits for 2 by default)
            buffer_names=buffer_names,
            privacy=privacy,
            downlink=downlink,
            submodels=submodels,
            **extra,
        )
    if config[knobs.GATEWAYS]:
        check_hierarchical(config, strategy)
        strategy.node_word = GATEWAY_NODES  # its nodes are gateways: its lines say so
        bound = config.number(knobs.MAX_UPDATE_NORM)
        strategy.rounds.norm_bounds = NormBounds(rule=config.text(knobs.UPDATE_NORM_BOUND), device=bound, gateway=bound)
    elif config.text(knobs.UPDATE_NORM_BOUND) != knobs.KNOBS[knobs.UPDATE_NORM_BOUND].default:
        raise ConfigError(f"update-norm-bound = {config.text(knobs.UPDATE_NORM_BOUND)} moves the device tier's "
                          "max-update-norm, which clips devices' updates at their gateways and gateways' at the "
                          "coordinator: it needs gateways = true (without gateways, dp = 'client-adaptive' adapts a "
                          "clipping norm on the devices, and the robust strategies bound each update's influence)")
    return strategy


# Flower's FedAvg warns at construction that fraction_evaluate = 0 skips federated evaluation. fedge then
# evaluates centrally (a task without central data turns federated evaluation on: with_evaluation), and every
# process that builds the strategy (the check at start, the ServerApp) said so again on the coordinator's console.
FRACTION_EVALUATE_WARNING = "fraction_evaluate is set to 0.0"


@contextlib.contextmanager
def _without_flower(message: str) -> Iterator[None]:
    """Drop Flower's log records that start with ``message`` while the block runs."""
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(message)

    flower = logging.getLogger("flwr")
    flower.addFilter(keep)
    try:
        yield
    finally:
        flower.removeFilter(keep)


def check_hierarchical(config: RunConfig, strategy: FedAvg) -> None:
    """Refuse, in one line, what cannot run over gateways' pre-aggregated replies (``gateways = true``).

    A gateway replies with the weighted mean of its devices' updates
    (:mod:`fedge.clients.gateway.service`); a strategy that needs each device's update, its steps, its
    arrival or its own clipping would silently compute something else over those means.
    ``secure-aggregation`` composes: each gateway runs SecAgg+ over its pool
    (:mod:`fedge.clients.gateway.secure_pool`) and the coordinator takes only such pool sums.
    Robust rules (``takes_group_means``: median, trimmed mean, Krum/Multi-Krum, Bulyan) run over the
    gateways' replies as group means (SHARE, Velicheti et al. 2021), refused when ``clients-per-round``
    gateways cannot meet the rule's own bound (:func:`fedge.strategies.rule.check_groups`).
    """
    where = "docs/operator.md#gateways-for-phones-and-browsers"
    name = config.text(knobs.STRATEGY)
    rule = strategy.rule
    if not rule.hierarchical and not rule.takes_group_means:
        raise ConfigError(f"strategy '{name}' ({type(rule).__name__}) needs each device's update, which "
                          f"gateways pre-aggregate; with gateways = true run "
                          f"{names_where(lambda each: each.hierarchical)}, or a robust rule over the gateways' "
                          f"means: {names_where(lambda each: each.takes_group_means)} ({where})")
    if rule.takes_group_means:  # each gateway's reply is one group's mean: the rule's bound counts gateways
        check_groups(rule, name, config.integer(knobs.CLIENTS_PER_ROUND), "gateways a round (clients-per-round)",
                     f" ({where})")
    refusals = {
        knobs.SECURE_AGGREGATION: (config[knobs.SECURE_AGGREGATION] and strategy.driver.asynchronous,
                                   f"{name} runs asynchronously, and a gateway's secure pool sums one round's masked "
                                   "inputs: a device that answers late cannot join a later pool's sum"),
        knobs.DP: (config.text(knobs.DP) not in ("off", DISTRIBUTED),
                   "central DP clips each device's update, and a gateway's reply is a mean of many; dp = "
                   "'distributed' with secure-aggregation composes: each pool's devices clip and add the noise"),
        knobs.SELECTOR: (config.text(knobs.SELECTOR) == "oort",
                         "Oort ranks devices by their own utility; the coordinator sees gateways"),
    }
    for knob, (chosen, why) in refusals.items():
        if chosen:
            raise ConfigError(f"gateways = true cannot run with {knob} = {config[knob]} ({why}); turn one off "
                              f"({where})")


def device_tier_bounds(config: RunConfig) -> DeviceTierBounds:
    """What bounds a gateway's reply: the devices it may stand for, their weight cap, the update norm."""
    return DeviceTierBounds(max_device_examples=config.integer(knobs.MAX_DEVICE_EXAMPLES),
                            max_gateway_devices=config.integer(knobs.MAX_GATEWAY_DEVICES),
                            max_update_norm=config.number(knobs.MAX_UPDATE_NORM))


def local_step_limit(config: RunConfig) -> Callable[[int], int]:
    """The most local SGD steps a round's instruction allows a device holding ``n`` examples.

    ``local-epochs * ceil(n / batch-size)`` (one step per batch, the last one partial), or
    with ``local-budget = "time"`` the steps the budget buys on the fleet's fastest profile
    (what :func:`fedge.clients.common.step_budget` gives a device). Stragglers do fewer.
    """
    instruction = wire.TrainInstruction.from_run_config(config)
    batch = instruction.batch_size
    if instruction.time_budget is not None:
        fleet = fleet_of(config)
        fastest = max([1.0, *(profile.compute_rate for profile in fleet.profiles.values())])
        steps = time_budget_steps(instruction.time_budget, fastest, batch)
        return lambda n: steps
    epochs = instruction.local_epochs
    return lambda n: max_local_steps(epochs=epochs, batch_size=batch, num_examples=n)


def secure_options(config: RunConfig, selected: int) -> dict[str, Any]:
    """Secure-aggregation settings, refused at start when they cannot work for ``selected`` devices.

    Raises
    ------
    ConfigError
        Fewer than 3 devices a round (each would learn the other's update from the sum), or
        a ring too narrow for ``selected`` updates at ``secagg-clip`` / ``secagg-precision``.
    """
    if selected < MIN_DEVICES:
        raise ConfigError(f"secure-aggregation needs at least 3 devices a round, got clients-per-round = {selected}: "
                          "with 2, each device learns the other's update from the sum; raise clients-per-round")
    clip, precision = config.number(knobs.SECAGG_CLIP), config.number(knobs.SECAGG_PRECISION)
    bits = config.integer(knobs.SECAGG_BITS)
    if bits_needed(selected, clip, precision) > bits:
        raise ConfigError(
            f"secagg-bits = {bits} is too small: {selected} devices x secagg-clip {clip:g} / secagg-precision "
            f"{precision:g} overflow it (needs {bits_needed(selected, clip, precision)} bits); raise secagg-bits "
            "(up to 64), lower secagg-clip, coarsen secagg-precision or select fewer devices")
    return {"threshold": config.number(knobs.SECAGG_THRESHOLD), "neighbours": config.integer(knobs.SECAGG_NEIGHBOURS),
            "clip": clip, "precision": precision, "bits": bits,
            "weight_clip": config.number(knobs.MAX_NUM_EXAMPLES), "work_cap": FEDNOVA_WORK_CAP}


def build_selector(config: RunConfig) -> RandomSelector:
    """Random selection, or Oort-style capability-aware selection."""
    if config[knobs.SELECTOR] == "oort":
        return OortSelector(config.integer(knobs.SEED), preferred_s=config.number(knobs.PREFERRED_ROUND_S),
                            epsilon=config.number(knobs.EXPLORATION),
                            fairness_rounds=config.integer(knobs.FAIRNESS_ROUNDS),
                            max_num_examples=config.integer(knobs.MAX_NUM_EXAMPLES))
    return RandomSelector(config.integer(knobs.SEED))


def build_policy(config: RunConfig) -> RoundPolicy:
    """The round policy named by ``round-policy``."""
    if config[knobs.ROUND_POLICY] == "deadline":
        return DeadlinePolicy(config.number(knobs.DEADLINE_S), config.number(knobs.OVER_SELECTION))
    return SyncPolicy()


def check_deadline(config: RunConfig, fleet: Fleet, model_bytes: int) -> None:
    """Refuse a deadline that no device in the fleet could meet with even one batch of work."""
    if config[knobs.ROUND_POLICY] != "deadline":
        return
    fastest = min(reply_seconds(profile, model_bytes, model_bytes, config.integer(knobs.BATCH_SIZE))
                  for name, profile in fleet.profiles.items() if name in dict(fleet.mix))
    if config.number(knobs.DEADLINE_S) < fastest:
        raise ConfigError(f"deadline-s = {config[knobs.DEADLINE_S]} is shorter than any device could finish a round "
                          f"(the fastest needs {fastest:.3g} s for one batch and the model's transfer); "
                          "raise deadline-s")


def with_evaluation(config: RunConfig, task: Task, num_nodes: int | None) -> RunConfig:
    """``config``, with federated evaluation turned on when the task has no central data.

    Without central data the devices evaluate the global model each round: about
    ``clients-per-round`` of them (all, in deployment) unless ``fraction-evaluate`` says otherwise.
    Every round driver runs Flower's federated evaluation (FedBuff's after each server step), so
    no strategy is refused here.
    """
    if task.central_data() is not None:
        return config
    if config.number(knobs.FRACTION_EVALUATE) > 0:
        return config
    fraction = 1.0 if num_nodes is None else min(1.0, config.integer(knobs.CLIENTS_PER_ROUND) / num_nodes)
    log.info("task '%s' has no central data: devices evaluate the global model (fraction-evaluate = %.3g)",
             task.name, fraction)
    return resolve_run_config({**config, knobs.FRACTION_EVALUATE: fraction})


def check_deployment(config: RunConfig, *, registered: int | None) -> None:
    """Refuse, before any Flower process starts, a deployment run that cannot work.

    Runs the same builders and checks the coordinator runs at start (task, strategy, secure
    aggregation's minimum, DP, codecs, deadline) and checks the run against the ``registered``
    devices (None: unknown, e.g. insecure mode without device registration).

    Raises
    ------
    ConfigError
        One line naming the problem and the fix.
    """
    per_round = config.integer(knobs.CLIENTS_PER_ROUND)
    # with gateways = true the registered nodes are gateways: each replies once a round, for all its devices
    nodes = GATEWAY_NODES if config[knobs.GATEWAYS] else "devices"
    why = " (each gateway replies once a round, for all its devices)" if config[knobs.GATEWAYS] else ""
    if registered is not None and per_round > registered:
        raise ConfigError(f"clients-per-round = {per_round} but only {registered} {nodes[:-1]}(s) are registered{why}; "
                          f"register more with `fedge keys add-device NAME` or lower --clients-per-round (to "
                          f"{registered})")
    if registered is not None and config.integer(knobs.MIN_TRAIN_REPLIES) > registered:
        raise ConfigError(f"min-train-replies = {config[knobs.MIN_TRAIN_REPLIES]} but only {registered} "
                          f"{nodes[:-1]}(s) are registered{why}; lower it "
                          f"(--run-config 'min-train-replies={registered}') or register more {nodes}")
    fleet = fleet_of(config)
    task = load_task(config)
    check_task(task, config)
    check_codecs(config, fleet)
    model = seeded_model(task, config.integer(knobs.SEED))
    build_strategy(config, None, privacy=build_privacy(config, registered or per_round),
                   submodels=build_sub_models(config, task, model, fleet))
    check_deadline(config, fleet, sum(len(array.data) for array in model_arrays(model).values()))


def training_graph_for(task: Task, model: torch.nn.Module, config: RunConfig, fleet: Fleet, *,
                       simulated: bool) -> tuple[Any, list[str]] | None:
    """The training graph for onnx devices when the run may have some (exported before anything is written)."""
    from fedge.server.training_bundle import export_training_graph, refuse_or_warn, wants_training_graph  # noqa: PLC0415

    if not wants_training_graph(config, fleet, simulated=simulated):
        return None
    try:
        return export_training_graph(task, model, config)
    except ExportError as exc:
        refuse_or_warn(exc, simulated=simulated)
        return None


def publish_training_graph(training: tuple[Any, list[str]], task: Task, config: RunConfig, run_dir: Path, *,
                           width: float = 1.0) -> str:
    """Sign and write the run's training bundle (a sub-model's of ``width``: ``training-w0.25.zip``);
    its architecture hash (what train instructions name)."""
    from fedge.edge.delivery import inference_kind  # noqa: PLC0415
    from fedge.edge.training_bundle import training_bundle_for  # noqa: PLC0415
    from fedge.server.bundles import run_signing_key  # noqa: PLC0415
    from fedge.server.training_bundle import write_run_training_bundle  # noqa: PLC0415

    graphs, metrics = training
    manifest = write_run_training_bundle(graphs, metrics, task, run_dir, private_key=run_signing_key(config, run_dir),
                                         path=training_bundle_for(width))
    if config[knobs.DEPLOYMENT]:  # devices fetch it from the coordinator's bundle service (`fedge pull`)
        from fedge.server.publish import publish_from_environment  # noqa: PLC0415

        publish_from_environment(inference_kind(width, "training"), run_dir / training_bundle_for(width))
    return str(manifest["architecture"])


def behaviour_of(config: RunConfig, fleet: Fleet) -> Behaviour:
    """The simulated fleet's behaviour (availability, dropout, jitter) from the run config."""
    return Behaviour.from_fleet(fleet, seed=config.integer(knobs.SEED), enabled=config.flag(knobs.DEVICE_BEHAVIOUR),
                                jitter=config.number(knobs.JITTER))


def run_coordinator(
    grid: Grid, config: RunConfig, *, progress: bool = True, simulated: bool = True, task: Task | None = None
) -> Path:
    """Run one federated training job on ``grid``; return the run directory.

    Everything that can be refused (config, fleet, data set, checkpoint) is checked
    before the run directory is created, so a refused run writes nothing. With
    ``resume`` the run continues after the last completed round in its run directory.
    ``simulated`` says whether the fleet config describes every node (simulation) or
    the devices are whoever connects (deployment). ``task`` (default: the one the run
    config names) is checked before anything else.
    """
    fleet = fleet_of(config)
    task = task if task is not None else load_task(config)
    check_task(task, config)
    if simulated:  # a fleet the data cannot be split across is refused now, not by every device
        task.partition(0, fleet.size, config)
    config = with_evaluation(config, task, fleet.size if simulated else None)
    model = seeded_model(task, config.integer(knobs.SEED))
    if config[knobs.INIT_CHECKPOINT]:
        saved = load_checkpoint(config.text(knobs.INIT_CHECKPOINT)).arrays
        load_arrays(model, ArrayRecord({name: Array(value) for name, value in saved.items()}),
                    source=f"checkpoint '{config[knobs.INIT_CHECKPOINT]}'")
    check_codecs(config, fleet)
    downlink = DownlinkEncoder(config, seed=config.integer(knobs.SEED))
    submodels = build_sub_models(config, task, model, fleet)
    strategy = build_strategy(config, fleet.size if simulated else None,
                              buffer_names=frozenset(name for name, _ in model.named_buffers()),  # never stepped
                              privacy=build_privacy(config, fleet.size), downlink=downlink if downlink.active else None,
                              submodels=submodels)
    check_deadline(config, fleet, sum(len(array.data) for array in model_arrays(model).values()))
    training = training_graph_for(task, model, config, fleet, simulated=simulated)
    width_training = width_training_graphs(task, model, config, submodels, fleet) if training is not None else {}
    run_dir = run_dir_for(config, task.name)
    history = _resume_into(model, strategy, run_dir, config) if config[knobs.RESUME] else None
    if history is None and (run_dir / "checkpoint.npz").exists():
        raise ConfigError(f"run directory '{run_dir}' already holds a run; continue it with "
                          "--resume or choose another --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config)
    log.info("%s", config_summary(config, run_dir))
    log.debug("effective run config: %s", json.dumps(config, sort_keys=True))
    log.info("%s", task.describe())
    log.info("run directory: %s", run_dir)

    poll = config.number(knobs.GRID_POLL_INTERVAL)
    metered = MeteredGrid(grid, fleet, poll_interval=poll if poll > 0 else None,
                          behaviour=behaviour_of(config, fleet) if simulated else None)
    recorder = RoundRecorder(run_dir, config, metered, strategy, task, model, progress=progress,
                             history=history, widths=list(trained_widths(submodels, fleet).values()))
    instruction = wire.TrainInstruction.from_run_config(config)  # what every device trains; strategies vary it
    if strategy.privacy is not None and strategy.privacy.client_side:
        instruction = replace(instruction, dp_client_clipping=config.text(knobs.DP).removeprefix("client-"))
    evaluate_config = ConfigRecord()
    if training is not None:  # onnx devices train and evaluate with this graph (fetching it if they hold another)
        instruction = replace(instruction, training_graph=publish_training_graph(training, task, config, run_dir))
        evaluate_config[wire.TRAINING_GRAPH] = instruction.training_graph
        for width, graphs in width_training.items():  # sub-models: a graph per width (instructions name their own)
            assert submodels is not None
            submodels.training_graphs[as_fraction(width)] = publish_training_graph(graphs, task, config, run_dir,
                                                                                   width=width)
    with recorder.progress:
        strategy.start(metered, model_arrays(model), config.integer(knobs.NUM_ROUNDS),
                       timeout=config.number(knobs.ROUND_TIMEOUT), train_config=instruction.to_record(),
                       evaluate_config=evaluate_config,
                       evaluate_fn=recorder.on_round_end,
                       start_round=int(history[-1]["round"]) + 1 if history else 1)
    recorder.finish()
    return run_dir


def _resume_into(model: torch.nn.Module, strategy: FedAvg, run_dir: Path,
                 config: RunConfig) -> list[dict[str, Any]]:
    """Load ``run_dir``'s last checkpoint into ``model`` and ``strategy``; return its history.

    Raises
    ------
    CheckpointMismatch
        If there is no checkpoint, or it was made with other model settings.
    """
    path = run_dir / "checkpoint.npz"
    if not path.exists():
        raise CheckpointMismatch(f"cannot resume: '{path}' does not exist (no round was completed)")
    checkpoint = load_checkpoint(path)
    if checkpoint.fingerprint != config_fingerprint(config):
        raise CheckpointMismatch(
            f"cannot resume '{run_dir}': its checkpoint was made with {checkpoint.model_keys}, "
            f"this run has {model_keys(config)}; resume with the same settings or start a new run-dir")
    load_arrays(model, ArrayRecord({k: Array(v) for k, v in checkpoint.arrays.items()}),
                source=f"checkpoint '{path}'")
    strategy.restore_state(checkpoint.strategy_state)
    log.info("resuming '%s' after round %d", run_dir, checkpoint.server_round)
    return checkpoint.history
