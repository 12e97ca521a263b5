"""ZeRO-style partitioning and offload (:mod:`lowmem_jax.sharding`): ``shard``, ``devices``,
``optimizer_memory``."""

from lowmem_jax import sharding as sharding_lib
from lowmem_jax.technique import Technique


def _validate(plan) -> None:
    sharding_lib.stage(plan.shard)
    devices = plan.devices
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
        raise ValueError(f"devices must be an int >= 0 (0: all visible), got {devices!r}")
    sharding_lib.check_memory_kind(plan.optimizer_memory, "optimizer_memory")


TECHNIQUE = Technique(
    name="shard",
    fields=("shard", "devices", "optimizer_memory"),
    validate=_validate,
    envelope=None,  # the same step over more devices: no accuracy limit
    axis=None,  # not searched: the planner plans one device
)
