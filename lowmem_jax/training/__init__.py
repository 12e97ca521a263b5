"""The training loop, its per-run configuration and tasks, checkpoints and metrics."""
