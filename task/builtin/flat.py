"""Classification of flat feature vectors with one of fedge's registered models (logreg, mlp, cnn):
what the built-in ``digits``, ``synthetic``, ``npz`` and ``csv`` tasks share."""

from __future__ import annotations

from functools import cached_property

from torch import nn

from fedge import knobs
from fedge.config import RunConfig
from fedge.signature import InputSpec
from fedge.task.api import Task, TaskData
from fedge.task.data import label_names
from fedge.task.models import model_class

INPUT_NAME = "input"


class FlatClassification(Task):
    """A classification task on ``(n, features)`` float32 inputs, model chosen by ``model``.

    Subclasses define :meth:`pooled`: all examples of the data set, before the held-out split.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.model_name = config.text(knobs.MODEL)
        model_class(self.model_name)  # an unknown model is refused now, naming the registered ones
        self.name = f"{config.text(knobs.DATASET)}-{self.model_name}"

    @cached_property
    def split(self) -> tuple[TaskData, TaskData]:
        """(training examples, held-out test examples)."""
        raise NotImplementedError

    @property
    def num_features(self) -> int:
        """Features per example."""
        return int(self.split[0].inputs[0].shape[1])

    @property
    def num_classes(self) -> int:
        """Classes (labels are 0..num_classes-1)."""
        return int(max(self.split[0].targets.max(), self.split[1].targets.max())) + 1

    @property
    def inputs(self) -> tuple[InputSpec, ...]:  # type: ignore[override]
        return (InputSpec(INPUT_NAME, ("batch", self.num_features)),)

    @property
    def labels(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(label_names(self.num_classes))

    def build_model(self) -> nn.Module:  # noqa: D102
        return model_class(self.model_name)(self.num_features, self.num_classes)  # type: ignore[call-arg]

    def train_data(self) -> TaskData:  # noqa: D102
        return self.split[0]

    def central_data(self) -> TaskData:  # noqa: D102
        return self.split[1]
