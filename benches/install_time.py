"""How long a user's `pip install .` takes: a clean clone of this checkout's HEAD installed into a
fresh virtualenv (cargo's crate downloads cached, as after any earlier build on the machine), timed,
written to benches/results/install_time.json and rendered into the README by render_results.py.

    python benches/install_time.py            # on a quiet machine: nothing else building or running
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "results", "install_time.json")


def main() -> int:
    doc = results_file.header("install_time", "python benches/install_time.py")
    with tempfile.TemporaryDirectory(prefix="kvroute-install-") as tmp:
        src, venv = os.path.join(tmp, "src"), os.path.join(tmp, "venv")
        subprocess.run(["git", "clone", "-q", ROOT, src], check=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = os.path.join(venv, "bin", "pip")
        subprocess.run([pip, "install", "-q", "--upgrade", "pip"], check=True)
        print(f"timing `pip install .` of {doc['commit']} ...", file=sys.stderr)
        t = time.monotonic()
        subprocess.run([pip, "install", "-q", "."], cwd=src, check=True)
        secs = time.monotonic() - t
        check = subprocess.run([os.path.join(venv, "bin", "kvroute"), "--version"], capture_output=True, text=True, check=True)
    doc.update({"seconds": round(secs, 1), "installed": check.stdout.strip()})
    results_file.write(OUT, doc)
    print(f"{secs:.0f} s; wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
