"""
The comparison reports of scripts.compare, which reads each run through nanochat.run_dir:

    runs.py     what the report reads off the runs: curves, scores, what the numbers were measured with
    inputs.py   what a report is made from (inputs.json) and the folder it goes into
    tables.py   the markdown: cells, tables, verdicts in words, the sections of a pair's report
    figures.py  the PNG figures of a pair's report
    pair.py     runs against the first one, with paired intervals: compare()
    groups.py   two groups of seeds: compare_groups()

Each module imports only those above it.
"""
