"""The command-line entry points, each run as `python -m scripts.NAME`."""
