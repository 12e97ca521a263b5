"""The Plan: which techniques a train step composes, each one a field, validated on construction.

==================  ================================  =============================================
field               technique module                  where it acts
==================  ================================  =============================================
``precision``       :mod:`lowmem_jax.precision`       the step (cast in, fp32 out) and the model's
                                                      compute ``dtype`` (:meth:`configure_model`)
``loss_scale`` (+   :mod:`lowmem_jax.loss_scale`      the step (scale, unscale, skip, adjust)
settings)
``microbatches``    :mod:`lowmem_jax.microbatch`      the step (``lax.scan`` accumulation)
``remat``           :mod:`lowmem_jax.remat`           the model, per block (:meth:`configure_model`)
``sparsity``        :mod:`lowmem_jax.sparsity`        the optimizer and the parameters' storage
                                                      (:meth:`wrap_optimizer`)
``optimizer_state`` :mod:`lowmem_jax.optimizer_state` the state's stored format, around the
                                                      (sparse) optimizer (:meth:`wrap_optimizer`)
``factorize``       :mod:`lowmem_jax.factorization`   the model's layers, factorized
                                                      (:meth:`configure_model`)
``shard`` (+        :mod:`lowmem_jax.sharding`        the step's layouts over a device mesh
``devices``)                                          (:meth:`mesh`, ``make_train_step``)
``input_dtype``     the data pipeline and the model   the batch's stored images: ``uint8`` raw
                                                      pixels, normalised inside the step
                                                      (:func:`lowmem_jax.workloads.build`)
==================  ================================  =============================================

A technique module never imports this one or another technique; the plan names them and
:func:`lowmem_jax.make_train_step` (step-side), :meth:`Plan.configure_model` (model-side) and
:meth:`Plan.wrap_optimizer` (optimizer-side) compose them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from flax import nnx

from lowmem_jax import factorization as factorization_lib
from lowmem_jax import loss_scale as loss_scale_lib
from lowmem_jax import optimizer_state as optimizer_state_lib
from lowmem_jax import precision as precision_lib
from lowmem_jax import scanned_blocks
from lowmem_jax import sharding as sharding_lib
from lowmem_jax import sparsity as sparsity_lib
from lowmem_jax.base import Optimizer, PyTree, as_optimizer
from lowmem_jax.remat import ModuleT
from lowmem_jax.techniques import TECHNIQUES
from lowmem_jax.techniques.input_dtype import INPUT_DTYPES

__all__ = ["Plan", "INPUT_DTYPES"]


def _flag(
    default: Any, help: str, choices: tuple[str, ...] | None = None, omit_default: bool = False
) -> Any:
    """A technique field that ``lowmem`` exposes as ``--field-name`` (``help``, ``choices``);
    ``omit_default``: :meth:`Plan.to_dict` leaves it out at its default."""
    metadata = {"help": help, "choices": choices, "omit_default": omit_default}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which techniques the train step composes. Validated on construction.

    Attributes:
      precision: a :mod:`lowmem_jax.precision` policy name (``fp32``, ``bf16``, ``fp16``,
        ``mixed_bf16``, ``mixed_fp16``).
      loss_scale: ``"auto"`` (dynamic when computing in float16, else none), ``"none"``,
        ``"static"`` or ``"dynamic"``.
      microbatches: ``k >= 1`` slices per batch, accumulated with ``lax.scan``.
      remat: a :mod:`lowmem_jax.remat` policy name, applied per block by the model (its
        ``remat`` attribute), or, for a model without one, by
        :func:`lowmem_jax.remat.remat_module`.
      remat_blocks: for a model without a ``remat`` attribute: the class names of the
        submodules checkpointed one by one (e.g. ``("Block",)``); ``()``: the whole forward
        under one checkpoint (no peak-memory saving by itself, see ``remat_module``).
      optimizer_state: the stored format of the optimizer's state (a
        :mod:`lowmem_jax.optimizer_state` format): ``auto`` (float32, or bfloat16 when the
        parameters are 16-bit), ``fp32``, ``bf16``, ``int8``, ``int4``. The update's
        arithmetic is float32 whenever the state or the parameters are stored in fewer bits.
      sparsity: a :class:`lowmem_jax.sparsity.SparseConfig` (sparse training, masked or
        compressed storage), or ``None`` for dense training.
      factorize: a :class:`lowmem_jax.factorization.FactorConfig` (CP / Tucker-2 / low-rank
        layers, for a model with a ``factorize`` field: the bundled ones), or ``None``.
      shard: a :mod:`lowmem_jax.sharding` stage (``none``, ``dp``, ``zero1``, ``zero2``,
        ``zero3``): the step runs over a data-parallel mesh with that much of the state
        partitioned; the batch size must divide by the devices (times ``microbatches``).
      devices: the mesh's device count for ``shard`` (``0``: every device JAX sees).
      optimizer_memory: the memory the optimizer state stays in between steps (a
        :data:`lowmem_jax.sharding.MEMORY_KINDS` name): ``device``, or ``pinned_host`` (host
        memory; the step moves it to the device for the update and the new state back).
      input_dtype: how the batch's images are stored: ``float32`` (normalised by the data
        pipeline) or ``uint8`` (raw pixels, 4x fewer bytes; the model normalises each
        microbatch inside the step: the bundled WideResNet's ``pixel_mean`` / ``pixel_std``).
        It is a contract between the data and the model: :func:`lowmem_jax.workloads.build`
        and the image tasks honour it (the batch's image leaves uint8, the model given the
        data's statistics); ``make_train_step`` takes the batch it is given.
      initial_loss_scale, loss_scale_period, loss_scale_factor, min_loss_scale: loss-scale
        settings (2**15, 2000, 2, 1 by default).
    """

    precision: str = _flag(
        "fp32",
        "dtype policy: fp32; bf16/fp16 (params and compute half); mixed_bf16/mixed_fp16 (fp32 "
        "master weights, half compute)",
        choices=tuple(sorted(precision_lib.POLICIES)),
    )
    loss_scale: str = _flag(
        "auto",
        "loss scaling; auto = dynamic when computing in float16, else none. Non-finite gradients "
        "skip the whole update",
        choices=("auto", *loss_scale_lib.LOSS_SCALES),
    )
    microbatches: int = _flag(
        1,
        "split each batch into K microbatches and accumulate gradients with lax.scan (BatchNorm "
        "uses per-microbatch statistics)",
    )
    remat: str = _flag(
        "none",
        "rematerialization policy per block: none, full (save block inputs), dots (save "
        "conv/matmul outputs), save:NAME[,NAME] (save tagged activations, e.g. save:conv_out), "
        "offload:NAME[,NAME] (keep them in host memory instead), every:K (checkpoint segments "
        "of K blocks), sqrt, blocks:P*K,... (one of none/dots/full per block, in the order the "
        "model runs them, e.g. blocks:full*4,dots*8; what lowmem plan chooses)",
    )
    optimizer_state: str = _flag(
        "auto",
        "stored format of the optimizer state: auto (fp32; bf16 when the parameters are 16-bit), "
        "fp32, bf16, int8 (block-wise dynamic quantization, Dettmers et al. 2022), int4 (Li et "
        "al. 2023); leaves under 4096 elements stay fp32. Updates are computed in fp32",
        choices=optimizer_state_lib.FORMATS,
    )
    shard: str = _flag(
        "none",
        "partition over a data-parallel mesh: dp (batch), zero1 (+ optimizer state), zero2 (+ "
        "gradients), zero3 (+ parameters); figures are per device",
        choices=sharding_lib.STAGES,
    )
    devices: int = _flag(0, "devices in the mesh for --shard (0: all visible)")
    optimizer_memory: str = _flag(
        "device",
        "where the optimizer state lives between steps: device, or pinned_host (host memory, "
        "moved to the device for the update and back, as ZeRO-Offload places it; XLA:CPU has "
        "one memory, so the device bytes it saves show on a GPU only)",
        choices=sharding_lib.MEMORY_KINDS,
    )
    input_dtype: str = _flag(
        "float32",
        "how batches store images: float32 (normalised by the data pipeline) or uint8 (raw "
        "pixels, 4x smaller; the model normalises each microbatch inside the step)",
        choices=INPUT_DTYPES,
        omit_default=True,
    )
    remat_blocks: tuple[str, ...] = dataclasses.field(default=(), metadata={"omit_default": True})
    sparsity: sparsity_lib.SparseConfig | None = None
    factorize: factorization_lib.FactorConfig | None = None
    initial_loss_scale: float = 2.0**15
    loss_scale_period: int = 2000
    loss_scale_factor: float = 2.0
    min_loss_scale: float = 1.0

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
        policy per block or :func:`lowmem_jax.remat.remat_module`, ``factorize``, zero3's
        per-block parameter gathering; see :mod:`lowmem_jax.techniques`).

        Then a Linen model whose ``conv_impl`` is ``"auto"`` gets ``"xla"`` when the step has no
        loop (one microbatch, every stack unrolled:
        :func:`lowmem_jax.scanned_blocks.straight_line`): the loop-friendly convolution is for
        XLA:CPU's loop bodies; in a step with no loop XLA's own keeps fewer buffers.

        Raises:
          ValueError: ``remat_blocks`` for a model that has its own ``remat`` attribute, a
            segmenting policy for a model without one, or ``factorize`` for a model without a
            ``factorize`` field.
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
        ``wrap_optimizer`` hook in order (a 16- or 32-bit state format around ``tx``, sparse
        training around that, an ``int8`` / ``int4`` state around everything; float32
        arithmetic whenever the state or the parameters are stored in fewer bits).

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

    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]:
        """The fields ``lowmem`` exposes as flags (those declared with a help text)."""
        return [f for f in dataclasses.fields(cls) if "help" in f.metadata]

    def mesh(self) -> sharding_lib.Mesh | None:
        """The device mesh the step's layouts refer to: ``shard``'s data-parallel mesh over
        ``devices`` (:func:`lowmem_jax.sharding.data_mesh`); with ``shard="none"``, one device
        when ``optimizer_memory`` needs a sharding to name its memory, else ``None``."""
        if self.shard != "none":
            return sharding_lib.data_mesh(self.devices)
        if self.optimizer_memory != "device":
            return sharding_lib.data_mesh(1)
        return None

    def compiler_options(self) -> dict[str, str]:
        """XLA options the jitted step needs for this plan: every registered technique's
        (e.g. :func:`lowmem_jax.remat.compiler_options`)."""
        options: dict[str, str] = {}
        for technique in TECHNIQUES:
            if technique.compiler_options is not None:
                options.update(technique.compiler_options(self))
        return options

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description: every field, ``loss_scale`` resolved; a field declared
        ``omit_default`` only when set; a config (a value with ``describe()``, e.g.
        :meth:`SparseConfig.describe`) as its description, last, and left out when unset."""
        out, configs = {}, {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("omit_default") and value == f.default:
                continue  # as every earlier record has it
            if value is None or hasattr(value, "describe"):
                if value is not None:
                    configs[f.name] = value.describe()
                continue
            out[f.name] = value
        out["loss_scale"] = self.loss_scale_kind
        return {**out, **configs}
