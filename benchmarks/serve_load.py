"""A bounded load test of `strata serve` on loopback: C concurrent clients x R requests each
against one server (the embedded model unless --model), streamed, each client asking again
when its answer is complete.

    python benchmarks/serve_load.py [--clients 8] [--requests 5] [--max-tokens 32] [--arena 300slots --moce-lambda 0]

Checks that every request completes, that its text equals `strata.generate` run sequentially
with the same settings, and that no request waited longer than the longest clients - 1 runs
(under FIFO no more can be ahead of it); prints requests/s, time to first token p50/p95, and peak RSS
before and after the load (one engine: memory must not grow with requests). A JSON line last.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import strata  # noqa: E402
from serve_support import live_server  # noqa: E402
from strata.default_model import default_model_path  # noqa: E402
from strata.serve import build_app  # noqa: E402

SNIPPETS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(", "for i in range(", "def parse(line):",
            "with open(path) as f:", "def merge(a, b):", "try:\n    import numpy"]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def stream_one(client: httpx.Client, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first, text, last = None, [], None
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
            last = chunk
    return {"text": "".join(text), "ttft": first if first is not None else time.perf_counter() - start,
            "seconds": time.perf_counter() - start, "queue_ms": last["strata"]["queue_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path (default: the embedded model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--arena", default="", help="stream experts through an arena of this size")
    ap.add_argument("--moce-lambda", type=float, default=None,
                    help="MoCE bonus; with experts streaming, λ > 0 makes an output depend on the arena's contents, "
                         "so on the requests before it: use 0 to compare with the sequential run")
    args = ap.parse_args(argv)
    model = strata.load(args.model or default_model_path())
    config = strata.Config(backend="numpy", arena=args.arena)
    if args.moce_lambda is not None:
        config = config.replace(moce_lambda=args.moce_lambda)
    bodies = [[{"model": model.model_path.stem, "prompt": SNIPPETS[(c + k) % len(SNIPPETS)],
                "max_tokens": args.max_tokens, "temperature": 0.0 if k % 2 == 0 else 0.8, "seed": 100 * c + k}
               for k in range(args.requests)] for c in range(args.clients)]
    t0 = time.perf_counter()
    expected = [[strata.generate(model, b["prompt"], max_tokens=b["max_tokens"], temperature=b["temperature"],
                                 seed=b["seed"], config=config).text for b in mine] for mine in bodies]
    sequential_s = time.perf_counter() - t0
    rss_before = peak_rss_mb()
    results: list[list[dict]] = [[] for _ in bodies]

    with live_server(build_app(model, config)) as url:
        def client(i: int) -> None:
            with httpx.Client(timeout=600) as c:
                for body in bodies[i]:
                    results[i].append(stream_one(c, url, body))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    n = args.clients * args.requests
    assert len(flat) == n, f"{len(flat)} of {n} requests completed"
    same = sum(r["text"] == e for rs, es in zip(results, expected) for r, e in zip(rs, es))
    service = sorted(r["seconds"] - r["queue_ms"] / 1e3 for r in flat)  # each request's own run, under load
    bound = sum(service[-(args.clients - 1):])  # FIFO: at most clients - 1 requests are ever ahead
    worst_wait = max(r["queue_ms"] for r in flat) / 1e3
    out = {
        "requests": n, "clients": args.clients, "max_tokens": args.max_tokens, "arena": args.arena or "budget rule",
        "moce_lambda": config.moce_lambda,
        "same_as_sequential": same, "requests_per_s": n / wall, "sequential_requests_per_s": n / sequential_s,
        "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in flat),
        "ttft_p95_ms": 1e3 * percentile([r["ttft"] for r in flat], 0.95),
        "latency_p95_ms": 1e3 * percentile([r["seconds"] for r in flat], 0.95),
        "ttft_after_queue_p50_ms": 1e3 * statistics.median(r["ttft"] - r["queue_ms"] / 1e3 for r in flat),
        "worst_queue_wait_ms": 1e3 * worst_wait, "fifo_bound_ms": 1e3 * bound,
        "service_p50_ms": 1e3 * statistics.median(service),
        "peak_rss_mb_before": rss_before, "peak_rss_mb_after": peak_rss_mb(),
    }
    print(f"{n} requests ({args.clients} clients x {args.requests}): {same} equal the sequential run; "
          f"{out['requests_per_s']:.2f} requests/s (sequential {out['sequential_requests_per_s']:.2f}); "
          f"time to first token p50 {out['ttft_p50_ms']:.0f} ms, p95 {out['ttft_p95_ms']:.0f} ms (after the queue: "
          f"p50 {out['ttft_after_queue_p50_ms']:.0f} ms); worst queue wait {out['worst_queue_wait_ms']:.0f} ms "
          f"(FIFO bound {1e3 * bound:.0f} ms); peak RSS "
          f"{rss_before:.0f} -> {out['peak_rss_mb_after']:.0f} MB")
    print(json.dumps(out, sort_keys=True))
    ok = same == n and worst_wait <= bound
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
