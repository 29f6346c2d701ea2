"""The ``kvpool`` command installed with the package (``kvpool serve``, ``kvpool bench``,
``kvpool config``, ...): the same Rust command line as the ``kvpool`` binary, run in this
process by the native module, so ``pip install`` gives the node's pool daemon too."""

import sys


def main() -> None:
    """Entry point of the ``kvpool`` console script."""
    from kvpool import _native

    sys.exit(_native.run_command_line(sys.argv))


if __name__ == "__main__":
    main()
