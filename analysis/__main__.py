"""`python -m analysis`: runs the analysis command (analysis/run.py)."""

from analysis.run import main

main()
