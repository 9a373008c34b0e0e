#!/usr/bin/env python
"""``specexec serve`` under concurrent clients: aggregate and per-request tokens/s, time to first token.

Starts ``specexec serve`` (the real command, a subprocess) once per ``--parallel`` setting and drives it with the
official ``openai`` client. One workload: ``--requests`` chat requests (distinct prompts of this script's own,
code and prose, greedy, ``--max-tokens`` each), taken from one shared queue by 1, 2, 4 and 8 concurrent clients
(``--clients``). The same requests at every client count, so the wall times compare directly: the 1-client row is
the requests one after another.

Reported per (parallel, clients): wall seconds, aggregate tokens/s (all completion tokens over the wall time) and
its ratio to the 1-client row of the same server, per-request decode tokens/s (tokens after the first over the
time after the first token) as min / median / max and the min/max ratio of the requests that ran beside others
(fair shares), time to first token (median, max), and the server's resident memory after the row (rows of
interleaved conversations one after another: memory that stays flat does not creep).

Exactness: greedy answers must be the same text at every client count and every --parallel (each request's
answer is its solo answer); a difference is counted as a mismatch (exit 1).

Resent conversation: with the last server, conversation A (a long prompt) is answered, then a different
conversation B, then A again with one more turn; reported: A's first time to first token and the resent one's,
and their ratio (the prefix cache and the lanes' kept conversations make the resend skip A's prefill).

    python scripts/bench_server.py --out bench_out/server.json --md bench_out/server.md
    python scripts/bench_server.py --parallel 1,4 --clients 1,2,4,8 --requests 8 --max-tokens 96

``--smoke`` (with tiny models given by --target/--draft) checks the script's logic and measures nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from scripts.bench_cpu import DRAFT, TARGET, _f, git_commit, save  # noqa: E402

PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring.",
    "Explain in a few sentences how a hash map handles collisions.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory, and explain it.",
    "What is the difference between a process and a thread? Answer briefly.",
    "Write a JavaScript function that debounces another function, with a short usage example.",
    "Summarise the main idea of binary search and when it cannot be used.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Describe what a context manager is in Python and write a small one that times a block.",
    "Write a Rust function that reverses the words of a sentence.",
    "Give three tips for writing readable commit messages.",
)


def long_prompts(items: int) -> tuple[str, str]:
    """Two long first messages of different conversations (a module to read, meeting notes)."""
    a = "Here is a module I am working on:\n\n" + "\n".join(
        f"def step_{i}(x):\n    return x * {i} + {i * i} - step_{max(i - 1, 0)}(x // 2)\n" for i in range(items)
    )
    b = "Notes from the meeting:\n\n" + "\n".join(
        f"- Item {i}: the team agreed to revisit topic {i * 7 % 13} next week and to share the numbers by Friday."
        for i in range(items)
    )
    return a, b


URL = re.compile(r"listening on (http://\S+?)[ ,(]")


class Server:
    """``specexec serve`` as a subprocess on a free port, until :meth:`stop`."""

    def __init__(self, args: argparse.Namespace, parallel: int) -> None:
        main = "import sys; from specexec.cli import main; sys.argv[0] = 'specexec'; sys.exit(main())"
        cmd = [sys.executable, "-c", main, "serve", "--target", args.target, "--port", "0", "--quiet",
               "--parallel", str(parallel), "--device", args.device, "--context", str(args.context)]  # fmt: skip
        if args.draft:
            cmd += ["--draft", args.draft]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.url = ""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            m = URL.search(line)
            if m:
                self.url = m.group(1)
                break
        if not self.url:
            raise SystemExit(f"specexec serve did not start (exit {self.proc.wait()})")
        threading.Thread(target=self._drain, daemon=True).start()
        import httpx

        deadline = time.monotonic() + args.load_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"specexec serve exited while loading (exit {self.proc.returncode})")
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit("specexec serve did not load the models in time")
            time.sleep(1)
        self.health = httpx.get(self.url + "/health", timeout=10).json()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "Traceback" in line or "ERROR" in line:
                sys.stderr.write("server: " + line)

    def rss_gb(self) -> float | None:
        try:
            import psutil

            return psutil.Process(self.proc.pid).memory_info().rss / 1e9
        except Exception:  # noqa: BLE001 - a report field, not a reason to stop
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def ask(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat request through the openai client: its text, tokens and timings."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    tokens = 0
    stream = client.chat.completions.create(
        model="any", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
    end = time.perf_counter()
    first = first or end
    return {"text": "".join(parts), "tokens": tokens, "start": t0, "first": first, "end": end}


def run_clients(url: str, clients: int, requests: list[str], max_tokens: int) -> dict[str, Any]:
    """``requests`` taken from one queue by ``clients`` threads; the row of the table."""
    todo = list(enumerate(requests))
    lock = threading.Lock()
    done: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, prompt = todo.pop(0)
            try:
                done[i] = ask(url, [{"role": "user", "content": prompt}], max_tokens)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"a request failed: {errors[0]}")
    res = [done[i] for i in range(len(requests))]
    rates = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in res if r["tokens"] > 1 and r["end"] > r["first"]]
    # requests that ran beside another for most of their decoding: their shares should be fair
    beside = [
        (r["tokens"] - 1) / (r["end"] - r["first"])
        for r in res
        if r["tokens"] > 1 and r["end"] > r["first"] and _overlap(r, res) >= 0.5
    ]
    ttft = [r["first"] - r["start"] for r in res]
    total = sum(r["tokens"] for r in res)
    return {
        "clients": clients,
        "wall_s": wall,
        "tokens": total,
        "aggregate_tok_s": total / wall,
        "per_request_tok_s": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)}
        if rates
        else None,
        "fair_share_min_over_max": (min(beside) / max(beside)) if len(beside) > 1 else None,
        "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
        "texts": [r["text"] for r in res],
    }


def _overlap(r: dict[str, Any], res: list[dict[str, Any]]) -> float:
    """The share of r's decoding during which another request was decoding too."""
    span = r["end"] - r["first"]
    if span <= 0:
        return 0.0
    edges = sorted({r["first"], r["end"], *(x for o in res if o is not r for x in (o["first"], o["end"]))})
    shared = 0.0
    for a, b in zip(edges, edges[1:]):
        if a >= r["first"] and b <= r["end"] and any(o is not r and o["first"] <= a and o["end"] >= b for o in res):
            shared += b - a
    return shared / span


def resend(url: str, max_tokens: int, items: int) -> dict[str, Any]:
    """A long conversation, another one, then the first again with one more turn: the resent one's time to first
    token against its first prefill's."""
    long_a, long_b = long_prompts(items)
    a = [{"role": "user", "content": long_a + "\n\nWhat does step_3 return for x = 10?"}]
    first = ask(url, a, max_tokens)
    ask(url, [{"role": "user", "content": long_b + "\n\nList the items about topic 3."}], max_tokens)
    again = a + [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And for x = 11?"}]
    second = ask(url, again, max_tokens)
    t1, t2 = first["first"] - first["start"], second["first"] - second["start"]
    return {"first_ttft_s": t1, "resent_ttft_s": t2, "ratio": t2 / t1 if t1 > 0 else None}


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    out = [
        f"### specexec serve, {m['requests']} greedy chat requests of up to {m['max_tokens']} tokens",
        "",
        f"Target {m['target']}, draft {m['draft']}, device {m['device']}, commit {m['commit']}; "
        f"`python scripts/bench_server.py {m['argv']}`",
        "",
        "| --parallel | clients | wall s | aggregate tok/s | vs 1 client | per request tok/s min / med / max | "
        "fair min/max | TTFT med / max s | RSS GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        base = run["rows"][0]["aggregate_tok_s"]
        for r in run["rows"]:
            pr = r["per_request_tok_s"] or {}
            out.append(
                f"| {run['parallel']} | {r['clients']} | {r['wall_s']:.1f} | {r['aggregate_tok_s']:.2f} | "
                f"{r['aggregate_tok_s'] / base:.2f}x | {_f(pr.get('min'))} / {_f(pr.get('median'))} / "
                f"{_f(pr.get('max'))} | {_f(r['fair_share_min_over_max'])} | {r['ttft_s']['median']:.2f} / "
                f"{r['ttft_s']['max']:.2f} | {_f(r['rss_gb'])} |"
            )
    rs = report.get("resend")
    if rs:
        out += ["", f"Resent conversation: first TTFT {rs['first_ttft_s']:.2f} s, resent after another "
                    f"conversation {rs['resent_ttft_s']:.2f} s ({_f(rs['ratio'])}x)."]  # fmt: skip
    out += ["", f"Greedy answers differing across client counts and --parallel: {report['mismatches']}."]
    return "\n".join(out) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT, help="'' for none")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--parallel", default="1,4", help="the --parallel settings, comma-separated")
    ap.add_argument("--clients", default="1,2,4,8", help="client counts, comma-separated (1 first: the baseline)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-resend", action="store_true", help="skip the resent-conversation check")
    ap.add_argument("--load-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny models: check the flow, measure nothing")
    args = ap.parse_args(argv)
    try:
        args.parallel_list = [int(x) for x in args.parallel.split(",")]
        args.client_list = [int(x) for x in args.clients.split(",")]
    except ValueError:
        ap.error("--parallel and --clients take comma-separated integers")
    if min(args.parallel_list) < 1 or min(args.client_list) < 1 or args.client_list[0] != 1:
        ap.error("--parallel and --clients must be >= 1, and --clients must start with 1 (the baseline)")
    if not 1 <= args.requests <= len(PROMPTS) or args.max_tokens < 1:
        ap.error(f"--requests must be in 1..{len(PROMPTS)} and --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    requests = list(PROMPTS[: args.requests])
    report: dict[str, Any] = {
        "meta": {
            "target": args.target, "draft": args.draft or None, "device": args.device, "commit": git_commit(),
            "requests": args.requests, "max_tokens": args.max_tokens, "smoke": args.smoke,
            "argv": " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "runs": [],
    }  # fmt: skip
    reference: list[str] | None = None
    mismatches = 0
    for i, par in enumerate(args.parallel_list):
        srv = Server(args, par)
        try:
            ask(srv.url, [{"role": "user", "content": "Hello"}], 8)  # warm-up: the policy's costs, allocations
            rows = []
            for c in args.client_list:
                row = run_clients(srv.url, c, requests, args.max_tokens)
                if reference is None:
                    reference = row["texts"]
                mismatches += sum(a != b for a, b in zip(row.pop("texts"), reference))
                row["rss_gb"] = srv.rss_gb()  # after each row: a flat column is memory that does not creep
                rows.append(row)
                print(f"parallel {par}, {c} clients: {row['aggregate_tok_s']:.2f} tok/s aggregate", flush=True)
            run = {"parallel": par, "health": srv.health, "rows": rows, "rss_gb": srv.rss_gb()}
            if i == len(args.parallel_list) - 1 and not args.no_resend:
                report["resend"] = resend(srv.url, args.max_tokens, 3 if args.smoke else 48)
            report["runs"].append(run)
        finally:
            srv.stop()
    report["mismatches"] = mismatches
    md = markdown(report)
    print(md)
    save(args, report, md, print)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
