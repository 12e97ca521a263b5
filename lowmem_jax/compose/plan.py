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
import functools
import inspect
import json
import pathlib
import textwrap
import types
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

from lowmem_jax.blocks import hooks as block_hooks
from lowmem_jax.core import mesh as sharding_lib
from lowmem_jax.core.base import Optimizer, PyTree, as_optimizer
from lowmem_jax.techniques import TECHNIQUES, loss_scale, precision

__all__ = ["Plan"]

ModuleT = TypeVar("ModuleT")


class _PlanMethods:
    """What a :class:`Plan` does with its fields (the fields come from the techniques)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):  # typed values, parsed once (e.g. a remat policy)
            parse = f.metadata.get("parse")
            if parse is not None:
                object.__setattr__(self, f.name, parse(getattr(self, f.name)))
        for technique in TECHNIQUES:  # in order: a later rule may read an earlier field
            technique.validate(self)

    @property
    def policy(self) -> precision.Policy:
        """The precision policy (:func:`lowmem_jax.techniques.precision.get_policy`)."""
        return precision.get_policy(self.precision)

    @property
    def loss_scale_kind(self) -> str:
        """``loss_scale`` with ``auto`` resolved: dynamic when computing in float16, else none."""
        if self.loss_scale == "auto":
            return "dynamic" if self.policy.needs_loss_scale else "none"
        return self.loss_scale

    def make_loss_scale(self) -> loss_scale.LossScale:
        """The loss-scale state a train state starts with."""
        return loss_scale.make_loss_scale(
            self.loss_scale_kind,
            initial_scale=self.initial_loss_scale,
            period=self.loss_scale_period,
            factor=self.loss_scale_factor,
            min_loss_scale=self.min_loss_scale,
        )

    def configure_model(self, model: ModuleT) -> ModuleT:
        """A copy of ``model`` with this plan's model-side techniques: each registered
        technique's ``model.configure`` hook in order (layers factorized, the compute ``dtype``,
        the convolution a step without loops runs, the ``remat`` policy per block or
        :func:`lowmem_jax.techniques.remat.remat_module`, zero3's per-block gathering, weight
        streaming's layouts; see :mod:`lowmem_jax.techniques`).

        Raises:
          ValueError: ``remat_blocks`` for a model that has its own ``remat`` attribute, a
            segmenting policy for a model without one, or ``factorize`` for a model with no layer
            it can factorize (NNX: here; Linen: at ``init``).
        """
        for technique in TECHNIQUES:
            if technique.model.configure is not None:
                model = technique.model.configure(model, self)
        return model

    def wrap_optimizer(
        self, tx: optax.GradientTransformation, params: PyTree | None = None
    ) -> Optimizer:
        """``tx`` (any optax transformation) with this plan's optimizer-side techniques: every
        registered technique's ``optimizer.inner`` hook in order, then every ``optimizer.wrap``
        hook in order (the state's stored format, 16-, 8- or 4-bit, around ``tx``, sparse
        training around that, sharding outermost; float32 arithmetic whenever the state or the
        parameters are stored in fewer bits).

        ``params``: the model's parameters, arrays or shapes (``jax.eval_shape``); needed when
        the plan is sparse (which leaves, their budgets). The result is what
        :meth:`lowmem_jax.TrainState.create` and :func:`lowmem_jax.make_train_step` take.
        With ``optimizer_state="auto"`` and float32 parameters the state is left as ``tx``
        makes it (no wrapper).

        Raises:
          ValueError: a sparse plan without ``params``.
        """
        for technique in TECHNIQUES:
            if technique.optimizer.inner is not None:
                tx = technique.optimizer.inner(tx, self, params)
        for technique in TECHNIQUES:
            if technique.optimizer.wrap is not None:
                tx = technique.optimizer.wrap(tx, self, params)
        return as_optimizer(tx)

    def check_optimizer(self, tx: optax.GradientTransformation | Optimizer, params: PyTree) -> None:
        """Refuses a raw optax ``tx`` where this plan has optimizer-side work that changes what
        is stored (16-bit parameters' state format, sparse training, a low-bit state): a raw
        transformation would silently skip it. An :class:`~lowmem_jax.core.base.Optimizer`
        (what :meth:`wrap_optimizer` returns) passes, and so does a raw ``tx`` whose stored
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
                for hook in (t.optimizer.inner, t.optimizer.wrap)
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
        model sees: every registered technique's ``step.loss`` in order (the compute dtype's
        casts, :func:`lowmem_jax.techniques.precision.cast_loss_fn`; compressed residuals;
        ...), traced with the techniques' per-block hooks active (``model.block``:
        :mod:`lowmem_jax.blocks.hooks`)."""
        for technique in TECHNIQUES:
            if technique.step.loss is not None:
                loss_fn = technique.step.loss(loss_fn, self)
        makers = [t.model.block for t in TECHNIQUES if t.model.block is not None]
        if not makers or not any(make(self) is not None for make in makers):
            return loss_fn
        inner = loss_fn

        @functools.wraps(inner)
        def with_block_hooks(*args):
            hooks = [hook for make in makers if (hook := make(self)) is not None]
            with block_hooks.active(*hooks):
                out = inner(*args)
            for hook in hooks:
                hook.done()
            return out

        return with_block_hooks

    def bind(self, work: Any, total_steps: int | None = None) -> tuple[Any, Plan]:
        """``(work, plan)``: the workload and this plan as the step of ``work`` is built from
        them, every registered technique's ``workload.bind`` in order (e.g. the batch's stored
        dtype, sparse training's leaves and end from the workload).

        Raises:
          ValueError: in one line, a plan that cannot apply to ``work`` (e.g. a batch size
            its microbatches do not divide).
        """
        plan = self
        for technique in TECHNIQUES:
            if technique.workload.bind is not None:
                work, plan = technique.workload.bind(work, plan, total_steps)
        return work, plan

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        """The fields ``lowmem`` exposes as flags (those declared with a help text)."""
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    def mesh(self) -> jax.sharding.Mesh | None:
        """The device mesh the step's layouts refer to: one axis per registered technique that
        lays the step out along one (``shard``'s ``"data"``, ``pipeline``'s ``"stage"``);
        ``None``: one device and no layout."""
        hooks = [t.layout.mesh_axis for t in TECHNIQUES if t.layout.mesh_axis is not None]
        axes = [axis for hook in hooks if (axis := hook(self))]
        return sharding_lib.device_mesh(dict(axes)) if axes else None

    def state_shardings(self, state: Any) -> Any:
        """Where the train state's leaves live over :meth:`mesh` (a tree of shardings matching
        ``state``): the registered techniques' layouts merged per leaf
        (:func:`lowmem_jax.core.mesh.merge_shardings`); ``None``: as placed by default."""
        layouts = [
            layout for technique in TECHNIQUES
            if technique.layout.state_shardings is not None
            and (layout := technique.layout.state_shardings(state, self)) is not None
        ]  # fmt: skip
        if len(layouts) < 2:
            return layouts[0] if layouts else None
        return sharding_lib.merge_shardings(state, layouts, self.mesh())

    def on_one_device(self) -> Plan:
        """The plan with every setting that needs several devices off (for a comparison): this
        plan where its step runs on one device."""
        fields: dict[str, Any] = {}
        for technique in TECHNIQUES:
            if technique.layout.one_device is not None:
                fields.update(technique.layout.one_device(self))
        return dataclasses.replace(self, **fields) if fields else self

    def compiler_options(self) -> dict[str, str]:
        """XLA options the jitted step needs for this plan: every registered technique's
        (e.g. :func:`lowmem_jax.blocks.policy.compiler_options`), their ``xla_disable_hlo_passes``
        lists joined."""
        options: dict[str, str] = {}
        passes: list[str] = []
        for technique in TECHNIQUES:
            if technique.step.compiler_options is not None:
                wanted = dict(technique.step.compiler_options(self))
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
            if technique.report.compile_cost is not None:
                cost *= technique.report.compile_cost(self)
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


def stub() -> str:
    """The text of ``plan.pyi`` (beside this module): :class:`Plan`'s fields as the techniques
    declare them and its methods' signatures, so readers, ``grep`` and type checkers see what
    ``make_dataclass`` builds. ``tests/test_plan.py`` keeps the committed file equal to it;
    :func:`write_stub` writes it."""
    imports: dict[str, set[str]] = {
        "collections.abc": {"Callable"},
        "dataclasses": set(),
        "typing": {"Any", "TypeVar"},
        "jax": set(),
        "optax": set(),
        "lowmem_jax.core.base": {"Optimizer", "PyTree"},
        "lowmem_jax.techniques": {"loss_scale", "precision"},
    }

    def spelled(tp: Any) -> str:
        if isinstance(tp, types.UnionType):
            return " | ".join(spelled(a) for a in tp.__args__)
        if tp is type(None):
            return "None"
        if tp.__module__ != "builtins":
            imports.setdefault(tp.__module__, set()).add(tp.__name__)
        return tp.__name__

    def default(value: Any) -> str:  # a str subclass (a parsed policy) as its text
        return json.dumps(str(value)) if isinstance(value, str) else repr(value)

    def signature(fn: Callable) -> str:
        sig = inspect.signature(fn)
        params = []
        for p in sig.parameters.values():
            text = p.name if p.annotation is p.empty else f"{p.name}: {p.annotation}"
            params.append(text if p.default is p.empty else f"{text} = {default(p.default)}")
        return params, sig.return_annotation

    fields = [f for t in TECHNIQUES for f in t.fields]
    body = [f"    {f.name}: {spelled(f.type)}" for f in fields]
    body += ["", "    def __init__(", "        self,", "        *,"]
    body += [f"        {f.name}: {spelled(f.type)} = {default(f.default)}," for f in fields]
    body += ["    ) -> None: ..."]
    for name, member in vars(_PlanMethods).items():
        if name.startswith("_"):
            continue
        decorator, fn = [], member
        if isinstance(member, property):
            decorator, fn = ["    @property"], member.fget
        elif isinstance(member, classmethod):
            decorator, fn = ["    @classmethod"], member.__func__
        params, returns = signature(fn)
        one_line = f"    def {name}({', '.join(params)}) -> {returns}: ..."
        if len(one_line) > 100:
            one_line = "\n".join(
                [f"    def {name}(", *(f"        {p}," for p in params), f"    ) -> {returns}: ..."]
            )
        body += [*decorator, one_line]

    def lines(modules: list[str]) -> str:  # isort's order: plain imports, then from-imports
        plain = [f"import {m}" for m in sorted(modules) if not imports[m]]
        named = [f"from {m} import {', '.join(sorted(imports[m]))}" for m in sorted(modules)
                 if imports[m]]  # fmt: skip
        return "\n".join(plain + named)

    first_party = [m for m in imports if m.startswith("lowmem_jax")]
    third_party = ["jax", "optax"]
    standard = [m for m in imports if m not in first_party + third_party]
    text = "\n\n".join(lines(group) for group in (standard, third_party, first_party))
    doc = textwrap.fill(
        _PLAN_DOC.split("\n\n")[0].replace("\n", " "), 96, initial_indent="    ",
        subsequent_indent="    ",
    ).strip()  # fmt: skip
    return (
        "# Generated from the techniques' fields by lowmem_jax.compose.plan.stub(): do not edit;\n"
        "# lowmem_jax.compose.plan.write_stub() writes it again (tests/test_plan.py checks it).\n"
        f"{text}\n\n"
        '__all__ = ["Plan"]\n\n'
        'ModuleT = TypeVar("ModuleT")\n\n'
        "class Plan:\n"
        f'    """{doc}"""\n\n' + "\n".join(body) + "\n"
    )


def write_stub() -> pathlib.Path:
    """Writes :func:`stub` to ``plan.pyi`` beside this module; returns its path."""
    path = pathlib.Path(__file__).with_suffix(".pyi")
    path.write_text(stub())
    return path
