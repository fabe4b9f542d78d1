"""The summary table of one gpu_all.sh call: every figure from the SUMMARY lines of its logs, and
the ratios the goals of issue 12 are stated in (train_draft end to end over the peer's step, peak
memory over the peer's, extraction over the forward ceiling measured in the same process).

    python benchmarks/gpu_summary.py OUT_DIR
"""

import json
import sys
from pathlib import Path


def summaries(out):
    rows = {}
    for log in sorted(Path(out).glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("SUMMARY "):
                rows[log.stem] = json.loads(line[len("SUMMARY "):])
    return rows


def main(out):
    parts = summaries(out)
    peer = {(r["size"], r["ttt"]): r for r in parts.get("peer", [])}
    lines = ["| what | size | TTT | tokens/s | MFU | peak GiB | vs peer tok/s (goal >= 1.3) | vs peer peak (goal <= 1.5) |",
             "|---|---|---|---|---|---|---|---|"]

    def add(label, r):
        p = peer.get((r.get("size"), r.get("ttt")))
        ratio = f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" if p else "-"
        mem = f"{r['peak_gib'] / p['peak_gib']:.2f}x" if p and r.get("peak_gib") and p.get("peak_gib") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"| {label} | {r.get('size')} | {r.get('ttt')} | {r['tokens_per_s']:,} | {mfu} | {r.get('peak_gib')} | {ratio} | {mem} |")

    for name in sorted(parts):
        if name.startswith("e2e"):
            for r in parts[name]:
                add(r["impl"].replace("eaglenest train_draft e2e", "eaglenest train_draft end to end"), r)
    for r in parts.get("step", []) + parts.get("step_profile", []):
        add("eaglenest step only (" + r["impl"].replace("eaglenest-step-", "") + ")", r)
    for r in parts.get("peer", []):
        add(r["impl"], r)
    for r in parts.get("step_profile", []):
        prof = r.get("profile") or {}
        lines.append("")
        lines.append(f"profile {r['size']}: device ms/step {prof.get('device_ms_per_step')} by kind {json.dumps(prof.get('ms_per_step_by_kind'))}")
    for r in parts.get("extract", []):
        lines.append("")
        lines.append(f"extraction: {r['tokens_per_s']:,} tok/s, forward ceiling (same process) {r['forward_tokens_per_s']:,} tok/s, "
                     f"ratio {r['ratio_to_forward']:.2f} (goal >= 0.80); flop util {r['flop_util']:.1%}, "
                     f"write {r['write_gib_per_s']} GiB/s, peak {r['peak_gib']} GiB")
    missing = [p for p in ("e2e_llama8b", "e2e_kimi", "step", "peer", "extract") if p not in parts]
    if missing:
        lines.append("")
        lines.append(f"no SUMMARY from: {missing} (see their logs)")
    text = "\n".join(lines)
    print(text)
    (Path(out) / "summary.md").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
