"""Plan(input_dtype="uint8"): raw pixels in the batch, normalised by the model inside the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowmem_jax as lm
from lowmem_jax import models, workloads
from lowmem_jax.data import cifar10, load_digits


def test_uint8_images_give_the_logits_of_host_normalised_ones():
    model = models.WideResNet(depth=10, width=1, **workloads.CIFAR10_PIXEL_STATS)
    pixels = np.random.default_rng(0).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    variables = model.init(jax.random.PRNGKey(0), pixels, train=False)
    raw = model.apply(variables, jnp.asarray(pixels), train=False)
    normalised = model.apply(variables, jnp.asarray(cifar10.normalize(pixels)), train=False)
    np.testing.assert_allclose(raw, normalised, rtol=1e-5, atol=1e-5)


def test_integer_images_without_statistics_are_refused():
    model = models.WideResNet(depth=10, width=1)
    with pytest.raises(ValueError, match="need pixel_mean and pixel_std"):
        model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3), jnp.uint8), train=False)
    with pytest.raises(ValueError, match="pixel_mean and pixel_std go together"):
        models.WideResNet(depth=10, width=1, pixel_mean=(1.0,))
    with pytest.raises(ValueError, match="input_dtype"):
        lm.Plan(input_dtype="int8")


def test_uint8_batch_shrinks_the_steps_arguments_by_three_bytes_per_pixel():
    work = workloads.workload("wrn-10-1", batch_size=8)
    plan = lm.Plan(microbatches=2, remat="full")
    flt = workloads.build(work, plan).analyze()
    raw = workloads.build(work, lm.Plan(microbatches=2, remat="full", input_dtype="uint8"))
    assert raw.workload.batch["image"].dtype == jnp.uint8
    raw = raw.analyze()
    pixels = 8 * 32 * 32 * 3
    assert flt.xla["argument_bytes"] - raw.xla["argument_bytes"] == 3 * pixels
    assert flt.analytic["input_bytes"] - raw.analytic["input_bytes"] == 3 * pixels
    assert raw.config["input_dtype"] == "uint8" and "input_dtype" not in flt.config
    with pytest.raises(ValueError, match="applies to image batches"):
        tokens = workloads.workload("dynamicconv-small", 4, seq_len=8)
        workloads.build(tokens, lm.Plan(input_dtype="uint8"))


def test_training_on_uint8_digits_follows_the_float_run():
    flt = load_digits(seed=1, image_size=8)
    raw = load_digits(seed=1, image_size=8, input_dtype="uint8")
    stats = {k: raw[k] for k in ("pixel_mean", "pixel_std")}
    out = []
    for data, plan in ((flt, lm.Plan()), (raw, lm.Plan(input_dtype="uint8"))):
        batch = {k: v[:32] for k, v in data["train"].items()}
        work = workloads.workload("wrn-10-1", **stats).with_batch(batch)
        setup = workloads.build(work, plan)
        state = setup.init_state(batch)
        for _ in range(2):
            state, metrics = setup.step(state, batch)
        out.append((state.params, metrics["loss"]))
    (p_flt, loss_flt), (p_raw, loss_raw) = out
    np.testing.assert_allclose(loss_raw, loss_flt, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_raw, p_flt)


def test_digits_uint8_pixels_normalise_to_the_float_images():
    flt = load_digits(seed=2, image_size=16)
    raw = load_digits(seed=2, image_size=16, input_dtype="uint8")
    assert raw["train"]["image"].dtype == np.uint8 and raw["train"]["image"].max() == 16
    x = (raw["test"]["image"].astype(np.float32) - raw["pixel_mean"][0]) / raw["pixel_std"][0]
    np.testing.assert_allclose(x, flt["test"]["image"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(raw["test"]["label"], flt["test"]["label"])


def test_digits_folds_partition_the_data_stratified():
    from sklearn.datasets import load_digits as sk_load_digits

    every = sk_load_digits()
    n = 1797
    labels, tests = [], []
    for fold in range(5):
        split = load_digits(seed=3, image_size=8, input_dtype="uint8", fold=fold)
        assert len(split["train"]["label"]) + len(split["test"]["label"]) == n
        tests.append(split["test"]["image"].reshape(len(split["test"]["label"]), -1))
        labels.append(split["test"]["label"])
        counts = np.bincount(split["test"]["label"], minlength=10)
        per_class = np.bincount(every.target, minlength=10) / 5  # stratified: floor or ceil
        assert np.all((counts >= np.floor(per_class)) & (counts <= np.ceil(per_class)))
    got = np.concatenate(tests)  # every image once, over the folds
    order = np.lexsort(got.T)
    want = every.images.reshape(n, -1).astype(np.uint8)
    np.testing.assert_array_equal(got[order], want[np.lexsort(want.T)])
    np.testing.assert_array_equal(np.sort(np.concatenate(labels)), np.sort(every.target))
    other = load_digits(seed=4, image_size=8, input_dtype="uint8", fold=0)["test"]["label"]
    assert not np.array_equal(other, labels[0])  # the seed shuffles the folds
    with pytest.raises(ValueError, match="fold must be in"):
        load_digits(fold=5)
