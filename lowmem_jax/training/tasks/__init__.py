"""The training loop's task plug-ins: data, batches, evaluation and summary per task.

A task module has ``KIND``, ``DATASETS``, ``DEFAULT_MODEL``, ``MODELS`` (for messages),
``check_config(config)`` and a ``Task(config)`` class with ``total_steps``, ``eval_every``,
``workload(config)``, ``example_batch()``, ``train_batches(start, stop)``, ``evaluator(setup)``
(whose ``evaluate(params, model_state)`` gives a record's ``test_*`` metrics) and
``summary(...)``; :mod:`lowmem_jax.training.loop` does everything else the same way for each.
"""

from types import ModuleType

from lowmem_jax.core.base import choose
from lowmem_jax.training.tasks import classification, language_model, translation

__all__ = ["classification", "translation", "language_model", "DATASETS", "task_of", "make_task"]

#: Dataset name -> the task module that trains on it.
DATASETS: dict[str, ModuleType] = {
    name: module
    for module in (classification, translation, language_model)
    for name in module.DATASETS
}


def task_of(dataset: str) -> ModuleType:
    """The task module of ``dataset``.

    Raises:
      ValueError: naming ``dataset`` and the allowed values.
    """
    return choose(DATASETS, dataset, "dataset")


def make_task(config):
    """The task of ``config.dataset``, with its data loaded."""
    return task_of(config.dataset).Task(config)
