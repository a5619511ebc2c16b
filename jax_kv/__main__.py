"""python -m jax_kv {generate, demo}."""

from jax_kv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
