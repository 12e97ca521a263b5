"""One workload's train step under a plan (:func:`lowmem_jax.build`): its optimizer, loss and
configured model, a fresh or abstract state, batches of its shapes, the verdicts and the
compile-only analysis; and the shapes of a model's variables."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowmem_jax.analysis import memory
from lowmem_jax.analysis.verdicts import verdicts
from lowmem_jax.compose.plan import Plan
from lowmem_jax.compose.step import TrainState
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.base import LossFn, Optimizer, PyTree
from lowmem_jax.core.technique import Verdict
from lowmem_jax.workloads.definition import Workload, variable_shapes
from lowmem_jax.workloads.recipes import Recipe

__all__ = ["Setup", "variable_shapes"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One workload's train step under a plan, ready to run or to analyse (:func:`build`).

    Attributes:
      step: the jitted train step ``(state, batch) -> (state, metrics)``.
      tx: the plan's optimizer (``plan.wrap_optimizer`` of the recipe's).
      loss_fn: the configured model's loss (what the step casts and differentiates).
      model: the configured model (remat, compute dtype).
      plan: the plan, with the workload's sparsity defaults filled in.
      workload: the :class:`Workload`.
      recipe: the recipe the optimizer was built from.
      config: a JSON-able description (model, batch size, plan).
    """

    step: Callable
    tx: Optimizer
    loss_fn: LossFn
    model: Any  # Linen or NNX
    plan: Plan
    workload: Workload
    recipe: Recipe
    config: dict[str, Any]

    def init_state(
        self,
        batch: PyTree,
        rng: jax.Array | None = None,
        *,
        jit: bool = True,
        variables: PyTree | None = None,
    ) -> TrainState:
        """A fresh state: parameters initialised from the first rows of ``batch``'s
        ``init_inputs`` with ``rng`` (default ``PRNGKey(0)``, also the state's step key); an
        optimizer that needs the loss's gradient (SNIP masks) gets it on the whole ``batch``.

        ``variables``: the model's variables to start from instead (``{"params": ...,
        "batch_stats": ...}``, the structure of :meth:`abstract_variables`), e.g. a decomposed
        dense model's. ``jit=False`` initialises op by op; the initial values can differ from
        the jitted ones in the last bit (fused arithmetic), so a run keeps one choice to stay
        reproducible.
        """
        rng = jax.random.PRNGKey(0) if rng is None else rng
        if not jit:  # TrainState.create lays the state out as the plan's techniques do
            return self._init_state(batch, rng, variables)
        if self.plan.mesh() is None:  # no shardings to place: one trace, not two
            return jax.jit(self._init_state)(batch, rng, variables)
        # Inside jit the layout is the program's output shardings (a device_put there is not)
        shapes = jax.eval_shape(self._init_state, batch, rng, variables)
        init = jax.jit(self._init_state, out_shardings=self.plan.state_shardings(shapes))
        return init(batch, rng, variables)

    def abstract_variables(self) -> PyTree:
        """The shapes and dtypes of the configured model's variables (``model.init``)."""
        return variable_shapes(self.model, self.workload)

    def _init_state(
        self, batch: PyTree, rng: jax.Array, variables: PyTree | None = None
    ) -> TrainState:
        if variables is None and self.workload.init is not None:
            variables = self.workload.init(self.model, rng, batch)
        elif variables is None:
            inputs = [batch[k][:2] for k in self.workload.init_inputs]
            variables = self.model.init(rng, *inputs, train=False)
        params = variables["params"]
        model_state = {k: v for k, v in variables.items() if k != "params"}
        grads = None
        if self.tx.needs_init_grads:  # SNIP: the gradient of the loss on this batch
            loss_fn = self.plan.model_loss(self.loss_fn)
            params = self.plan.policy.cast_to_param(params)
            grads = jax.grad(lambda p: loss_fn(p, model_state, batch, None)[0])(params)
        return TrainState.create(
            params=params, tx=self.tx, plan=self.plan, model_state=model_state, rng=rng, grads=grads
        )

    def abstract_state(self) -> TrainState:
        """The state's shapes and dtypes (nothing is computed), with the plan's shardings
        where it lays the state out (:meth:`Plan.state_shardings`)."""
        shapes = jax.eval_shape(
            self._init_state, self.workload.batch, jax.random.PRNGKey(0), self.abstract_variables()
        )
        shardings = self.plan.state_shardings(shapes)
        if shardings is None:
            return shapes
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )

    def abstract_batch(self) -> PyTree:
        """The workload's batch shapes, split over the plan's mesh when it has one."""
        mesh = self.plan.mesh()
        if mesh is None:
            return self.workload.batch
        shardings = sharding_lib.named(mesh, sharding_lib.batch_spec(self.workload.batch))
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.workload.batch,
            shardings,
        )

    def example_batch(self, seed: int = 0) -> dict[str, jax.Array]:
        """A random batch of the workload's shapes: float images ~ N(0, 1) (uint8 ones uniform
        in [0, 256)), labels in [0, 10), tokens in [4, min(1000, the model's vocabulary)) (no
        padding, no special ids; ``src`` from ``src_vocab_size``, the others from
        ``tgt_vocab_size`` where the model has them)."""
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.workload.batch))
        out = {}
        for key, (name, leaf) in zip(keys, sorted(self.workload.batch.items()), strict=True):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                out[name] = jax.random.normal(key, leaf.shape, leaf.dtype)
            elif name == "image":  # raw pixels
                out[name] = jax.random.randint(key, leaf.shape, 0, 256).astype(leaf.dtype)
            elif name == "label":
                out[name] = jax.random.randint(key, leaf.shape, 0, 10, leaf.dtype)
            else:
                field = "src_vocab_size" if name == "src" else "tgt_vocab_size"
                vocab = min(1000, getattr(self.workload.model, field, 1000))
                out[name] = jax.random.randint(key, leaf.shape, 4, vocab, leaf.dtype)
        return out

    def verdicts(self) -> list[Verdict]:
        """Whether each technique of the plan took effect on this step
        (:func:`lowmem_jax.analysis.verdicts`: traced at the workload's batch shapes, not
        compiled)."""
        return verdicts(
            self.step,
            self.abstract_state(),
            self.abstract_batch(),
            plan=self.plan,
            tx=self.tx,
            loss_fn=self.loss_fn,
        )

    def analyze(
        self, compiling: contextlib.AbstractContextManager | None = None
    ) -> memory.MemoryReport:
        """Compile-only memory analysis of the step at the workload's batch shapes
        (``compiling``: see :func:`lowmem_jax.analysis.memory.analyze`).

        Over several devices (a plan that is not :meth:`Plan.on_one_device`), XLA's figures
        are per device (the partitioned program one device runs), ``config["mesh_devices"]``
        is the mesh's size and ``config["devices"]`` its data axis' (as ``--devices`` means
        it, ``0`` written out); the analytic figures stay those of one device running the
        whole batch."""
        mesh = self.plan.mesh() if self.plan.on_one_device() != self.plan else None
        config = self.config
        if mesh is not None:
            data = sharding_lib.data_devices(mesh) if self.plan.shard != "none" else 0
            config = {**config, "devices": data, "mesh_devices": mesh.size}
        report = memory.analyze(
            self.step,
            self.abstract_state(),
            self.abstract_batch(),
            loss_fn=self.loss_fn,
            plan=self.plan,
            tx=self.tx,
            config=config,
            compiling=compiling,
        )
        if mesh is not None:
            report.notes.append(
                f"xla: per device, the plan's layout over {mesh.size} devices; "
                "analytic: one device, the whole batch"
            )
        return report
