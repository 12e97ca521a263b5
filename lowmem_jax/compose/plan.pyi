# Generated from the techniques' fields by lowmem_jax.compose.plan.stub(): do not edit;
# lowmem_jax.compose.plan.write_stub() writes it again (tests/test_plan.py checks it).
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import optax

from lowmem_jax.blocks.policy import RematSpec
from lowmem_jax.core.base import Optimizer, PyTree
from lowmem_jax.techniques import loss_scale, precision
from lowmem_jax.techniques.factorize.config import FactorConfig
from lowmem_jax.techniques.sparsity.config import SparseConfig

__all__ = ["Plan"]

ModuleT = TypeVar("ModuleT")

class Plan:
    """Which techniques the train step composes: one field per setting, each declared by the
    technique that owns it (:data:`lowmem_jax.techniques.TECHNIQUES`, in their order; see
    :mod:`lowmem_jax.core.technique`). A frozen dataclass, keyword arguments only, validated on
    construction (a bad value raises ``ValueError`` naming the field and the allowed values)."""

    factorize: FactorConfig | None
    precision: str
    param_rounding: str
    loss_scale: str
    initial_loss_scale: float
    loss_scale_period: int
    loss_scale_factor: float
    min_loss_scale: float
    microbatches: int
    remat: RematSpec
    remat_blocks: tuple
    loss_chunk: int
    activations: str
    sparsity: SparseConfig | None
    second_moment: str
    optimizer_state: str
    optimizer_state_rounding: str
    pipeline: int
    pipeline_rest: str
    pipeline_microbatches: int
    shard: str
    devices: int
    optimizer_memory: str
    optimizer_update: str
    grad_compression: str
    powersgd_rank: int
    topk_fraction: float
    weight_memory: str
    streamed_layers: str
    input_dtype: str

    def __init__(
        self,
        *,
        factorize: FactorConfig | None = None,
        precision: str = "fp32",
        param_rounding: str = "nearest",
        loss_scale: str = "auto",
        initial_loss_scale: float = 32768.0,
        loss_scale_period: int = 2000,
        loss_scale_factor: float = 2.0,
        min_loss_scale: float = 1.0,
        microbatches: int = 1,
        remat: RematSpec = "none",
        remat_blocks: tuple = (),
        loss_chunk: int = 0,
        activations: str = "none",
        sparsity: SparseConfig | None = None,
        second_moment: str = "none",
        optimizer_state: str = "auto",
        optimizer_state_rounding: str = "nearest",
        pipeline: int = 1,
        pipeline_rest: str = "replicate",
        pipeline_microbatches: int = 0,
        shard: str = "none",
        devices: int = 0,
        optimizer_memory: str = "device",
        optimizer_update: str = "device",
        grad_compression: str = "none",
        powersgd_rank: int = 4,
        topk_fraction: float = 0.01,
        weight_memory: str = "device",
        streamed_layers: str = "all",
        input_dtype: str = "float32",
    ) -> None: ...
    @property
    def policy(self) -> precision.Policy: ...
    @property
    def loss_scale_kind(self) -> str: ...
    def make_loss_scale(self) -> loss_scale.LossScale: ...
    def configure_model(self, model: ModuleT) -> ModuleT: ...
    def wrap_optimizer(
        self,
        tx: optax.GradientTransformation,
        params: PyTree | None = None,
    ) -> Optimizer: ...
    def check_optimizer(
        self,
        tx: optax.GradientTransformation | Optimizer,
        params: PyTree,
    ) -> None: ...
    def model_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]: ...
    def bind(self, work: Any, total_steps: int | None = None) -> tuple[Any, Plan]: ...
    @classmethod
    def flag_fields(cls) -> list[dataclasses.Field]: ...
    def mesh(self) -> jax.sharding.Mesh | None: ...
    def state_shardings(self, state: Any) -> Any: ...
    def on_one_device(self) -> Plan: ...
    def compiler_options(self) -> dict[str, str]: ...
    def compile_cost(self) -> float: ...
    def to_dict(self) -> dict[str, Any]: ...
