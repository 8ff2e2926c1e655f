"""Persist sinks: make an output durable, data and upper in one atomic step."""
