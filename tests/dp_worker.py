"""One process of the two-process tests (tests/sharding_cases.py).

``python tests/dp_worker.py COORDINATOR PROCESS_ID NUM_PROCESSES OUT.npz``: joins the run with
``jax.distributed.initialize`` (CPU collectives over localhost) and trains :class:`Net` for
:data:`STEPS` steps under each plan of :data:`PLANS` on the global mesh (one device per
process): ZeRO-3, each process feeding its own rows of every batch, and a pipeline of one stage
per process, each feeding the whole batch. Process 0 writes the final parameters, keyed
``<plan>/<path>``. The test runs the same steps in one process and compares.
"""

from __future__ import annotations

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

STEPS = 3
BATCH = 16


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return x + jnp.tanh(nn.Dense(x.shape[-1])(x))


class Net(nn.Module):
    """Dense, a stack of 2 residual blocks (what a pipeline splits), Dense."""

    @nn.compact
    def __call__(self, x, train=True):
        from lowmem_jax import ScannedBlocks

        x = nn.relu(nn.Dense(16)(x))
        x = ScannedBlocks(Block, 2)(x, train=train)
        return nn.Dense(4)(x)


#: The plans each process trains under, by name.
PLANS = {"zero3": {"shard": "zero3"}, "pipeline": {"pipeline": 2}}


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(BATCH, 6)).astype(np.float32),
            "label": rng.integers(0, 4, size=BATCH).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def initial_variables():
    return Net().init(jax.random.key(0), np.zeros((2, 6), np.float32), train=False)


def tx():
    return optax.adam(1e-2)


def main(coordinator: str, process_id: int, num_processes: int, out: str) -> None:
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    from jax.experimental import multihost_utils

    import lowmem_jax as lm

    flat = {}
    for name, fields in PLANS.items():
        plan = lm.Plan(**fields)  # the global mesh: one device per process
        create = functools.partial(
            lm.TrainState.create, params=initial_variables()["params"], tx=tx(), plan=plan
        )
        state = jax.jit(create, out_shardings=plan.state_shardings(jax.eval_shape(create)))()
        step = lm.make_train_step(lm.classifier_loss_fn(Net()), tx(), plan)
        batch_sharding = NamedSharding(plan.mesh(), PartitionSpec(lm.core.mesh.AXIS))
        for batch in batches():  # each process reads the rows its devices hold
            state, _ = step(state, {k: jax.make_array_from_callback(v.shape, batch_sharding,
                                                                    lambda i, v=v: v[i])
                                    for k, v in batch.items()})  # fmt: skip
        params = multihost_utils.process_allgather(state.params, tiled=True)
        flat.update({f"{name}/{jax.tree_util.keystr(p)}": np.asarray(x)
                     for p, x in jax.tree_util.tree_leaves_with_path(params)})  # fmt: skip
    if process_id == 0:
        np.savez(out, **flat)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
