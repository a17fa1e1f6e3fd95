"""The command line the A/B comparisons share (bench/gdn_ab.py, bench/model_step_ab.py): the two sides' run files,
an output folder and labels in; the comparison's JSON (with every run it read) and markdown out, the markdown also
printed. A comparison that refuses its runs (ValueError) is reported by name and exits with status 2."""

import argparse
import json
import os
import sys


def load_runs(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def main(argv, description, stem, summarise):
    """summarise(base_runs, new_runs, labels) -> (the comparison's fields for STEM.json, the text of STEM.md)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", nargs="+", required=True, metavar="RUN.json")
    parser.add_argument("--new", nargs="+", required=True, metavar="RUN.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--label-base", default="base")
    parser.add_argument("--label-new", default="new")
    args = parser.parse_args(argv)

    base_runs, new_runs = load_runs(args.base), load_runs(args.new)
    labels = {"base": args.label_base, "new": args.label_new}
    try:
        fields, text = summarise(base_runs, new_runs, labels)
    except ValueError as error:
        print(f"{stem}: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump({"labels": labels, **fields, "base_runs": base_runs, "new_runs": new_runs}, f, indent=1)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0
