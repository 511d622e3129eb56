"""Draws ``benchmarks/results/feature_draft.json`` (the probe's measured numbers) as its PNG."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parents[2] / "results"
rows = json.load(open(str(RESULTS / "feature_draft.json")))["runs"]
sets = ["heldout", "heldout_greedy", "self_prompts"]
fig, axes = plt.subplots(1, 2, figsize=(11, 5))
for ax, metric, bar in zip(axes, ["greedy_agreement", "expected_acceptance"], [0.55, 0.5]):
    w = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([j + i * w for j in range(len(sets))], [r[s][metric] for s in sets], w, label=r["label"])
    ax.axhline(bar, color="k", ls="--", lw=1, label=f"issue 5 bar ({bar})")
    ax.set_xticks(
        [j + 0.4 - w / 2 for j in range(len(sets))], ["held-out sampled", "held-out greedy", "self-written sampled"]
    )
    ax.set_title(metric.replace("_", " "))
    ax.set_ylim(0, 0.7)
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=3)
fig.suptitle("SmolLM2-135M drafts after ~1500 steps on the same 3000 records: LLaMA layers vs feature draft (EAGLE-1)")
fig.tight_layout(rect=(0, 0.14, 1, 1))
fig.savefig(str(RESULTS / "feature_draft.png"), dpi=110)
