"""The plan and the one jitted train step: :class:`~lowmem_jax.compose.plan.Plan`, :mod:`.step`, the
plan's command-line flags.
"""
