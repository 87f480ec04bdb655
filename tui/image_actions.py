"""The chat app's image actions: `/image PATH` and Ctrl+G attach an image, the prompt box names those waiting.

A mixin of tui/app.py's ChatApp (which holds `attachments`, `model`, `model_name` and
`_no_model`), kept apart so the app module stays one screen's wiring; the checks and how a
message carries its images are tui/attachments.py's.
"""

from __future__ import annotations

from edgeinfer.errors import EdgeInferError
from edgeinfer.tui.attachments import label, no_images_line, takes_images
from edgeinfer.tui.loading import short_name
from edgeinfer.tui.screens import ImagePathScreen
from edgeinfer.tui.widgets import PromptInput


class ImageActions:
    """Attaching images to the next message; one notice for a model without an mmproj or a bad image."""

    def _attach(self, path: str) -> None:
        """Keep the image for the next message (EdgeInferError of one line when it cannot be)."""
        record = self.attachments.attach(self.model, short_name(self.model_name), path)
        self._show_pending()
        self.notify(f"{label(record)} goes with the next message", timeout=3)

    def _attach_noted(self, path: str) -> bool:
        """`/image PATH`: attached (True), or one error notice and the prompt box left as typed."""
        try:
            self._attach(path)
        except EdgeInferError as exc:
            self.notify(str(exc), severity="error")
            return False
        return True

    def _show_pending(self) -> None:
        """The prompt box's title names the images waiting for the next message."""
        self.query_one("#prompt", PromptInput).border_title = self.attachments.pending_line()

    def action_attach_image(self) -> None:
        """Ctrl+G: ask for a path (the screen stays open on a bad one; the prompt box is untouched)."""
        if self.model is None:
            self._no_model()
        elif not takes_images(self.model):
            self.notify(no_images_line(short_name(self.model_name)), severity="error")
        else:
            self.push_screen(ImagePathScreen(self._attach))
