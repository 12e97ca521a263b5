"""``python -m lowmem_jax.cli``: the ``lowmem`` command."""

import sys

from lowmem_jax.cli.dispatch import main

sys.exit(main())
