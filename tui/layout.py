"""The chat app's look and keys: its stylesheet, key bindings and the key line's order."""

from __future__ import annotations

from textual.binding import Binding

from edgeinfer.tui.controller import Key

CSS = """
#sidebar { width: 30; border-right: vkey $primary 50%; padding: 0 1; }
#sidebar.hidden { display: none; }
#sidebar-title { text-style: bold; color: $text-accent; padding: 0 0 1 0; }
#conversations { height: 1fr; border: none; background: $surface; }
#main { width: 1fr; }
#chat { height: 1fr; padding: 0 1; scrollbar-gutter: stable; }
.message { margin: 1 0 0 0; padding: 0 1; border: round $primary 40%; height: auto; }
.message.user { border: round $secondary; }
.message.assistant { border: round $primary; padding: 0 1 0 1; }
.message.assistant > *:last-child { margin-bottom: 0; }
.message.system { border: round $warning 60%; color: $text-muted; }
#welcome { margin: 1 0 0 0; padding: 0 1; height: auto; }
#loading { height: 2; display: none; padding: 0 1; }
#loading.visible { display: block; }
#loading-label { width: 1fr; height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
#prompt { height: auto; min-height: 3; max-height: 12; border: tall $accent; }
StatusBar { height: auto; background: $panel; color: $text; padding: 0 1; }
KeyBar { height: 1; background: $primary-background; color: $text; padding: 0 1; }
#session-hint { width: 100%; margin: 1 0 0 0; }
#pull-status { width: 100%; }
#hits { height: auto; max-height: 16; }
.dialog { width: 80%; max-width: 100; height: auto; max-height: 90%; padding: 1 2;
          border: thick $primary; background: $surface; }
ModalScreen { align: center middle; }
#settings-grid { grid-size: 2; grid-columns: 2fr 1fr; grid-rows: 1; grid-gutter: 0 1; height: auto;
                 margin: 1 0 0 0; }
#settings-grid Input { border: none; height: 1; padding: 0 1; }
#settings-body { height: 90%; padding: 0 1; }
#settings-fields { height: 1fr; }
.system-prompt { height: 4; }
.buttons { height: auto; align-horizontal: right; padding: 0; }
.buttons Button { margin: 0 0 0 2; }
#help-body { height: 90%; }
#models { height: auto; max-height: 20; }
"""

# Keys the focused prompt box (TextArea) already uses are avoided: Ctrl+E/K/Y/A/U/W/Z,
# Ctrl+C/X/V, F5-F7.
BINDINGS = [
    Binding("f1", "help", "Help"),
    Binding("escape", "stop", "Stop"),
    Binding("ctrl+n", "new_conversation", "New"),
    Binding("ctrl+r", "regenerate", "Regenerate"),
    Binding("ctrl+l", "edit_last", "Edit last"),
    Binding("ctrl+s", "settings", "Settings"),
    Binding("ctrl+o", "pick_model", "Model"),
    Binding("ctrl+g", "attach_image", "Image"),
    Binding("ctrl+f", "search", "Search"),
    Binding("f3", "copy_answer", "Copy answer"),
    Binding("f4", "copy_code", "Copy code"),
    Binding("f5", "copy_chat", "Copy chat"),
    Binding("f9", "export", "Export"),
    Binding("ctrl+b", "toggle_sidebar", "Chats"),
    Binding("f2", "rename", "Rename"),
    Binding("f8", "delete", "Delete"),
    Binding("ctrl+t", "toggle_dark", "Theme"),
    Binding("ctrl+left", "step_answer(-1)", "Previous answer", show=False),
    Binding("ctrl+right", "step_answer(1)", "Next answer", show=False),
    Binding("ctrl+q", "quit", "Quit", priority=True),
]
# The key line, in priority order: what does not fit is behind "F1 help".
KEYS = [Key("Enter", "send"), Key("Esc", "stop"), Key("^N", "new"), Key("^O", "model"),
        Key("^S", "settings"), Key("^R", "regenerate"), Key("^F", "search"), Key("^L", "edit last"),
        Key("F3", "copy answer"), Key("^G", "image"), Key("F5", "copy chat"), Key("F9", "export"), Key("^B", "chats"),
        Key("F2", "rename"), Key("F8", "delete"), Key("^T", "theme"), Key("^Q", "quit"),
        Key("F1", "help")]
