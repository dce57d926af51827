"""Who a command-line client speaks for: --api-key (a tenants file) or --tenant (development mode)."""

from __future__ import annotations

import argparse
import os


def add_identity_arguments(ap: argparse.ArgumentParser) -> None:
    """The --api-key (default $LORAPLEX_API_KEY) and --tenant flags."""
    ap.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY"),
                    help="sent as the x-api-key header (default: $LORAPLEX_API_KEY); needed when the server has a "
                         "tenants file")
    ap.add_argument("--tenant", default=None, help="sent as the x-tenant-id header (development mode, no tenants file)")


def identity_headers(api_key: str | None, tenant: str | None) -> dict | None:
    """The identity headers: x-api-key (tenants file), x-tenant-id (development mode); None if neither."""
    return {k: v for k, v in (("x-api-key", api_key), ("x-tenant-id", tenant)) if v} or None
