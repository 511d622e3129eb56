"""The edge benchmark's markdown report and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.edge_cpu import REFERENCE_GRAPH, WORKLOADS
from benchmarks.edge_cpu.matched import matched_table
from specdec.bench.figures import figure

# -- the report ------------------------------------------------------------------------------


def _cell(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _agreement_cell(a: dict[str, Any] | None) -> str:
    if not a or a.get("chat") is None:
        return "–"
    return " / ".join(f"{a[n]['identical']:.0%} ({a[n]['prefix']:.0%})" for n in WORKLOADS)


def identical_cell(a: dict[str, Any] | None) -> str:
    if not a or a.get("chat") is None:
        return "–"
    return " / ".join(f"{a[n]['identical']:.0%}" for n in WORKLOADS)


def results_table(doc: dict[str, Any]) -> list[str]:
    """The main table: tokens/s per workload, ratios vs llama-server batch 1, TTFT, RSS, agreement, prompts."""
    lines = [
        "| contestant | batch | chat tok/s | extractive tok/s | mix tok/s | chat / llama-server | "
        "extractive / llama-server | mix / llama-server | TTFT ms (chat / extr.) | peak RSS MB | load s | "
        "agreement with fp32 ar: identical (prefix), chat / extr. | = own without speculation, chat / extr. | "
        "acceptance | prompt ids as given |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|:---|---:|:---|",
    ]
    for r in doc["results"].values():
        batch = f"{r['batch']}"
        if "error" in r:
            lines.append(f"| {r['label']} | {batch} | {r['error'][:160]} |" + " |" * 12)
            continue
        differ = r.get("prompt_ids_differ")
        seen = "–" if differ is None else ("yes" if differ == 0 else f"NO ({differ} differ)")
        tps, over = r["tokens_per_second"], r["over_llama"]
        lines.append(
            f"| {r['label']} | {batch} | {_cell(tps['chat'])} | {_cell(tps['extractive'])} | {_cell(tps['mix'])} | "
            + " | ".join(_cell(over[k], "{:.2f}×") for k in (*WORKLOADS, "mix"))
            + f" | {r['ttft_ms']['chat']:.0f} / {r['ttft_ms']['extractive']:.0f} | {r['peak_rss_mb']:.0f} | "
            f"{r['load_seconds']:.1f} | {_agreement_cell(r.get('agreement'))} | "
            f"{identical_cell(r.get('identical_to_own_ar'))} | {_cell(r.get('acceptance_rate'), '{:.2f}')} | {seen} |"
        )
    return lines


def _near_tie_cell(w: dict[str, Any]) -> str:
    t = w.get("near_ties")
    if not t:
        return "–"
    if not t["misses"]:
        return "0"
    return f"{t['misses']}: {t['median']:.2f} / {t['p90']:.2f} / {t['max']:.2f}"


def forced_table(forced: dict[str, dict[str, Any]]) -> list[str]:
    """Next-token agreement with the reference along its answers, one row per model, and how sure the reference
    was where each model chose otherwise (nothing without them)."""
    if not forced:
        return []
    lines = [
        "### Next-token agreement with specdec fp32 `ar` along its answers, and held-out perplexity",
        "",
        "Each position of the reference answers (specdec fp32 `ar`, batch 1), judged on the reference's own "
        "prompt and answer so far: the share where the model's greedy choice is the reference's token "
        "(teacher forcing; `forced_agreement`). Unlike the identical-answer rate above, one near-tie flips one "
        "position, not the rest of an answer. *Misses*: the positions where the model chose otherwise, with "
        f"the reference graph's ({REFERENCE_GRAPH}, forced the same way) margin of its token over its "
        "runner-up there, in logits (median / 90th percentile / max; `miss_margins`): beside the median margin "
        "over all positions, it says whether the choices part where the reference itself was near a tie. "
        "*Perplexity*: of held-out text, standard-library module docstrings no workload uses, 256 tokens each at "
        "most (`specdec.bench.workloads.held_out_documents`, what `benchmarks.quantize_quality` scores); "
        "specdec fp32's is the reference's.",
        "",
        "| model | chat | extractive | positions | perplexity | misses: reference margin, chat | misses: reference "
        "margin, extractive | reference margin, all positions (median) |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in forced.items():
        if "error" in row:
            lines.append(f"| {label} | {row['error'][:160]} | | | | | | |")
            continue
        everywhere = [row[n].get("near_ties", {}).get("median_all") for n in WORKLOADS]
        lines.append(
            f"| {label} | "
            + " | ".join(_cell(row[n]["rate"], "{:.1%}") for n in WORKLOADS)
            + f" | {' / '.join(str(row[n]['positions']) for n in WORKLOADS)} | "
            + f"{_cell(row.get('perplexity'), '{:.3f}')} | "
            + " | ".join(_near_tie_cell(row[n]) for n in WORKLOADS)
            + " | "
            + " / ".join(_cell(m, "{:.2f}") for m in everywhere)
            + " |"
        )
    return [*lines, ""]


def _export_line(precision: str, export: dict[str, Any]) -> str:
    """How one precision's export was made (or why it is missing) and the prices its calibration measured."""
    if "dir" not in export:
        return f"- {precision}: {export['error']}"
    made = f"reused, made {export.get('created')}" if export.get("reused") else f"made in {export.get('seconds')} s"
    cal = export.get("calibration") or {}
    prices = (
        (
            f"; calibrated: a draft token costs {cal.get('draft_cost')} and a verified row {cal.get('verify_cost')} "
            "of a target step"
        )
        if cal
        else ""
    )
    draft, verify = (dict(map(tuple, cal.get(key) or [])) for key in ("draft_cost_by_batch", "verify_cost_by_batch"))
    if draft or verify:  # what greedy requests are priced by (the flat prices above are their medians)
        prices += "; per batch size (draft / row): " + ", ".join(
            f"B={b} {_cell(draft.get(b), '{:.3f}')} / {_cell(verify.get(b), '{:.3f}')}"
            for b in sorted({*draft, *verify})
        )
    return f"- {precision}: `{export['command']}` ({made}){prices}"


def _peer_line(name: str, info: dict[str, Any]) -> str:
    """How one peer model was made (or why it is missing)."""
    if "error" in info:
        return f"- {name}: {info['error']}"
    post = f"; then {info['post']}" if info.get("post") else ""
    return f"- {name}: `{info['command']}`{post} (made {info.get('created')})"


def markdown_report(doc: dict[str, Any]) -> str:
    meta, cfg = doc["meta"], doc["meta"]["config"]
    machine = meta["machine"]
    exports = [_export_line(p, e) for p, e in meta["exports"].items()]
    peers = [_peer_line(name, info) for name, info in (meta.get("peer_models") or {}).items()]
    lines = [
        "# Edge CPU: specdec exports vs llama-server, ONNX Runtime GenAI, OpenVINO GenAI and HF, SmolLM2-135M-Instruct",
        "",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}` (total {meta['elapsed_seconds']:.0f} s)",
        f"- Model: {meta['gguf']} (llama-server runs it as Q4_1, and its F32 requantisation as the faithful row; "
        "HF, the specdec fp32 export and the peers' converters start from its fp32 conversion; specdec int4 holds "
        "the file's own Q4_1 / Q8_0 blocks, int8 holds the same Q4_1 blocks exactly in 8-bit codes (a tensor "
        "keeps its source's weights when the source has fewer bits than asked), so int4 and int8 differ in the "
        "kernel that runs them, not in the weights; both at int8 activations and over fp16 KV caches, the "
        "quantized exports' defaults, as llama-server's "
        "caches are fp16; the *fp32 caches* rows run the same graphs over fp32 caches; specdec w8a8 rounds the "
        "decoder layers' weights again, to int8 per output channel, and its activations to int8 per token, "
        "smoothed on calibration prompts, for ONNX Runtime's integer GEMM (`specdec.export.w8a8`), its head and "
        "table the int8 export's, over fp16 caches; specdec int4-f32 computes int4's blocks at fp32 activations "
        "(`--quantize-activations fp32`, its 8-bit head an fp32 Gemm) over fp32 caches: the fp32 model's weights "
        "exactly; specdec int4-rtn rounds the fp32 conversion to int4 blocks "
        "again, as ONNX Runtime GenAI's model builder does (`--quantize-from fp32`), over fp32 caches as its are; "
        "specdec int4-cal128 rounds them in blocks of 128, each block's range calibrated on the inputs it "
        "multiplies (`--quantize-from calibrated --quantize-block-size 128`, the head in blocks of 32), over fp32 "
        "caches)",
        f"- Greedy, {cfg['max_tokens']} new tokens at most per request (EOS ends earlier), {cfg['threads']} threads "
        f"for every contestant (llama-server -t/-tb, ONNX Runtime intra-op for ORT GenAI and specdec, whose engine "
        "imports no torch, INFERENCE_NUM_THREADS for OpenVINO, torch intra-op for HF)",
        f"- Workloads: *chat*, {cfg['prompts']} requests of kinds absent from the draft's distillation prompts; "
        f"*extractive*, the first {cfg['prompts']} prompts of `build_workload` (summarise / list the points of a "
        "standard-library docstring); *mix*: both (all tokens / all seconds). Prompt tokens: "
        + ", ".join(f"{n} {lo}-{hi}" for n, (lo, hi) in meta["prompt_tokens"].items()),
        f"- specdec ems: adaptive draft length, at most k = {cfg['ngram_k']} (n-gram, hybrid) / {cfg['draft_k']} "
        "(draft model), priced by the export's calibration (the n-gram drafter's draft tokens cost 0, its own price)",
        f"- HF prompt lookup: `prompt_lookup_num_tokens={cfg['lookup_tokens']}` at batch 1",
        f"- Timing: median of {cfg['repeats']} interleaved repeat(s), each contestant a fresh subprocess per repeat",
        f"- Machine: {machine['processor']}, {machine['cpu_count']} cores, {machine['platform']}, Python "
        f"{machine['python']}, torch {machine['torch']}; versions {meta['versions']}",
        f"- Load average (1, 5, 15 min): {meta['load_before']} before, {meta['load_after']} after",
        "",
        "Exports:",
        "",
        *exports,
        "",
        "Peers (each in its own venv, `bash benchmarks/peers/install.sh`; models made by "
        "`python -m benchmarks.peers.convert`, commands run in the peers folder):",
        "",
        *peers,
        f"- llama-server's n-gram speculation: `--spec-type ngram-simple`, n-gram / m-gram {cfg.get('llama_ngram')}; "
        f"OpenVINO prompt lookup: {cfg.get('openvino_lookup')}; the faithful OpenVINO row's CPU plugin settings: "
        f"{cfg.get('openvino_faithful')}",
        "",
        "## Results",
        "",
        *results_table(doc),
        "",
        *forced_table(doc.get("next_token_agreement") or {}),
        *matched_table(doc["results"], doc.get("next_token_agreement") or {}),
        "## How to read this",
        "",
        "- *tok/s*: new tokens (EOS not counted) / wall seconds of the generation calls, detokenisation included, "
        "loading and warm-up not; for a batch the aggregate over its sequences (llama-server: B concurrent "
        "requests to B slots; ORT GenAI: one left-padded batch; OpenVINO: B requests to its continuous-batching "
        "pipeline). The ratios of every row are to llama-server Q4_1 at batch 1.",
        "- *TTFT*: specdec, first `on_tokens` event of the timed call; everyone else, a separate one-token call "
        "of the same batch. For a batch: the first token of any sequence.",
        "- *peak RSS*: the VmHWM of the process that holds the model (each contestant runs alone in a fresh "
        "process; llama-server's own), the highest over repeats. *load s*: opening the model (a server: until it "
        "answers /health; specdec: verifying the export's checksums too).",
        "- *agreement*: share of prompts whose answer (token ids) equals specdec fp32 ar at batch 1, and in "
        "brackets the mean share of the reference answer repeated before the first difference. *= own without "
        "speculation*: the share of answers identical to those of the same model and batch without speculation "
        "(specdec ems vs ar; llama-server n-gram and OpenVINO prompt lookup vs their plain row): greedy "
        "speculation must reproduce them.",
        "- *prompt ids as given*: every engine gets the prompts as token ids (specdec's chat template applied "
        "once) and reports the ids it decoded from (the generator's sequence, the pipeline's input tensors, "
        "llama-server's count of evaluated prompt tokens); a difference would make a template look like speed.",
        "- No contestant reuses a previous call's prefill (llama-server: `cache_prompt` off; OpenVINO: no prefix "
        "caching).",
        "",
        "## Notes",
        "",
        *(f"- {n}" for n in meta["notes"]),
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Tokens/s bars per contestant, one panel per workload, with llama-server batch 1's line."""
    rows = [r for r in doc["results"].values() if "error" not in r]
    labels = [f"{r['label']} B={r['batch']}" for r in rows]
    colors = {"peer": "tab:red", "hf": "tab:orange", "specdec": "tab:blue"}
    base = doc["results"].get(doc["meta"]["baseline"], {}).get("tokens_per_second")
    with figure(path, 1, 3, figsize=(15, 0.32 * len(rows) + 1.8), sharey=True, squeeze=False) as (fig, axes):
        for ax, name in zip(axes[0], (*WORKLOADS, "mix")):
            values = [r["tokens_per_second"][name] or 0 for r in rows]
            ax.barh(range(len(rows)), values, color=[colors[r["kind"]] for r in rows])
            for i, (r, value) in enumerate(zip(rows, values)):
                ratio = r.get("over_llama", {}).get(name)
                if ratio is not None:
                    ax.annotate(
                        f"{ratio:.2f}×", (value, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7
                    )
            if base and base.get(name):
                ax.axvline(base[name], color="tab:red", linestyle="--", linewidth=1, label="llama-server Q4_1 batch 1")
                ax.legend(fontsize=8, loc="lower right")
            ax.margins(x=0.12)  # room for the ratio labels
            ax.set(
                title="mix (both workloads)" if name == "mix" else f"{name} workload",
                xlabel="tokens / s (batch aggregate); labels: × llama-server batch 1",
            )
            ax.grid(axis="x", alpha=0.3)
        axes[0][0].set_yticks(range(len(rows)), labels, fontsize=7)
        axes[0][0].invert_yaxis()
        cfg = doc["meta"]["config"]
        fig.suptitle(
            f"SmolLM2-135M-Instruct on CPU, {cfg['threads']} threads, greedy, {cfg['max_tokens']} new tokens, "
            f"median of {cfg['repeats']}",
            fontsize=10,
        )
