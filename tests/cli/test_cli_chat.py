"""`strata chat` driven as a person drives it: through a pseudo-terminal, on the embedded model.
The history is kept (the second turn's prompt holds the first, reusing the session), the system
prompt goes through the chat template, and /reset clears the conversation but not the system
prompt (the first turn comes back token for token)."""

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import strata
from strata.chat_template import render_chat
from strata.default_model import EMBEDDED

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "Answer in Python."
STATS = re.compile(r"\[(\d+) prompt tokens \((\d+) reused\), (\d+) generated")
TIMEOUT = 60.0

pytestmark = pytest.mark.skipif(not EMBEDDED.exists(), reason="the embedded model is not in this checkout")


class Terminal:
    """A child process on a pseudo-terminal: what it writes is read back until a marker shows."""

    def __init__(self, argv: list[str]) -> None:
        self.fd, slave = pty.openpty()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.seen = ""

    def until(self, marker: str) -> str:
        """Everything written from here up to and including the next `marker`."""
        start, deadline = len(self.seen), time.monotonic() + TIMEOUT
        while marker not in self.seen[start:]:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} within {TIMEOUT} s; the terminal shows:\n{self.seen[-2000:]}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk, f"the chat ended early; the terminal shows:\n{self.seen[-2000:]}"
                self.seen += chunk.decode("utf-8", "replace").replace("\r\n", "\n")
        end = self.seen.index(marker, start) + len(marker)
        return self.seen[start:end]

    def say(self, line: str) -> str:
        os.write(self.fd, (line + "\n").encode())
        return self.until(">>> ")

    def close(self) -> int:
        os.write(self.fd, b"\x04")  # Ctrl-D at the prompt: end of input
        try:
            return self.proc.wait(TIMEOUT)
        finally:
            os.close(self.fd)


def _turn(screen: str, typed: str) -> tuple[str, tuple[int, int]]:
    """The reply text and (prompt tokens, reused) of one turn's screen."""
    stats = STATS.search(screen)
    assert stats, screen
    body = screen[:stats.start()]
    body = body[body.index(typed) + len(typed) + 1:] if typed in body else body
    return body.rstrip("\n"), (int(stats.group(1)), int(stats.group(2)))


def test_chat_keeps_history_applies_the_system_prompt_and_resets():
    term = Terminal([sys.executable, "-m", "strata.cli.main", "chat", "--system", SYSTEM, "-n", "6", "--temp", "0",
                     "--backend", "numpy"])
    try:
        term.until(">>> ")
        first, (n1, _) = _turn(term.say("add two numbers"), "add two numbers")
        with strata.load(EMBEDDED) as model:  # the system prompt is in the first prompt, rendered by the template
            wanted = render_chat(model.tokenizer.chat_template, [{"role": "system", "content": SYSTEM},
                                                                 {"role": "user", "content": "add two numbers"}])
            assert n1 == len(model.tokenizer.encode(wanted))
        history = term.say("/history")
        assert f"system: {SYSTEM}" in history and "user: add two numbers" in history and "assistant:" in history
        _, (n2, reused2) = _turn(term.say("now subtract"), "now subtract")
        assert n2 > n1 and reused2 >= n1 - 1, "the second turn's prompt holds the first, from the session"
        assert "cleared" in term.say("/reset")
        history = term.say("/history")
        assert f"system: {SYSTEM}" in history and "user:" not in history
        again, (n3, _) = _turn(term.say("add two numbers"), "add two numbers")
        assert (again, n3) == (first, n1), "after /reset the first turn is the first turn again"
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path, capsys):
    from strata.cli.main import main
    from strata.testing.models import make_model

    made = make_model(tmp_path / "tiny", "tiny", seed=0)
    assert main(["chat", str(made.model_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "has no chat template; give one with --chat-template FILE" in err
    assert main(["chat", str(made.model_path), "--ctx", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ctx: must be >= 2, got 1"
