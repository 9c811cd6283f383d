"""Reading result files into comparisons, reports, plots, tables and the published layout (never runs engines)."""
