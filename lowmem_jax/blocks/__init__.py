"""Stacks of blocks and the layers a technique reaches per block:
:class:`~lowmem_jax.blocks.discovery.scanned.ScannedBlocks`, block discovery, remat policies and
checkpointed calls, lazily read layers. Imports no technique.
"""
