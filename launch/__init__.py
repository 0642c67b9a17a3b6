"""The `launch` command: what users type."""
