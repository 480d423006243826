"The base layer: configurations, presets, run directories and the metrics log (no torch)."
