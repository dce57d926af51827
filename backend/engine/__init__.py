"""The engine: its API and loop, input and output processing, request records, metrics."""
