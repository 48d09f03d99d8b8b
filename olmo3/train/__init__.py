"""Training: optimizer, train step, loop, checkpoints, metrics."""
