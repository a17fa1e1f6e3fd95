"""The `deltatrain` console script.

The whole project's build (`make build`) installs the C++ command line into the package as bin/deltatrain,
and this script becomes it. The Python package alone (`pip install .`, a wheel) has no command line beyond
`--version` and `--help`, which say what this installation is and how to get the rest.
"""

import difflib
import os
import sys
from pathlib import Path

_NATIVE_CLI = Path(__file__).resolve().parent / "bin" / "deltatrain"
# tools/main.cpp's top-level subcommands (tests/python/test_cli.py reads them from the C++ sources and compares).
_SUBCOMMANDS = "info, bench, model, train, generate, rl, optim, ckpt"


def _version():
    from . import __version__

    return __version__


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if _NATIVE_CLI.is_file():
        os.execv(_NATIVE_CLI, [str(_NATIVE_CLI), *args])
    if args in (["--version"], ["-V"]):
        print(f"deltatrain {_version()}")
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(f"deltatrain {_version()}: the Python package (import deltatrain; deltatrain.torch is the PyTorch "
              f"drop-in).\nThe command line's subcommands ({_SUBCOMMANDS}) come with the whole project's "
              "build: `make build` in a source checkout installs them here.\n\nOptions:\n"
              "  --version  print the version\n  -h, --help  print this help")
        return 0
    if args[0].startswith("-"):
        close = difflib.get_close_matches(args[0], ["--version", "--help"], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else " (options: --version, -h/--help)"
        print(f"deltatrain: unknown option '{args[0]}'{hint}", file=sys.stderr)
        return 2
    print(f"deltatrain: '{args[0]}' needs the C++ command line, which this installation (the Python package "
          f"alone) does not include; `make build` in a source checkout installs it (subcommands: {_SUBCOMMANDS})",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
