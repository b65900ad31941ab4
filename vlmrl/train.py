"""`python -m vlmrl.train config=FILE.yaml key=value ...`: GRPO training (or validate-only with trainer.val_only=true).

Every key is listed in docs/config.md; `python -m vlmrl.config config=FILE.yaml ...` prints the resolved config.
"""

from __future__ import annotations

import logging
import sys

from vlmrl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        config = load_config(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from vlmrl.trainer.fit import fit  # torch, transformers and the engines load only for a valid config

    fit(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
