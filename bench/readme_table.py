"""Regenerates the README's `bench graphs` table from the newest results in bench/results/.

The `<date>-<gpu>-graphs-<commit>.json` of the most recent commit (graphed's variants) and the PyTorch file of the
same run (`…-graphs-torch-bf16-<commit>.json`) become one side-by-side table, written between the
README's `<!-- graphs-table -->` markers. Usage: python3 bench/readme_table.py
"""

import glob
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
GRAPHED = ["graphed-eager", "graphed", "graphed-side", "graphed-offload", "graphed-floor"]
TORCH = ["torch-eager", "torch-graphed", "torch-floor", "torch-compile"]
GOALS = {"S": 1.0, "M": 4.5, "L": 45.0}


def newest(pattern: str) -> str:
    """The file of the most recent commit in HEAD's history (file names end in `-<commit>`;
    modification times say nothing in a fresh clone)."""
    history = subprocess.run(["git", "rev-list", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    order = {c[:7]: i for i, c in enumerate(history.stdout.split())}
    files = [f for f in glob.glob(os.path.join(RESULTS, pattern)) if "-torch-" not in f]
    ranked = [(order[c], f) for f in files if (c := os.path.splitext(f)[0].rsplit("-", 1)[-1][:7]) in order]
    if not ranked:
        raise SystemExit(f"no results file of HEAD's history matches {pattern}")
    return min(ranked)[1]


def table() -> str:
    ours = newest("*-graphs-*.json")
    commit = json.load(open(ours))["commit"]
    torch_file = ours.replace("-graphs-", "-graphs-torch-bf16-")
    torch = {(r["config"], r["variant"]): r for r in json.load(open(torch_file))["rows"]}
    rows = {(r["config"], r["variant"]): r for r in json.load(open(ours))["rows"]}
    head = "| config | goal | " + " | ".join(GRAPHED + TORCH) + " | MiB held (graphed / torch-graphed) |"
    lines = [
        f"From `{os.path.basename(ours)}` and `{os.path.basename(torch_file)}` (commit {commit}, one run):"
        " wall ms per step, median of 20 after 5, `[…]` host µs to issue it.",
        "",
        head,
        "|" + "---|" * (len(GRAPHED) + len(TORCH) + 3),
    ]
    for config in ["S", "M", "L"]:
        if (config, "graphed") not in rows:
            continue
        cells = [f"{rows[(config, v)]['wall_ms']['median']:.3f} [{rows[(config, v)]['host_us']['median']:.0f}]"
                 if (config, v) in rows else "-" for v in GRAPHED]
        cells += [f"{torch[(config, v)]['wall_ms']:.3f} [{torch[(config, v)]['host_us']:.0f}]" if (config, v) in torch
                  else "-" for v in TORCH]
        mib = f"{rows[(config, 'graphed')]['reserved_bytes'] / 2**20:.0f} / " + (
            f"{torch[(config, 'torch-graphed')]['reserved_bytes'] / 2**20:.0f}" if (config, "torch-graphed") in torch
            else "-")
        lines.append(f"| {config} | {GOALS[config]} | " + " | ".join(cells) + f" | {mib} |")
    return "\n".join(lines)


def main() -> None:
    readme = os.path.join(ROOT, "README.md")
    text = open(readme).read()
    marked = re.compile(r"(<!-- graphs-table -->\n)(?:.*?\n)?(<!-- /graphs-table -->)", re.S)
    if not marked.search(text):
        raise SystemExit("README.md has no <!-- graphs-table --> markers")
    open(readme, "w").write(marked.sub(lambda m: m.group(1) + table() + "\n" + m.group(2), text))


if __name__ == "__main__":
    main()
