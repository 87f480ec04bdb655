"""Threads with a large, known stack: where native code recurses on what a request sent.

The bounds keep llguidance's recursion far inside an 8 MiB stack; threads that compile or
match grammars for the server get a stack 32 times that besides, so a grammar the bounds
misjudge still cannot overflow it (the stack is reserved address space: only the pages a
recursion touches are ever committed).
"""

from __future__ import annotations

import threading

THREAD_STACK_BYTES = 256 << 20
_stack_lock = threading.Lock()


def start_thread(target, name: str, *, daemon: bool = True) -> threading.Thread:
    """Start `target` on a new thread with a THREAD_STACK_BYTES stack (the platform's default
    stack where that size cannot be had)."""
    with _stack_lock:
        try:
            old = threading.stack_size(THREAD_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that cannot set it
            old = None
        try:
            thread = threading.Thread(target=target, name=name, daemon=daemon)
            try:
                thread.start()
            except RuntimeError:  # that much address space refused: the default stack
                if old is None:
                    raise
                threading.stack_size(old)
                old = None
                thread = threading.Thread(target=target, name=name, daemon=daemon)
                thread.start()
        finally:
            if old is not None:
                threading.stack_size(old)
    return thread
