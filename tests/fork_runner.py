"""Runs Python scripts as ``python script.py`` would, each in a process of its own, without paying
for ``import torch`` each time (about two CPU seconds; most of what a short docs example costs).

A *zygote* process imports torch and numpy -- third-party modules only: nothing of fagen and nothing
the tests imported -- and then forks one child per script. The child starts from the zygote's state,
the state any interpreter is in right after ``import torch``: the script's own ``import fagen``
runs afresh, a name the script does not import is undefined, and no script sees another's
imports. The child runs the script as ``__main__`` with its folder first on ``sys.path`` and its
output in files, and exits with the script's status (1 and the traceback on an uncaught exception).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

#: What the zygote imports before it forks (third-party only; the scripts' own imports run in the child).
PRELOAD = ("numpy", "torch")

_ZYGOTE = r"""
import json, os, runpy, signal, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = os.open(job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1), os.dup2(err, 2)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.chdir(job["cwd"])
            signal.alarm(job["timeout"])  # a script that hangs is killed (SIGALRM)
            sys.argv = [job["script"]]
            sys.path[0] = os.path.dirname(os.path.abspath(job["script"]))
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            try:
                sys.stdout.flush(), sys.stderr.flush()
            finally:
                os._exit(status)
    _, code = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps(os.waitstatus_to_exitcode(code)) + "\n")
    sys.stdout.flush()
"""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


class Zygote:
    """One zygote process (started on first use); :meth:`run` is serialised by a lock."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self._preload = preload
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *self._preload], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
        return self._proc

    def run(self, script: Path, cwd: Path, timeout: int = 600) -> Result:
        """``script`` run as ``python script`` in ``cwd`` (its output beside it: ``<script>.out`` / ``.err``),
        killed after ``timeout`` seconds (return code -14, SIGALRM)."""
        out, err = script.with_suffix(".out"), script.with_suffix(".err")
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd), "out": str(out),
                                         "err": str(err), "timeout": timeout}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote process died")
        return Result(json.loads(line), out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        self._proc = None
