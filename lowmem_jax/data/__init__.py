"""Datasets. Nothing here downloads: the digits data ships with scikit-learn."""

from lowmem_jax.data.digits import iterate_batches, load_digits

__all__ = ["load_digits", "iterate_batches"]
