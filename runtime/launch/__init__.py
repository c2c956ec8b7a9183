"""Starting a run: one process per plan device (or under torchrun), which devices they use and whether
the plan fits them, and processes that leave nothing behind."""
