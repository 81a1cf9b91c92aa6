"""Placeholder entry point until the gateway lands (issue 12)."""

import sys


def main() -> None:
    sys.exit("skiff-gateway: not built yet")
