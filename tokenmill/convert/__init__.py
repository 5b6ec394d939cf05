"""Model format conversions: `tokenmill convert` (cli.py)."""
