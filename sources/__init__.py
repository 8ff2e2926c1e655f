"""Source connectors: readers that emit data in their native time (FromTime)."""
