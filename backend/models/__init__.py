"""Loraplex."""
