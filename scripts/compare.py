"""
Compare training runs, typically a FLOP-matched GPT / NAG pair: one markdown report plus figures.

    python -m scripts.compare gpt-tiny nag-tiny
    python -m scripts.compare gpt-tiny nag-tiny --out /tmp/nag-chat-report
    python -m scripts.compare --a gpt-s1 gpt-s2 gpt-s3 --b nag-s1 nag-s2 nag-s3   # groups of seeds: analysis/compare/groups.py

Each RUN is a run name under $NANOCHAT_BASE_DIR/runs or a path to a run directory, each given once (a run
compared with itself, or listed twice in a group, is refused). Reads config.json, metrics.jsonl and (if
base_eval has run) eval.json, eval/step_*.json and core_records.parquet of each; writes report.md, PNG figures
and inputs.json (what the report was made from, and the files it wrote) into --out. The default,
$NANOCHAT_BASE_DIR/reports/<run1>@<step>_vs_<run2>@<step>, is named after the runs and their evaluated steps
only, so a report there of other inputs (other run directories of the same names, a re-evaluation) is never
replaced: compare stops and asks for --out. Into a folder of its own (its inputs.json lists the files) compare
writes again, moving an earlier report of other inputs to replaced/ first, and any file it wrote that was changed
since (inputs.json keeps each one's sha256: an edited report.md) too, with a note; a folder holding any file it did
not write is refused unless --force. The report is made in a temp folder and moved in whole (a full disk: one line).

Every delta against the first run comes with a paired 95% bootstrap interval (nanochat/stats.py):
CORE resampled over items within each task, val bpb over the shared evaluation batches, each only
with enough of them (stats.MIN_UNITS). Runs evaluated on different CORE items or settings are
refused; runs whose val bpb was measured with another tokenizer, val data, number of val tokens or
of processes, or that were trained on other data, get both numbers, the reason, and no interval.
A p-value below 1/N (N resamples) is written "p < 1/N", never 0.
The command only parses its arguments: the reports are made in analysis/compare/.
"""

import argparse

from nanochat.common import exit_on_user_error, parse_checked, fraction
from analysis.compare.pair import compare


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Compare training runs (e.g. a FLOP-matched GPT / NAG pair): report.md + figures."
    )
    p.add_argument(
        "runs", nargs="*", metavar="RUN", help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory"
    )
    p.add_argument(
        "--a", nargs="+", metavar="RUN", default=None, help="group a: runs of one model that differ only in their seeds"
    )
    p.add_argument(
        "--b",
        nargs="+",
        metavar="RUN",
        default=None,
        help="group b, compared with group a (analysis/compare/groups.py)",
    )
    p.add_argument(
        "--out",
        type=str,
        default=None,
        help="output directory; an earlier report of other inputs there moves to its replaced/ "
        "(default: $NANOCHAT_BASE_DIR/reports/<run1>@<step>_vs_<run2>@<step>, "
        "never replacing a report of other inputs)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that holds files compare did not write (its files of the names written are replaced)",
    )
    p.add_argument(
        "--ema",
        type=fraction(top_open=True),
        default=0.95,
        help="EMA factor that smooths the train loss curve, in [0, 1) (0: unsmoothed)",
    )
    p.add_argument(
        "--mixed-precision",
        action="store_true",
        help="compare an fp8 run (base_train --fp8) with a bf16 one (refused otherwise)",
    )
    args = parse_checked(p, argv)
    if args.a is not None or args.b is not None:  # two groups of seeds: their own report
        if args.a is None or args.b is None or args.runs:
            p.error("give both --a RUN... and --b RUN..., and no positional runs")
        from analysis.compare.groups import compare_groups  # imports nag's settings list only when asked for

        with exit_on_user_error():
            return compare_groups(args.a, args.b, args.out, args.force, args.mixed_precision)
    if not args.runs:
        p.error("give the runs to compare, or two groups with --a RUN... --b RUN...")
    with exit_on_user_error():
        return compare(args.runs, args.out, args.ema, args.force, args.mixed_precision)


if __name__ == "__main__":
    main()
