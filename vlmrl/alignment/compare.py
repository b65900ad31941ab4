"""python -m vlmrl.alignment.compare: are two backends' validation outputs the same, and if not, where and why?

    python -m vlmrl.alignment.compare A.jsonl B.jsonl [--out DIR] [--max-real-divergence 0.02 ...]
    python -m vlmrl.alignment.compare --backends vllm,sglang config=FILE.yaml key=value ... [--out DIR]

The first form diffs two artifacts written by validate-only mode (`trainer.val_only=true`). The second runs that
validation on both backends itself (same data, images and seeds; greedy by default), then diffs. Writes
DIR/report.json and DIR/report.html and prints a one-screen summary.

Exit status: 0 aligned within the thresholds, 1 not aligned, 2 bad usage or unreadable / incomparable artifacts.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from vlmrl.alignment.artifact import ArtifactError, read_artifact
from vlmrl.alignment.diff import NotComparableError, Thresholds, compare_artifacts
from vlmrl.alignment.html_report import write_html_report
from vlmrl.alignment.report import print_summary, write_json_report

EXIT_ALIGNED, EXIT_NOT_ALIGNED, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = "outputs/alignment"


class UsageError(ValueError):
    """Bad command line (exit 2)."""


def _threshold_docs() -> dict[str, str]:
    from vlmrl.config import field_docs  # one reader of field docstrings for the whole project

    return field_docs(Thresholds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlmrl.alignment.compare",
        description="Diff two backends' validation outputs at four levels (inputs, tokens, logprobs, rewards), "
        "bucket every differing sample by cause, and exit 0 when they agree within the thresholds.",
        epilog="Exit status: 0 aligned, 1 not aligned, 2 bad usage or unreadable/incomparable artifacts.",
    )
    parser.add_argument("inputs", nargs="*", metavar="A.jsonl B.jsonl | key=value",
                        help="two artifacts; with --backends: config=FILE.yaml and dotted key=value overrides")
    parser.add_argument("--backends", metavar="X,Y",
                        help="run validation on these two backends (of hf, vllm, sglang, sglang-server) and compare")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for report.json/report.html (default {DEFAULT_OUT})")
    parser.add_argument("--no-html", action="store_true", help="skip the HTML report")
    docs = _threshold_docs()
    group = parser.add_argument_group("thresholds (when the two sides count as aligned)")
    for f in dataclasses.fields(Thresholds):
        group.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default, metavar="X",
                           help=f"{docs.get(f.name, '')} (default {f.default})")
    return parser


def thresholds_from(args: argparse.Namespace) -> Thresholds:
    return Thresholds(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Thresholds)})


def _artifact_paths(args: argparse.Namespace, out: Path) -> list[Path]:
    """The two artifacts to compare: given on the command line, or produced now by running validation twice."""
    if not args.backends:
        if len(args.inputs) != 2 or any("=" in item for item in args.inputs):
            raise UsageError("give exactly two artifact files (A.jsonl B.jsonl), or --backends X,Y with key=value "
                             "overrides")
        return [Path(item) for item in args.inputs]
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    if len(backends) != 2:
        raise UsageError(f"--backends needs exactly two names separated by a comma, got {args.backends!r}")
    bad = [item for item in args.inputs if "=" not in item]
    if bad:
        raise UsageError(f"with --backends, arguments must be config=FILE.yaml or key=value; got {bad}")
    from vlmrl.alignment.runner import run_backends  # loads config, data and engines only on this path

    return run_backends(backends, list(args.inputs), out)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    except SystemExit as exit_:  # argparse exits 2 on bad usage and 0 on --help
        return int(exit_.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    console = Console()
    err = Console(stderr=True)
    out = Path(args.out)
    try:
        path_a, path_b = _artifact_paths(args, out)
        meta_a, records_a = read_artifact(path_a)
        meta_b, records_b = read_artifact(path_b)
        comparison = compare_artifacts(meta_a, records_a, meta_b, records_b, thresholds_from(args))
    except (UsageError, ArtifactError, NotComparableError) as error:
        err.print(Text("error: ", style="bold red") + Text(str(error)))
        return EXIT_USAGE
    written = [write_json_report(comparison, out / "report.json")]
    if not args.no_html:
        written.append(write_html_report(comparison, records_a, records_b, out / "report.html"))
    print_summary(comparison, console, written)
    return EXIT_ALIGNED if comparison.ok else EXIT_NOT_ALIGNED


if __name__ == "__main__":
    # Run the package's copy of main: under `python -m` this file is also loaded as __main__, whose UsageError is a
    # different class from the one vlmrl.alignment.runner raises, so bad usage would escape as a traceback (exit 1).
    from vlmrl.alignment.compare import main as package_main

    sys.exit(package_main())
