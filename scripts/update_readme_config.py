"""Rewrite the README's configuration reference (between the config markers) from vlmrl/config.py.

Run after changing a config field: python scripts/update_readme_config.py   (tests/test_config.py checks it is current)
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vlmrl.config import readme_reference  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
readme = ROOT / "README.md"
text = readme.read_text()
head, rest = text.split(START, 1)
_, tail = rest.split(END, 1)
readme.write_text(f"{head}{START}\n{readme_reference()}{END}{tail}")
print(f"updated {readme}")
