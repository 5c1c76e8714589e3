"""The float16 KV cache's cost in quality (issue 19), measured with the quality tools
(strata/tools/kv_quality.py): KLD(P_f32 || P_f16) of the next-token distributions in decode
order, and the perplexity under both, on the embedded model (trained on Python source) over its
held-out text. Prints a table and one JSON line.

    python benchmarks/kv_precision.py                  # 256 tokens of strata/data/heldout.txt
    python benchmarks/kv_precision.py --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.default_model import EMBEDDED  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.reference.attention import KVPrecision  # noqa: E402
from strata.tools.kv_quality import kv_quality  # noqa: E402
from strata.tools.quality import fast_params  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    model = load(EMBEDDED)
    text = (EMBEDDED.parent / "heldout.txt").read_text()
    tokens = model.tokenizer.encode(text)[:min(args.tokens, model.cfg.max_context)]
    t0 = time.time()
    q = kv_quality(fast_params(model.resident_params()), tokens, KVPrecision.F16, warmup=args.warmup)
    res = {k: (v.value if isinstance(v, KVPrecision) else v) for k, v in asdict(q).items()}
    res.update({"model": EMBEDDED.name, "tokens": len(tokens), "seconds": time.time() - t0})
    print(f"## float16 KV cache vs float32 on {EMBEDDED.name} ({len(tokens)} tokens of heldout.txt, "
          f"scored from position {args.warmup}, decode order)")
    print(f"KLD mean / p90 / p99 / max   {q.kld_mean:.3g} / {q.kld_p90:.3g} / {q.kld_p99:.3g} / {q.kld_max:.3g} nats")
    print(f"perplexity f32 / f16         {q.ppl_f32:.4f} / {q.ppl:.4f}")
    print(f"same most likely next token  {q.argmax_agree:.2%}")
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
