"""python -m vlmrl.models.tiny [OUT_DIR] [--variant NAME]: build an embedded model (default: into the cache, printing
its path)."""

from __future__ import annotations

import argparse
import logging

from vlmrl.models.tiny.registry import VARIANTS, build, ensure_built


def main() -> None:
    parser = argparse.ArgumentParser(description="Build an embedded tiny model (no hub access).")
    parser.add_argument("out_dir", nargs="?", help="target folder (default: the cache; prints its path)")
    parser.add_argument("--variant", default="tiny", choices=sorted(VARIANTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(build(args.out_dir, args.variant) if args.out_dir else ensure_built(args.variant))


if __name__ == "__main__":
    main()
