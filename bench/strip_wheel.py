"""Drop a folder from a wheel (and from its RECORD), in place: makes a wheel fit a size-limited transfer.

    python bench/strip_wheel.py .whl/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl ray/jars/

File modes are kept (Ray's executables stay executable after `pip install`).
"""

import sys
import zipfile
from pathlib import Path


def strip(wheel: Path, prefix: str) -> int:
    """Rewrite `wheel` without the members under `prefix`; returns the number dropped."""
    tmp = wheel.with_suffix(".tmp")
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefix):
                dropped += 1
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(line for line in data.split(b"\n") if not line.startswith(prefix.encode()))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return dropped


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: strip_wheel.py WHEEL PREFIX/")
    print(f"dropped {strip(Path(sys.argv[1]), sys.argv[2])} files from {sys.argv[1]}")
