"""A `tinyserve run` subprocess for the drain, memory and soak tests: started on a free port
with its log in a file (a pipe nobody reads would fill up and stall the server), its resident
memory, its /metrics gauges."""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


class Server:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        exe = shutil.which("tinyserve")
        cmd = [exe] if exe else [sys.executable, "-m", "tinyserve.cli"]
        self.log_path = tmp_path / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*cmd, "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.url = self._wait_ready(timeout=240)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if match := re.search(r" at (http://\S+)/v1 ", line):
                    self.ready_line = line
                    return match.group(1)
            if self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"the server did not start: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text()

    def rss_mb(self) -> float:
        """Resident memory now (VmRSS), in MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def terminate(self, timeout: float) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            log = self.log()[-3000:]
            raise AssertionError(f"no exit {timeout} s after SIGTERM: {log}") from None
        return code, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def gauges(metrics_text: str) -> dict[str, float]:
    """tinyserve:* gauge values of a /metrics page, by their short name."""
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        match = re.search(rf"^tinyserve:{name}\{{[^}}]*\}} (\S+)$", metrics_text, re.M)
        out[name] = float(match.group(1))
    return out


def sse_events(text: str) -> list:
    """The events of an SSE body: dicts, and "[DONE]"."""
    blocks = [b for b in text.split("\n\n") if b.startswith("data: ")]
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]
