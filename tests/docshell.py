"""Run the shell blocks of a Markdown page the way a reader would paste them.

A page's fenced blocks are read in order; an HTML comment right before a fence marks it for the
runner (invisible when rendered): ``<!-- test: background -->`` starts the block and leaves it
running, ``<!-- test: output -->`` means the next ``text`` block is the block's exact stdout.
Blocks run one after another in one logical shell: the working directory and exported variables
carry over from block to block (each block is its own ``bash -euo pipefail`` process). Text
substitutions turn the page's placeholders (a MinIO endpoint, a bucket) into the test's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*test:\s*([\w-]+)\s*-->\s*$")


@dataclass
class Block:
    lang: str
    text: str
    line: int
    marks: set[str] = field(default_factory=set)

    @property
    def commands(self) -> list[str]:
        return [ln.strip() for ln in self.text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    marks: set[str] = set()
    while i < len(lines):
        m = _MARK.match(lines[i])
        if m:
            marks.add(m.group(1))
            i += 1
            continue
        f = _FENCE.match(lines[i])
        if f:
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(f.group(1), "\n".join(body) + "\n", start + 1, marks))
            marks = set()
        elif lines[i].strip():
            marks = set()
        i += 1
    return out


def shell_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in ("bash", "sh")]


class DocShell:
    def __init__(self, cwd: Path, env: Mapping[str, str], subst: Mapping[str, str] | None = None):
        self.state = cwd / ".docshell"
        self.state.mkdir(parents=True, exist_ok=True)
        self.envfile = self.state / "env.sh"
        self.cwdfile = self.state / "cwd"
        self.envfile.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        self.cwdfile.write_text(str(cwd))
        self.subst = dict(subst or {})
        self.background: list[subprocess.Popen[str]] = []

    def _script(self, text: str, keep_state: bool = True) -> str:
        for a, b in self.subst.items():
            text = text.replace(a, b)
        tail = f'\npwd > {shlex.quote(str(self.cwdfile))}\nexport -p > {shlex.quote(str(self.envfile))}\n'
        return (
            f"set -euo pipefail\ncd {shlex.quote(self.cwdfile.read_text().strip())}\n"
            f"source {shlex.quote(str(self.envfile))}\n{text}" + (tail if keep_state else "")
        )

    def run(self, block: Block, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["bash", "-c", self._script(block.text)], env={"PATH": os.environ["PATH"]},
            capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"block at line {block.line} failed ({proc.returncode}):\n{block.text}\n"
                f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
            )
        return proc

    def start(self, block: Block, ready: str, timeout: float = 120) -> subprocess.Popen[str]:
        """Start a long-running block; return once a stdout line contains ``ready``."""
        proc = subprocess.Popen(
            ["bash", "-c", self._script("exec " + block.text.strip(), keep_state=False)],
            env={"PATH": os.environ["PATH"]}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.background.append(proc)
        deadline = time.monotonic() + timeout
        seen = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            seen.append(line)
            if ready in line:
                return proc
        raise AssertionError(f"block at line {block.line} never printed {ready!r}:\n{''.join(seen)}")

    def stop(self) -> None:
        import signal

        for p in self.background:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
