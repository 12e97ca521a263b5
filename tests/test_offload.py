"""Host offload of the optimizer state (Plan.optimizer_memory="pinned_host").

XLA:CPU has one physical memory, so these tests check placement and arithmetic (the step
computes what the on-device step computes; the state stays in host memory between steps,
through donation and checkpoints), not a saving: that is measured on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BNNet, assert_trees_close, classification_batch, load_benchmark, to_numpy

import lowmem_jax as lm
from lowmem_jax import workloads
from lowmem_jax.analysis import memory
from lowmem_jax.cli import dispatch as cli
from lowmem_jax.training import checkpointing


def _memory_kinds(tree):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _states(plan, tx, batches, donate):
    model = BNNet()
    variables = model.init(jax.random.key(0), batches[0]["image"], train=False)
    params = variables["params"]
    wrapped = plan.wrap_optimizer(tx, params)
    state = lm.TrainState.create(
        params=params, model_state={"batch_stats": variables["batch_stats"]}, tx=wrapped, plan=plan
    )
    shardings = lm.techniques.shard.state_shardings(state, plan)
    if shardings is not None:
        state = jax.device_put(state, shardings)
    step = lm.make_train_step(
        lm.classifier_loss_fn(plan.configure_model(model)), wrapped, plan, donate=donate
    )
    out = []
    for batch in batches:
        state, _ = step(state, batch)
        out.append((_memory_kinds(state.opt_state), _memory_kinds(state.params), to_numpy(state)))
    return out


@pytest.mark.parametrize("optimizer_state", ["auto", "int8"])
def test_host_resident_optimizer_state_computes_what_the_device_one_does(optimizer_state):
    batches = [classification_batch(16, seed=s) for s in range(3)]
    batches[1] = {**batches[1], "image": batches[1]["image"].at[0, 0].set(np.nan)}  # skipped
    tx = optax.adam(1e-2)
    host = lm.Plan(optimizer_memory="pinned_host", optimizer_state=optimizer_state)
    got = _states(host, tx, batches, donate=True)  # donated: the host buffers are reused
    want = _states(lm.Plan(optimizer_state=optimizer_state), tx, batches, donate=False)
    for (opt_kinds, param_kinds, g), (_, _, w) in zip(got, want, strict=True):
        assert opt_kinds == {"pinned_host"} and param_kinds == {"device"}
        # Two programs (moves and a barrier around the update): the same values to float32
        # rounding, which another CPU's fusion may order differently.
        assert_trees_close(g.replace(opt_state=g.opt_state.inner_state), w, rtol=1e-6, atol=1e-7)
    assert got[1][2].skipped_steps == 1


def test_a_device_update_moves_the_state_to_the_device_only_after_the_gradient():
    """DeviceUpdate (optimizer_memory="pinned_host", the update on the device): the state and
    the gradient pass one optimization barrier before the state is moved to the device, so the
    move cannot be scheduled before the backward pass ends; the new state goes back to host."""
    from lowmem_jax.techniques.shard.offload import DeviceUpdate, HostUpdateState

    tx = DeviceUpdate(lm.core.base.as_optimizer(optax.adam(1e-2)))
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    state = tx.init(params)
    assert isinstance(state, HostUpdateState)
    closed = jax.make_jaxpr(tx.update)(params, state, params)
    grad_vars = closed.jaxpr.invars[:2]
    state_vars = closed.jaxpr.invars[2 : 2 + len(jax.tree.leaves(state))]
    (barrier,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert barrier.invars == [*grad_vars, *state_vars]
    moves = [e for e in closed.jaxpr.eqns if e.primitive.name == "device_put"]
    to_device = [e for e in moves if set(e.params["devices"]) == {jax.memory.Space.Device}]
    # Adam's count and moments: each read on the device only through the barrier's outputs.
    moved = {v for e in to_device for v in e.invars}
    assert moved and moved <= set(barrier.outvars[2:])
    assert any(set(e.params["devices"]) == {jax.memory.Space.Host} for e in moves)


def test_an_update_on_the_host_computes_what_the_device_one_does_where_the_state_lives():
    """optimizer_update="host" (ZeRO-Offload): the gradient goes to host memory and the update
    runs there (the program marks it host compute); the same values as the device update, and
    a step with a non-finite gradient keeps the state, decided on the host."""
    batches = [classification_batch(16, seed=s) for s in range(3)]
    batches[1] = {**batches[1], "image": batches[1]["image"].at[0, 0].set(np.nan)}  # skipped
    tx = optax.adam(1e-2)
    host = lm.Plan(optimizer_memory="pinned_host", optimizer_update="host")
    got = _states(host, tx, batches, donate=True)
    want = _states(lm.Plan(), tx, batches, donate=False)
    for (opt_kinds, param_kinds, g), (_, _, w) in zip(got, want, strict=True):
        assert opt_kinds == {"pinned_host"} and param_kinds == {"device"}
        # Two programs (the update compiled for the host, or fused into the step): float32
        # rounding may differ on another CPU, so the promise is the same values to tolerance.
        assert_trees_close(g.opt_state.inner_state, w.opt_state, rtol=1e-6, atol=1e-7)
        assert_trees_close((g.params, g.model_state), (w.params, w.model_state),
                           rtol=1e-6, atol=1e-7)  # fmt: skip
    assert got[1][2].skipped_steps == 1
    assert_trees_close(got[1][2].opt_state, got[0][2].opt_state, rtol=0, atol=0)  # kept
    setup = workloads.build(workloads.workload("wrn-10-1", batch_size=8, image_size=8), host)
    text = setup.step.lower(setup.abstract_state(), setup.abstract_batch()).as_text()
    assert '_xla_compute_type = "host"' in text
    (verdict,) = [v for v in setup.verdicts() if v.technique == "shard"]
    assert verdict.took_effect and "its update computed there (1 host computation" in (
        verdict.evidence
    )


def test_plan_names_the_memory_and_the_mesh_it_needs():
    with pytest.raises(ValueError, match=r"optimizer_memory='disk'; allowed values: \['device'"):
        lm.Plan(optimizer_memory="disk")
    assert lm.Plan().mesh() is None
    assert lm.Plan(optimizer_memory="pinned_host").mesh().size == 1  # a sharding names memory
    with pytest.raises(ValueError, match=r"Unknown optimizer_update='gpu'; allowed values"):
        lm.Plan(optimizer_update="gpu")
    with pytest.raises(ValueError, match=r"optimizer_update='host' .* needs "
                       r"optimizer_memory='pinned_host' .*\(got 'device', 'none'\)"):  # fmt: skip
        lm.Plan(optimizer_update="host")


def test_analyze_counts_the_host_resident_bytes_and_says_where_they_are(capsys):
    work = workloads.workload("wrn-10-1", batch_size=8, image_size=8)
    device = workloads.build(work, lm.Plan()).analyze()
    host = workloads.build(work, lm.Plan(optimizer_memory="pinned_host")).analyze()
    opt_bytes = sum(
        v for k, v in host.analytic["optimizer_breakdown"].items() if k.startswith("slot:")
    )
    assert host.analytic["host_resident_bytes"] == opt_bytes > 0
    assert device.analytic["host_resident_bytes"] == 0
    # XLA:CPU, one memory: the same program bytes (up to the schedule of the unrolled blocks,
    # which the host placement moves by a few hundred bytes), and a note that says so.
    assert host.xla["total_bytes"] == pytest.approx(device.xla["total_bytes"], rel=1e-3)
    assert any("XLA:CPU keeps one memory space" in n for n in host.notes)
    assert host.config["optimizer_memory"] == "pinned_host"
    assert not any(n.startswith("xla: per device") for n in host.notes)  # one device, no shard
    argv = ["analyze", "--model", "wrn-10-1", "--batch-size", "8"]
    assert cli.main([*argv, "--optimizer-memory", "pinned_host"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("host:")]
    assert line == [
        f"       host: {opt_bytes / 2**20:.2f} MiB of the state kept in host memory (analytic); "
        "XLA:CPU host argument 0.00 MiB, temp 0.00 (one memory space: counted in the device "
        "figures above)"
    ]


def test_a_checkpoint_restores_into_host_memory(tmp_path):
    plan = lm.Plan(optimizer_memory="pinned_host")
    setup = workloads.build(workloads.workload("wrn-10-1", batch_size=8, image_size=8), plan)
    batch = setup.example_batch()
    state, _ = setup.step(setup.init_state(batch), batch)
    saved = to_numpy(state)
    ckpt = checkpointing.Checkpointer(str(tmp_path), every=1, keep=1)
    ckpt.save(1, state)
    restored = ckpt.restore(setup.abstract_state())
    ckpt.close()
    assert _memory_kinds(restored.opt_state) == {"pinned_host"}
    assert_trees_close(to_numpy(restored), saved, rtol=0, atol=0)
    state, _ = setup.step(restored, batch)  # and the step takes it as it is
    assert np.isfinite(float(jax.tree.leaves(state.params)[0].sum()))
    assert memory.host_resident_bytes(state) == memory.host_resident_bytes(restored) > 0


def test_on_host_is_one_host_computation_whose_results_are_in_host_memory():
    """host_update.on_host: JAX's host compute as a function transform (``compute_on2`` in JAX
    0.10, renamed ``compute_on`` in 0.11, whose 0.10 context-manager form is gone); the
    primitive itself places every result in host memory."""
    from lowmem_jax.techniques.shard.offload import on_host

    fn = on_host(jax.jit(lambda x, y: (x * 2, {"y": y + 1})))
    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3), jnp.ones(2))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "compute_on"]
    assert eqn.params["compute_type"] == "device_host"
    assert eqn.params["out_memory_spaces"] == (jax.memory.Space.Host,) * 2
    got = fn(jnp.ones(3), jnp.ones(2))
    np.testing.assert_array_equal(got[0], 2 * np.ones(3))
    np.testing.assert_array_equal(got[1]["y"], 2 * np.ones(2))


def test_the_weight_streaming_probe_trains_the_same_wherever_the_weights_live():
    """benchmarks/weight_streaming.py: the stack and Adam's moments in host memory, each block
    moved to the device inside the scan (its gradient moved back), the update on the host: the
    same losses as the device-resident step, and the state comes back in host memory."""
    probe = load_benchmark("weight_streaming")
    rows = {c: probe.measure(c, blocks=3, width=16, batch=4, steps=3) for c in probe.CONFIGS}
    assert rows["device"]["output_memory_kinds"] == ["device"]
    assert rows["stream"]["output_memory_kinds"] == ["pinned_host"]
    for row in rows.values():
        np.testing.assert_allclose(row["losses"], rows["device"]["losses"], rtol=1e-6)
    assert rows["device"]["losses"][-1] != rows["device"]["losses"][0]  # it trained


def test_a_quantized_state_updated_on_the_host_is_refused_in_one_line():
    """Quantizing on the host mixes host memory with device constants (the code book's
    gather, the block scales' indices), which JAX refuses while tracing: the plan says so at
    construction, naming what runs instead."""
    for fmt in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"optimizer_state='{fmt}' runs with") as raised:
            lm.Plan(optimizer_state=fmt, optimizer_memory="pinned_host", optimizer_update="host")
        assert "optimizer_update='device'" in str(raised.value)
        assert "\n" not in str(raised.value)
    lm.Plan(optimizer_state="int8", optimizer_memory="pinned_host")  # the update on the device
