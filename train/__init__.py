"""jflash trainer: configuration, data, training loop, checkpoints, metrics."""
