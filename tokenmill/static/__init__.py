"""Files the package serves (the metrics port's dashboard)."""
