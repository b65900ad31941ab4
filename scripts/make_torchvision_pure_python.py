"""Make the registry's CUDA-linked torchvision 0.28.0 wheel importable beside torch 2.13.0+cpu.

Every torchvision wheel on PyPI for this torch is a CUDA build: `import torchvision` then fails with
"operator torchvision::nms does not exist". transformers needs torchvision to build the Qwen2.5-VL
processor, and vLLM uses that processor. We drop the compiled extensions (nms/roi_align/decode_jpeg become
unavailable; the v2 transforms keep working) and guard the two fake-kernel registrations that assume them.
Run with the venv's python: it patches the torchvision installed there.
"""
import importlib.util
import pathlib
import shutil
import sys

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.origin is None:
    sys.exit("torchvision is not installed in this interpreter")
tv = pathlib.Path(spec.origin).parent
for name in ("_C.so", "image.so"):
    (tv / name).unlink(missing_ok=True)
shutil.rmtree(tv.parent / "torchvision.libs", ignore_errors=True)

meta = tv / "_meta_registrations.py"
src = meta.read_text()
helper = '''

def _register_fake_if_ops(qualname):
    def wrapper(fn):
        if torchvision.extension._has_ops():
            return torch.library.register_fake(qualname)(fn)
        return fn
    return wrapper

'''
if "_register_fake_if_ops" not in src:
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib"
    if anchor not in src:
        sys.exit(f"unexpected torchvision layout in {meta}: cannot patch")
    src = src.replace(anchor, helper + "\n" + anchor, 1)
    for op in ("nms", "qnms"):
        src = src.replace(f'@torch.library.register_fake("torchvision::{op}")', f'@_register_fake_if_ops("torchvision::{op}")')
    meta.write_text(src)
for cache in tv.rglob("__pycache__"):
    shutil.rmtree(cache, ignore_errors=True)
print(f"torchvision made pure-Python at {tv}")
