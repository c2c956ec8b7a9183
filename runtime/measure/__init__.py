"""What the runtime measures: operator tables and link fits for the cost model, meters inside a step,
per-step metrics, traces, and the measured-against-predicted report."""
