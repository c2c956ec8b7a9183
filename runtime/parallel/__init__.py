"""How a model is cut across ranks: uneven tensor-parallel layers and their communication, the
vocabulary-parallel embedding and head, each rank's slices and stage, and the plan's devices as ranks."""
