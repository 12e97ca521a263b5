"""The Plan: which techniques a train step composes, a field per setting, validated on
construction.

``Plan``'s fields are declared by the techniques that own them (:class:`PlanField` in each
module of :mod:`lowmem_jax.techniques`, in the registry's order); its methods compose them:
:meth:`Plan.configure_model` (model-side hooks), :meth:`Plan.wrap_optimizer` (optimizer-side),
:meth:`Plan.model_loss` and :func:`lowmem_jax.make_train_step` (step-side). A technique module
never imports this one or another technique.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lowmem_jax.blocks import scanned as scanned_blocks
from lowmem_jax.blocks.remat import ModuleT
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.base import Optimizer, PyTree, as_optimizer
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.techniques.loss_scale import scale as loss_scale_lib
from lowmem_jax.techniques.precision import policy as precision_lib

__all__ = ["Plan"]


class _PlanMethods:
    """What a :class:`Plan` does with its fields (the fields come from the techniques)."""

    def __post_init__(self):
        for technique in TECHNIQUES:  # in order: a later rule may read an earlier field
            technique.validate(self)

    @property
    def policy(self) -> precision_lib.Policy:
        return precision_lib.get_policy(self.precision)

    @property
    def loss_scale_kind(self) -> str:
        if self.loss_scale == "auto":
            return "dynamic" if self.policy.needs_loss_scale else "none"
        return self.loss_scale

    def make_loss_scale(self) -> loss_scale_lib.LossScale:
        return loss_scale_lib.make_loss_scale(
            self.loss_scale_kind,
            initial_scale=self.initial_loss_scale,
            period=self.loss_scale_period,
            factor=self.loss_scale_factor,
            min_loss_scale=self.min_loss_scale,
        )

    def configure_model(self, model: ModuleT) -> ModuleT:
        """A copy of ``model`` with this plan's model-side techniques: each registered
        technique's ``configure_model`` hook in order (the compute ``dtype``, the ``remat``
        policy per block or :func:`lowmem_jax.blocks.remat.remat_module`, ``factorize``, zero3's
        per-block parameter gathering; see :mod:`lowmem_jax.techniques`).

        Then a Linen model whose ``conv_impl`` is ``"auto"`` gets ``"xla"`` when the step has no
        loop (one microbatch, every stack unrolled:
        :func:`lowmem_jax.blocks.scanned.straight_line`): the loop-friendly convolution is for
        XLA:CPU's loop bodies; in a step with no loop XLA's own keeps fewer buffers.

        Raises:
          ValueError: ``remat_blocks`` for a model that has its own ``remat`` attribute, a
            segmenting policy for a model without one, or ``factorize`` for a model with no layer
            it can factorize (NNX: here; Linen: at ``init``).
        """
        for technique in TECHNIQUES:
            if technique.configure_model is not None:
                model = technique.configure_model(model, self)
        if (
            not isinstance(model, nnx.Module)
            and getattr(model, "conv_impl", None) == "auto"
            and self.microbatches == 1
            and scanned_blocks.straight_line(
                getattr(model, "unroll", False), self.remat, self.policy.compute_dtype
            )
        ):
            model = model.clone(conv_impl="xla")
        return model

    def wrap_optimizer(
        self, tx: optax.GradientTransformation, params: PyTree | None = None
    ) -> Optimizer:
        """``tx`` (any optax transformation) with this plan's optimizer-side techniques: every
        registered technique's ``inner_optimizer`` hook in order, then every
        ``wrap_optimizer`` hook in order (the state's stored format, 16-, 8- or 4-bit, around
        ``tx``, sparse training around that, sharding outermost; float32 arithmetic whenever
        the state or the parameters are stored in fewer bits).

        ``params``: the model's parameters, arrays or shapes (``jax.eval_shape``); needed when
        the plan is sparse (which leaves, their budgets). The result is what
        :meth:`lowmem_jax.TrainState.create` and :func:`lowmem_jax.make_train_step` take.
        With ``optimizer_state="auto"`` and float32 parameters the state is left as ``tx``
        makes it (no wrapper).

        Raises:
          ValueError: a sparse plan without ``params``.
        """
        for technique in TECHNIQUES:
            if technique.inner_optimizer is not None:
                tx = technique.inner_optimizer(tx, self, params)
        for technique in TECHNIQUES:
            if technique.wrap_optimizer is not None:
                tx = technique.wrap_optimizer(tx, self, params)
        return as_optimizer(tx)

    def check_optimizer(self, tx: optax.GradientTransformation | Optimizer, params: PyTree) -> None:
        """Refuses a raw optax ``tx`` where this plan has optimizer-side work that changes what
        is stored (16-bit parameters' state format, sparse training, a low-bit state): a raw
        transformation would silently skip it. An :class:`~lowmem_jax.core.base.Optimizer` (what
        :meth:`wrap_optimizer` returns) passes, and so does a raw ``tx`` whose stored
        parameters and state the plan's optimizer would leave as they are (e.g. plain SGD, which
        has no state, under ``fp16``).

        Raises:
          ValueError: naming the techniques and ``plan.wrap_optimizer(tx, params)``.
        """
        if isinstance(tx, Optimizer):
            return
        wrapped = self.wrap_optimizer(tx, params)
        if not wrapped.needs_init_grads and _stored_like(as_optimizer(tx), wrapped, params):
            return
        skipped = [
            t.name
            for t in TECHNIQUES
            if any(
                hook is not None and hook(tx, self, params) is not tx
                for hook in (t.inner_optimizer, t.wrap_optimizer)
            )
        ]
        half = self.policy.param_dtype != jnp.float32
        raise ValueError(
            f"a raw optax transformation skips what this plan does to the optimizer "
            f"({', '.join(skipped)}"
            + (f"; precision={self.precision!r} stores 16-bit parameters" if half else "")
            + "): pass tx=plan.wrap_optimizer(tx, params) to TrainState.create and "
            "make_train_step"
        )

    def model_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn(params, model_state, batch, rng)`` as the step runs it on the parameters the
        model sees: every registered technique's ``wrap_loss`` in order (the compute dtype's
        casts, :func:`lowmem_jax.techniques.precision.policy.cast_loss_fn`)."""
        for technique in TECHNIQUES:
            if technique.wrap_loss is not None:
                loss_fn = technique.wrap_loss(loss_fn, self)
        return loss_fn

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        """The fields ``lowmem`` exposes as flags (those declared with a help text)."""
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    def mesh(self) -> jax.sharding.Mesh | None:
        """The device mesh the step's layouts refer to: one axis per registered technique that
        lays the step out along one (``shard``'s ``"data"``, ``pipeline``'s ``"stage"``);
        ``None``: one device and no layout."""
        axes = [a for t in TECHNIQUES if t.mesh_axis is not None and (a := t.mesh_axis(self))]
        return sharding_lib.device_mesh(dict(axes)) if axes else None

    def state_shardings(self, state: Any) -> Any:
        """Where the train state's leaves live over :meth:`mesh` (a tree of shardings matching
        ``state``): the registered techniques' layouts merged per leaf
        (:func:`lowmem_jax.core.mesh.merge_shardings`); ``None``: as placed by default."""
        layouts = [
            layout for technique in TECHNIQUES
            if technique.state_shardings is not None
            and (layout := technique.state_shardings(state, self)) is not None
        ]  # fmt: skip
        if len(layouts) < 2:
            return layouts[0] if layouts else None
        return sharding_lib.merge_shardings(state, layouts, self.mesh())

    def on_one_device(self) -> Plan:
        """The plan with every setting that needs several devices off (for a comparison): this
        plan where its step runs on one device."""
        fields: dict[str, Any] = {}
        for technique in TECHNIQUES:
            if technique.one_device is not None:
                fields.update(technique.one_device(self))
        return dataclasses.replace(self, **fields) if fields else self

    def compiler_options(self) -> dict[str, str]:
        """XLA options the jitted step needs for this plan: every registered technique's
        (e.g. :func:`lowmem_jax.blocks.remat.compiler_options`), their ``xla_disable_hlo_passes``
        lists joined."""
        options: dict[str, str] = {}
        passes: list[str] = []
        for technique in TECHNIQUES:
            if technique.compiler_options is not None:
                wanted = dict(technique.compiler_options(self))
                disabled = wanted.pop("xla_disable_hlo_passes", "")
                passes += [p for p in disabled.split(",") if p and p not in passes]
                options.update(wanted)
        if passes:
            options["xla_disable_hlo_passes"] = ",".join(passes)
        return options

    def compile_cost(self) -> float:
        """About how many times longer the step takes to trace and compile than with no
        technique: the product of the registered techniques' ``compile_cost`` factors."""
        cost = 1.0
        for technique in TECHNIQUES:
            if technique.compile_cost is not None:
                cost *= technique.compile_cost(self)
        return cost

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description, ``loss_scale`` resolved: the fields with a flag, then the
        other settings, then each config (a value with ``describe()``, e.g.
        :meth:`SparseConfig.describe`) as its description, left out when unset; a field declared
        ``omit_default`` only when set."""
        flags, settings, configs = {}, {}, {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("omit_default") and value == f.default:
                continue  # as every earlier record has it
            if value is None or hasattr(value, "describe"):
                if value is not None:
                    configs[f.name] = value.describe()
            elif "help" in f.metadata:
                flags[f.name] = value
            else:
                settings[f.name] = value
        flags["loss_scale"] = self.loss_scale_kind
        return {**flags, **settings, **configs}


_PLAN_DOC = """Which techniques the train step composes: one field per setting, each declared by the
technique that owns it (:data:`lowmem_jax.techniques.TECHNIQUES`, in their order; see
:mod:`lowmem_jax.core.technique`). A frozen dataclass, keyword arguments only, validated on
construction (a bad value raises ``ValueError`` naming the field and the allowed values).

Attributes:
"""

Plan = dataclasses.make_dataclass(
    "Plan",
    [(f.name, f.type, f.field()) for t in TECHNIQUES for f in t.fields],
    bases=(_PlanMethods,),
    frozen=True,
    kw_only=True,
    namespace={
        "__module__": __name__,
        "__doc__": _PLAN_DOC
        + "".join(f"  {f.name}: {f.doc}\n" for t in TECHNIQUES for f in t.fields),
    },
)


def _stored_like(a: Optimizer, b: Optimizer, params: PyTree) -> bool:
    """Whether ``a`` and ``b`` store ``params`` and their initial state in the same arrays
    (shapes and dtypes; the wrappers around them may differ), traced, nothing computed."""

    def arrays(opt: Optimizer) -> list[tuple]:
        stored = jax.eval_shape(opt.store, params)
        return sorted((x.shape, str(x.dtype)) for x in jax.tree.leaves(stored))

    return arrays(a) == arrays(b)
