"""Stacks of blocks and what a technique reaches per block: :class:`~.scanned.ScannedBlocks`
(identical blocks in a ``lax.scan``, each under its remat policy), the per-block hooks that
techniques hand it (:mod:`.hooks`), remat policies (:mod:`.policy`) and checkpointed calls
(:mod:`.checkpoint`), a model's repeated blocks found (:mod:`.discovery`), layers that read
compressed weights (:mod:`.lazy_layers`). Imports no technique."""

from lowmem_jax.blocks.discovery import (
    AUTO_BLOCKS,
    linen_blocks,
    nnx_blocks,
    no_blocks_warning,
    repeated_blocks,
)

__all__ = ["AUTO_BLOCKS", "repeated_blocks", "linen_blocks", "nnx_blocks", "no_blocks_warning"]
