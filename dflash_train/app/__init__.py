"""Entry points: the command line, its command handlers, and the quality recipe."""
