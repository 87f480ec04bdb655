"""The interactive `edgeinfer run NAME`: read a message or a slash command, answer, repeat."""

from __future__ import annotations

import sys

from edgeinfer.commands import repl_commands as rc
from edgeinfer.commands.answer import answer, messages_for
from edgeinfer.commands.line_input import LineReader
from edgeinfer.commands.run_model import completion_mode, load_with_spinner
from edgeinfer.errors import EdgeInferError


class Repl:
    """One interactive session: the model, its sampling parameters, system prompt and turns.
    `raw` = plain completion (each line is completed on its own, no chat template)."""

    def __init__(self, model, args, params: dict, raw: bool, system: str | None = None,
                 history: list[dict] | None = None, reader: LineReader | None = None,
                 out=None, err=None) -> None:
        self.model = model
        self.args = args
        self.name = args.name
        self.raw = raw
        self.verbose = bool(args.verbose)
        self.session = getattr(args, "session", None)
        self.params = params
        self.constraint = rc.constraint_from_args(args)  # --format / --grammar-file, /set format
        self.system = system if system is not None else args.system
        self.history = history if history is not None else []
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.reader = reader if reader is not None else LineReader(stdout=self.out)
        self.images: list[str] = list(getattr(args, "image", None) or [])  # for the next message (/image)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def error(self, text: str) -> None:
        print(f"error: {text}", file=self.err, flush=True)

    def loop(self) -> int:
        print(f"{self.name} is ready. Send a message (/? for help, /bye to quit)", file=self.err)
        interrupted = False
        while True:
            try:
                line = self.reader.read_message()
            except EOFError:
                print("", file=self.err)
                return 0
            except KeyboardInterrupt:  # as Ollama: a first Ctrl-C at the prompt only explains
                print("", file=self.err)
                if interrupted:
                    return 0
                interrupted = True
                print("Use Ctrl + d or /bye to exit.", file=self.err)
                continue
            interrupted = False
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and not self.opens_with_image(text):
                try:
                    if not self.command(text):
                        return 0
                except EdgeInferError as exc:
                    self.error(str(exc))
                continue
            self.send(line)

    def send(self, line: str) -> None:
        """Answer one message, keep the turn, save the session if one is named."""
        try:
            line, typed = self.typed_images(line)
        except EdgeInferError as exc:  # a named image that cannot be used: nothing is sent
            self.error(str(exc))
            return
        images, self.images = self.images + typed, []
        try:
            params = self.params if self.constraint is None else {**self.params, "constraint": self.constraint}
            if self.raw:
                answer(self.model, line, params, True, self.verbose, self.out, self.err, images=images)
                return  # completion: each line stands alone
            from edgeinfer.commands.image_input import user_content

            content = user_content(line, images)  # the turn keeps its images: later turns resend them
            messages = messages_for(self.system, self.history, content)
            text = answer(self.model, messages, params, False, self.verbose, self.out, self.err)
        except EdgeInferError as exc:
            self.error(str(exc))
            return
        self.history += [{"role": "user", "content": content}, {"role": "assistant", "content": text}]
        if self.session is not None:
            try:
                self.save(self.session, quiet=True)
            except (EdgeInferError, OSError) as exc:
                self.error(f"session not saved: {exc}")

    def opens_with_image(self, text: str) -> bool:
        """A message that starts with an image's path (`/home/me/cat.png what is this?`) is sent,
        not taken for a slash command."""
        if getattr(self.model, "images", None) is None or self.session is not None:
            return False
        from edgeinfer.commands.image_paths import starts_with_image_path

        return starts_with_image_path(text)

    def typed_images(self, line: str) -> tuple[str, list[str]]:
        """Image files whose paths the message names, taken out of it (as `ollama run`); only
        for a model that takes images outside a saved session (else the line stays as typed)."""
        if getattr(self.model, "images", None) is None or self.session is not None:
            return line, []
        from edgeinfer.commands.image_paths import image_paths
        from edgeinfer.vision.image_file import open_image_file

        text, paths = image_paths(line)
        for path in paths:
            open_image_file(path)  # not an image, too large: said now, and the message waits
        for path in paths:
            self.say(f"Added image '{path}'")
        return text, paths

    # -- slash commands ---------------------------------------------------------------------
    def command(self, text: str) -> bool:
        """Run one slash command; False = leave the REPL."""
        word, _, rest = text.partition(" ")
        rest = rest.strip()
        if word in ("/bye", "/exit", "/quit"):
            return False
        if word in ("/?", "/help"):
            self.say(rc.help_text(rest))
        elif word == "/clear":
            self.history.clear()
            self.say("Cleared session context.")
        elif word == "/set":
            self.set(rest)
        elif word == "/show":
            self.say(rc.show(rest, self.model, self.params, self.system, self.raw))
        elif word == "/load":
            self.load(rest)
        elif word == "/image":
            self.attach(rest)
        elif word == "/save":
            if not rest:
                raise EdgeInferError("usage: /save <name>")
            self.save(rest)
        else:
            raise EdgeInferError(f"unknown command '{word}'. Type /? for help")
        return True

    def set(self, text: str) -> None:
        what, _, rest = text.partition(" ")
        if not what:
            self.say(rc.USAGE_SET)
        elif what == "parameter":
            if not rest.strip():
                self.say(rc.usage_parameters())
            else:
                self.say(rc.set_parameter(self.params, rest))
        elif what == "system":
            system = rc.parse_system(rest)
            if not system:
                raise EdgeInferError("usage: /set system <string>")
            self.system = system
            self.say("Set system message." + (" (unused: this model runs as plain completion)" if self.raw else ""))
        elif what in ("verbose", "quiet"):
            self.verbose = what == "verbose"
            self.say(f"Set '{what}' mode.")
        elif what in ("history", "nohistory"):
            self.reader.history_enabled = what == "history"
            self.say(f"Set '{what}' mode.")
        elif what == "noformat":
            self.constraint = None
            self.say("Disabled format.")
        elif what == "format":
            if not rest.strip():
                raise EdgeInferError("usage: /set format json|FILE.schema.json")
            self.constraint = rc.constraint_for_format(rest)
            self.say(f"Set format to '{rest.strip()}' mode.")
        elif what in ("wordwrap", "nowordwrap", "think", "nothink"):
            raise EdgeInferError(f"/set {what} is not supported yet")
        else:
            raise EdgeInferError(f"unknown /set option {what!r} (try /? set)")

    def attach(self, path: str) -> None:
        """`/image PATH`: the image goes with the next message."""
        if not path:
            raise EdgeInferError("usage: /image <path>")
        if getattr(self.model, "images", None) is None:
            raise EdgeInferError(f"{self.name} takes no images: start it with --mmproj FILE")
        if self.session is not None:
            raise EdgeInferError("images cannot go into a saved session yet (saved sessions keep text only)")
        from edgeinfer.commands.image_input import read_image_file

        read_image_file(path)  # unreadable or too large: said now, not at the next message
        self.images.append(path)
        self.say(f"Added image '{path}' to the next message.")

    def load(self, name: str) -> None:
        """`/load NAME`: a saved session of this model if one has that name, else another model."""
        if not name:
            raise EdgeInferError("usage: /load <model>")
        from edgeinfer.sessions.session_file import session_path

        try:
            saved = session_path(name).exists()
        except EdgeInferError:  # not a session name (a path, hf.co/...): a model
            saved = False
        if saved:
            if self.raw:
                raise EdgeInferError(f"session '{name}' keeps a chat; this model runs as plain completion")
            from edgeinfer.commands.run_session import resume_session

            self.system, self.history = resume_session(self.model, name, self.params, self.system)
            self.session = name
            return
        previous = self.args.name
        self.args.name = name
        try:
            model = load_with_spinner(self.args)
            raw = completion_mode(model, self.args)
        except BaseException:
            self.args.name = previous
            raise
        self.model, self.name, self.raw = model, name, raw
        self.history.clear()
        self.say(f"Loaded model '{name}'.")

    def save(self, name: str, quiet: bool = False) -> None:
        from edgeinfer.commands.run_session import save_run_session
        from edgeinfer.sessions.session_file import check_name

        check_name(name)
        if self.raw:
            raise EdgeInferError("/save keeps a chat; this model runs as plain completion")
        save_run_session(self.model, name, self.system, self.history, self.params,
                         getattr(self.args, "session_kv", False))
        if not quiet:
            self.say(f"Saved session '{name}' (resume it with: edgeinfer run {self.name} --session {name})")
