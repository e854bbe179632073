"""Command line: `python -m ropewkv parity [--device DEV]` and `python -m ropewkv demo [--device DEV] [--quick]
[--out DIR]`."""
import argparse
import sys


def device(name: str):
    """--device: a cpu or cuda device that torch can reach, refused here with the reason rather than by a traceback
    after the demo has printed a backend for it."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as error:  # argparse reports only ValueError / TypeError / ArgumentTypeError
        raise argparse.ArgumentTypeError(str(error)) from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name!r}: ropewkv runs on cpu or cuda devices")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{name!r}: torch {torch.__version__} (torch.version.cuda="
                                         f"{torch.version.cuda}) sees {torch.cuda.device_count()} CUDA device(s)")
    return name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropewkv")
    commands = parser.add_subparsers(dest="command", required=True)
    parity = commands.add_parser("parity", help="error of every op and backend against the fp64 reference")
    parity.add_argument("--device", type=device, default=None, help="cpu or cuda (default: cuda if available)")
    demo = commands.add_parser("demo", help="swap the kernels into small Llama and RWKV-7 models: parity, speed, "
                                            "RoPE precision; writes demo-report.md")
    demo.add_argument("--device", type=device, default=None, help="cpu or cuda (default: cuda if available)")
    demo.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    demo.add_argument("--out", default=None, help="directory for demo-report.md and the plot (default: cwd)")
    args = parser.parse_args(argv)
    if args.command == "parity":
        from . import parity as parity_module

        return parity_module.main(args.device)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.main(args.device, args.quick, args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
