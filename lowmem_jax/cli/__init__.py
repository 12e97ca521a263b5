"""The ``lowmem`` command line, a module per command, each thin: flags -> a plan or a config ->
one library call (:mod:`.main` dispatches)."""

from lowmem_jax.cli.dispatch import build_parser, main

__all__ = ["main", "build_parser"]
