"""Conversations on disk: saved session files, the TUI's conversations stored as them, and
the guarded open that reads them."""
