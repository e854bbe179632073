"""Command line: `python -m ropewkv parity [--device DEV]`."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropewkv")
    commands = parser.add_subparsers(dest="command", required=True)
    parity = commands.add_parser("parity", help="error of every op and backend against the fp64 reference")
    parity.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args(argv)
    if args.command == "parity":
        from . import parity as parity_module

        return parity_module.main(args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
