"""`python -m metrale` runs the CLI."""

from metrale.cli import app

app()
