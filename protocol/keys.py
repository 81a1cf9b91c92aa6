"""``skiff-keys DIR NAME``: a CURVE key pair as pyzmq certificate files.

Writes ``DIR/NAME.key`` (the public certificate: copy it into a server's
``--curve-authorized`` directory, or hand it to clients as their
``--curve-server-key``) and ``DIR/NAME.key_secret`` (both keys, mode 0600:
the ``--curve-secret-key`` / ``--curve-key`` of the process it names).
The format is ``zmq.auth.create_certificates``', so keys made by other
ZeroMQ tools in that format work too. An existing pair is never
overwritten: replacing a key is a deliberate act (delete it first).

Key roles are in docs/security.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import zmq.auth

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def create(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Make ``NAME.key`` and ``NAME.key_secret`` in ``directory`` (created if
    missing); returns their paths. Raises ``FileExistsError`` rather than
    overwrite, ``ValueError`` for a name that is not a plain file name."""
    if not _NAME.fullmatch(name) or name.endswith((".key", ".key_secret")):
        raise ValueError(f"{name!r}: use letters, digits, '_', '.', '-' (no suffix, no '/')")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it first to replace the key pair")
    # The secret is never readable by others, not even between its creation and a chmod.
    old = os.umask(0o077)
    try:
        made_public, made_secret = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(made_secret, 0o600)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skiff-keys",
        description="Make a ZeroMQ CURVE key pair (pyzmq certificate files) for skiff: "
        "NAME.key (public) and NAME.key_secret (secret, mode 0600). Never overwrites.",
    )
    parser.add_argument("directory", help="where to write the files (created if missing)")
    parser.add_argument("name", help="the key pair's name, e.g. worker, gateway, client-alice")
    ns = parser.parse_args(argv)
    try:
        public, secret = create(ns.directory, ns.name)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"skiff-keys: {exc}\n")
        return 1
    sys.stdout.write(f"public: {public}\nsecret: {secret}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
