"""Images for the chat's messages: `/image PATH` and Ctrl+G attach them, a user message keeps them, the model gets them.

Plain Python (no Textual), tested without a terminal. A user message keeps its images as
records, `"images": [{"path", "name", "width", "height"}]`, beside its text content: the saved
session stays text (no image bytes in it; `edgeinfer run --session` sees the text), and the
transcript names each image with its size. The model gets each image again with every later
answer (as the REPL resends them; the prefix cache knows them by digest): the bytes read when
it was attached, or for a conversation opened later, the file read again.
"""

from __future__ import annotations

from typing import Any

from edgeinfer.errors import EdgeInferError
from edgeinfer.vision.image_file import ImageFile, open_image_file

COMMAND = "/image"


def image_command(text: str) -> str | None:
    """The path of a `/image PATH` message (one pair of quotes taken off; "" when none is
    given), or None when the text is a message to send."""
    word, _, rest = text.strip().partition(" ")
    if word != COMMAND:
        return None
    path = rest.strip()
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    return path


def takes_images(model: Any) -> bool:
    return getattr(model, "images", None) is not None


def no_images_line(model_name: str) -> str:
    return f"{model_name} takes no images: start `edgeinfer chat` with --mmproj FILE (its vision encoder)"


def label(record: dict) -> str:
    """How the transcript names an attached image: "image: cat.png 1024×768"."""
    return f"image: {record.get('name', '?')} {record.get('width', '?')}×{record.get('height', '?')}"


def images_of(message: dict | None) -> list[dict]:
    """A message's image records (none for a message without valid ones)."""
    records = message.get("images") if isinstance(message, dict) else None
    if not isinstance(records, list):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("path"), str)]


def last_user_images(messages: list[dict]) -> list[dict]:
    """The images of the last user message (the one Ctrl+L or a failed answer gives back)."""
    for m in reversed(messages):
        if m.get("role") == "user":
            return images_of(m)
    return []


class Attachments:
    """The images waiting for the next message, and the files read in this run (by path)."""

    def __init__(self) -> None:
        self.pending: list[dict] = []
        self.files: dict[str, ImageFile] = {}

    def attach(self, model: Any, model_name: str, path: str) -> dict:
        """Check `path` for the loaded model and keep it for the next message; EdgeInferError of
        one line when the model takes no images or the file is not a usable image."""
        if not path:
            raise EdgeInferError(f"usage: {COMMAND} PATH (or Ctrl+G)")
        if not takes_images(model):
            raise EdgeInferError(no_images_line(model_name))
        file = open_image_file(path)
        self.files[file.path] = file
        record = {"path": file.path, "name": file.name, "width": file.width, "height": file.height}
        self.pending.append(record)
        return record

    def take(self) -> list[dict]:
        """The pending images, for the message being sent (none wait afterwards)."""
        taken, self.pending = self.pending, []
        return taken

    def give_back(self, records: list[dict]) -> None:
        """A message taken back to the prompt box keeps its images for when it is sent again."""
        self.pending = list(records) + self.pending

    def pending_line(self) -> str:
        """The prompt box's title while images wait: "+ image: cat.png 1024×768"."""
        return "  ".join(f"+ {label(r)}" for r in self.pending)

    def chat_messages(self, conv_messages: list[dict], messages: list[dict], model: Any,
                      model_name: str) -> tuple[list[dict], list[str]]:
        """`messages` (Conversation.chat_messages(): role and content, the system prompt first)
        with each user message's images as image parts before its text, from `conv_messages`
        (the conversation's own, with their records); and one line per image left out."""
        problems: list[str] = []
        offset = len(messages) - len(conv_messages)
        out = list(messages)
        for i, m in enumerate(conv_messages):
            records = images_of(m) if m.get("role") == "user" else []
            if not records:
                continue
            if not takes_images(model):
                problems.append(f"the conversation's images are left out: {no_images_line(model_name)}")
                continue
            parts = []
            for record in records:
                file = self._file(record["path"], problems)
                if file is not None:
                    parts.append(file.part())
            text = m.get("content", "")
            if not parts:
                continue
            out[offset + i] = {"role": "user", "content": parts + ([{"type": "text", "text": text}] if text else [])}
        return out, list(dict.fromkeys(problems))

    def _file(self, path: str, problems: list[str]) -> ImageFile | None:
        file = self.files.get(path)
        if file is None:
            try:
                file = self.files[path] = open_image_file(path)
            except EdgeInferError as exc:  # moved or deleted since: the text still goes
                problems.append(f"an image is left out: {exc}")
        return file
