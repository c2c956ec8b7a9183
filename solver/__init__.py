"""The three-level MILP planner (``baton solve``) and its baselines; see solver/README.md."""
