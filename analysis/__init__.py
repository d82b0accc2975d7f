"""
Figures and tables of residual geometry, attention sinks and confidence, from checkpoints.

Figures and tables from checkpoints: the residual-stream geometry, attention sinks and confidence of the NAG
paper (arXiv:2606.16112, Figs. 3-7 and 12, Tables III-IV) measured on GPT and NAG runs side by side.

    capture.py   one streaming no-grad pass that observes a model's own forward
    measures.py  the measures, small pure functions on tensors
    summary.py   capture → the numbers of analysis.json
    figures.py   the PNG figures
    report.py    analysis.md, beside the published numbers
    run.py       the command: python -m analysis RUN [RUN ...]
    compare/     the comparison reports of scripts.compare (a pair, or two groups of seeds)
"""
