"""One process of the two-process data-parallel test (tests/test_sharding.py).

``python tests/dp_worker.py COORDINATOR PROCESS_ID NUM_PROCESSES STAGE OUT.npz``: joins the
run with ``jax.distributed.initialize`` (CPU collectives over localhost), trains
:class:`Net` for :data:`STEPS` steps under ``Plan(shard=STAGE)`` on the global mesh, each
process feeding its own rows of every batch, and process 0 writes the final parameters.
The test runs the same steps in one process and compares.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import numpy as np
import optax

STEPS = 3
BATCH = 16


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(x)


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


def main(coordinator: str, process_id: int, num_processes: int, stage: str, out: str) -> None:
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    import lowmem_jax as lm
    from lowmem_jax import sharding

    plan = lm.Plan(shard=stage)  # the global mesh: one device per process
    mesh = plan.mesh()
    params = initial_variables()["params"]
    shapes = jax.eval_shape(lambda: lm.TrainState.create(params=params, tx=tx(), plan=plan))
    state = jax.jit(
        lambda: lm.TrainState.create(params=params, tx=tx(), plan=plan),
        out_shardings=lm.techniques.shard.state_shardings(shapes, plan),
    )()
    step = lm.make_train_step(lm.classifier_loss_fn(Net()), tx(), plan)
    rows = BATCH // num_processes
    for batch in batches():
        local = {k: v[process_id * rows : (process_id + 1) * rows] for k, v in batch.items()}
        global_batch = {
            k: jax.make_array_from_process_local_data(
                NamedSharding(mesh, sharding.batch_spec(v)), v
            )
            for k, v in local.items()
        }
        state, _ = step(state, global_batch)
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if process_id == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in
                jax.tree_util.tree_leaves_with_path(params)}  # fmt: skip
        np.savez(out, **flat)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
