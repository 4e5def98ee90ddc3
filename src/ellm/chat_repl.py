"""`ellm chat`: an interactive conversation on the terminal.

Line editing and a history kept across sessions come from readline (where Python has it;
the history file is <cache>/chat_history). Ctrl-C while the model answers stops the
answer and keeps the conversation (the part already written stays in it); Ctrl-C at the
prompt drops the line being typed. Ctrl-D, /bye or /exit leave.

A message of several lines (pasted code, say) goes between triple quotes, as in ollama:
a line that starts with \"\"\" opens it and a line that ends with \"\"\" closes it. A line
that ends with a backslash also continues on the next line.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

QUOTES = '"""'
HELP = f"""Commands:
  /bye, /exit   leave (so does Ctrl-D)
  /clear        forget the conversation (the system prompt stays)
  /help         this text
A message over several lines: start it with {QUOTES} and end it with {QUOTES}
(or end a line with a backslash to go on). Ctrl-C stops a reply and keeps the session."""


@contextlib.contextmanager
def line_history(path: Path | None) -> Iterator[None]:
    """readline line editing, with the history read from and saved to path."""
    try:
        import readline
    except ImportError:   # Windows without pyreadline: plain input()
        yield
        return
    if path is not None:
        with contextlib.suppress(OSError):
            readline.read_history_file(path)
    readline.set_history_length(2000)
    try:
        yield
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(path)


def read_message(ask: Callable[[str], str]) -> str:
    """One message from ask (input): a line, a \"\"\"-quoted block, or lines joined by a
    trailing backslash. EOFError and KeyboardInterrupt pass through."""
    line = ask(">>> ")
    if line.lstrip().startswith(QUOTES):
        first = line.lstrip()[len(QUOTES):]
        if first.rstrip().endswith(QUOTES):          # """one line"""
            return first.rstrip()[:-len(QUOTES)]
        lines = [first] if first else []
        while True:
            more = ask("... ")
            if more.rstrip().endswith(QUOTES):
                lines.append(more.rstrip()[:-len(QUOTES)])
                return "\n".join(lines).strip("\n")
            lines.append(more)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = ask("... ")
    lines.append(line)
    return "\n".join(lines)


class ChatSession:
    """The conversation and the model's replies, streamed to out."""

    def __init__(self, llm: Any, params: Any, system: str | None = None, out: TextIO | None = None,
                 err: TextIO | None = None) -> None:
        self.llm, self.params, self.system = llm, params, system
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, text: str) -> str | None:
        """Sends text as the user's message and streams the answer. Ctrl-C stops it (the
        words so far stay in the conversation). -> the answer, None when it failed."""
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        stream = None
        try:
            stream = self.llm.chat_stream(self.messages, self.params)
            for piece in stream:
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            self.err.write(" [stopped]")
        except ValueError as e:   # the conversation no longer fits the context, a template error
            self.messages.pop()
            self.err.write(f"error: {e}\n(/clear starts a new conversation)\n")
            return None
        finally:
            if stream is not None:
                stream.close()   # aborts the request if it is still running: frees its KV blocks
        self.out.write("\n")
        self.out.flush()
        answer = "".join(pieces)
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def run(session: ChatSession, ask: Callable[[str], str] = input, history: Path | None = None) -> int:
    """The read-reply loop. -> exit status."""
    err = session.err
    err.write("Type a message (/help for help; Ctrl-D or /bye leaves).\n")
    with line_history(history):
        while True:
            try:
                text = read_message(ask)
            except EOFError:
                err.write("\n")
                return 0
            except KeyboardInterrupt:
                err.write("\n(Ctrl-D or /bye leaves)\n")
                continue
            command = text.strip()
            if not command:
                continue
            if command in ("/bye", "/exit", "/quit"):
                return 0
            if command == "/clear":
                session.clear()
                err.write("(a new conversation)\n")
                continue
            if command in ("/help", "/?"):
                err.write(HELP + "\n")
                continue
            if command.startswith("/") and " " not in command:
                err.write(f"unknown command {command} (/help lists them)\n")
                continue
            session.reply(text)
