"""What a wheel of q12drv carries: every package and every kernel source (a clean install runs the demo)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_and_kernel_source_is_in_the_wheel():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "q12drv").rglob("__init__.py")}
    assert on_disk | {"q12drv.cuda_src"} == listed, "pyproject.toml's packages differ from q12drv/'s"
    patterns = cfg["package-data"]["q12drv.cuda_src"]
    sources = [p.relative_to(ROOT / "cuda_src").as_posix() for p in (ROOT / "cuda_src").rglob("*") if p.is_file()]
    as_re = [re.compile("^" + re.escape(pat).replace("\\*", "[^/]*") + "$") for pat in patterns]
    assert sources and all(any(r.match(s) for r in as_re) for s in sources), sources
    assert "py.typed" in cfg["package-data"]["q12drv"] and (ROOT / "q12drv" / "py.typed").is_file()
