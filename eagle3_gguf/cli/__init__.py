"""Command-line interface: one module per command, wired together in main.py."""
