"""python -m jax_kv demo: the command-line entry point."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_kv")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="prefill + decode through one attention layer, "
        "both layouts, and print their agreement",
    )
    demo.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "demo":
        import jax

        from jax_kv import demo as demo_mod

        print(f"jax {jax.__version__} on {jax.default_backend()}")
        demo_mod.run(steps=args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
