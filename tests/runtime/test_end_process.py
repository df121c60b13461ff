"""``end_process``: a server's exit flushes what it wrote and skips the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import atexit, logging, sys
from eaas.runtime.server.daemon import end_process
logging.basicConfig(level=logging.INFO, format="%(message)s")
atexit.register(lambda: print("atexit ran"))
logging.getLogger("eaas.test").info("logged before the end")
sys.stdout.write("written, not flushed")
end_process(3)
print("after the end")
"""


def test_end_process_flushes_and_exits_with_its_code_without_teardown() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "written, not flushed"  # flushed; neither atexit nor the next line ran
    assert "logged before the end" in done.stderr
