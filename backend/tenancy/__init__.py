"""Tenants: identity from API keys, quotas, the queue share."""
