"""One rank's training step and what it updates: the 1F1B and layer-by-layer schedules, gradient sync
across replicas, (sharded) AdamW with mixed precision, optimisation settings, checkpoints."""
