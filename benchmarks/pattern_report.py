"""The pattern suite as a table: each attention/MLP spelling of tests/support/pattern_models.py at tp 2 and 4.

    python benchmarks/pattern_report.py            # writes benchmarks/results/patterns.{json,md}

For each spelling and tp: max |Δ| of loss and gradients against the unsharded model, max |Δ| of the
parameters after 3 AdamW steps (fp32), the all-reduces of one training step (forward, backward) and the
blocks left replicated (none expected). The same workers as ``tests/analysis/test_patterns.py``.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "support")]


def main() -> None:
    from ranks import launch
    from parity_workers import pattern_parity
    from pattern_models import KINDS

    rows = []
    for tp in (2, 4):
        results = launch(pattern_parity, tp, list(KINDS))
        for kind in KINDS:
            per_rank = [results[r][kind] for r in results]
            rows.append({
                "pattern": kind, "tp": tp,
                "loss_grad": max(max(r["loss_diff"], r["grad_diff"]) for r in per_rank),
                "params": max(r["param_diff"] for r in per_rank),
                "forward": len(per_rank[0]["forward"]), "backward": len(per_rank[0]["backward"]),
                "replicated": sorted({m for r in per_rank for m, _ in r["replicated"]}),
                "kv_replicated": bool(per_rank[0]["kv_replicated"]),
            })
    out = os.path.join(HERE, "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "patterns.json"), "w") as f:
        json.dump(rows, f, indent=2)
    lines = ["| pattern | tp | max loss/grad diff | param diff after 3 AdamW | fwd all-reduces | bwd all-reduces | "
             "kv heads replicated | left replicated |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pattern']} | {r['tp']} | {r['loss_grad']:.1e} | {r['params']:.1e} | {r['forward']} | "
                     f"{r['backward']} | {'yes' if r['kv_replicated'] else '—'} | {', '.join(r['replicated']) or '—'} |")
    with open(os.path.join(out, "patterns.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
