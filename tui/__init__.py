"""tui of edgeinfer."""
