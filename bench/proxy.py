"""Benchmark of the token-exact proxy (ferryman-proxy). Two parts, one run:

1. **Overhead per request, engine time excluded**, at 1, 32 and 128 concurrent agent sessions.
   The engine is ``ferryman_proxy.testing.ScriptedEngine``, a named zero-latency fake that
   answers every prompt at once with the same tool call (about 40 tokens); it sits behind core's
   ServerClient and default router like a real replica. Each session is a multi-turn agent
   (aiohttp client) that sends its growing history with two tools and ~400 characters of tool
   output per turn; the agents run in a separate client process, as sandboxed agents do.
   Printed per level, p50/p99 over all requests:

   * ``proxy cpu`` / ``proxy wall``: the proxy's own time per request as measured inside the
     server, from the request body in hand to the response ready (JSON decoding, validation,
     incremental tokenization, tool-call parsing, response encoding), less the time awaiting
     the engine; in CPU time of the event loop's thread and in wall time; ``encode``: the part
     spent in the tokenizer encoding the turn's new text;
   * ``round trip``: what the agent sees (HTTP client + server), engine time ~0; at 32 and 128
     sessions this includes queueing behind the other sessions on the proxy's one event loop;
   * ``bare HTTP``: the same client against a bare aiohttp handler that reads the same bodies
     and returns a canned answer of the same size (the floor any aiohttp server pays), and the
     ratio proxy round trip / bare round trip.

2. **Tokenization per turn** in a 50-turn agent conversation of about 32k tokens (tiny
   tokenizer, ChatML + hermes template, two tools; every turn adds a tool call and a tool output
   of the same size as the task statement of the first prompt): the proxy's per-turn work
   before the engine call (validating the request against what the session already validated,
   history check, window render of the new messages, tokenizing them) at turn 1 (the first
   prompt, tokenized whole), turn 2 and turn 50, next to the naive way (``apply_chat_template``
   of the whole conversation, tokenized) at the same turns, in CPU time, medians of ``--repeat``
   runs.

Timings of the proxy are taken in CPU time of the event loop's thread as well as wall time: on a
shared machine wall time mostly measures the other processes. ``gc.freeze()`` is called after
start-up (as a long-running server would), so that the cyclic GC does not rescan torch and
transformers during a request.

    .venv/bin/python bench/proxy.py                  # about a minute
    .venv/bin/python bench/proxy.py --requests 400   # quicker, noisier
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the sandbox and return its output.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]
SYSTEM = "You are a careful software engineer. Use the tools to inspect and change the repository, then answer."
CALL = '<tool_call>\n{"name": "run_shell", "arguments": {"command": "ls -la data", "timeout": 10}}\n</tool_call>'


def tool_output(turn: int, chars: int) -> str:
    line = f"-rw-r--r-- 1 user user {1000 + turn} Jan 1 12:00 file_{turn}.txt\n"
    return (line * (chars // len(line) + 1))[:chars]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ----------------------------------------------------------------------------- part 1


async def agent(http: aiohttp.ClientSession, url: str, model: str, turns: int, lat: list[float], observe: int) -> None:
    """One agent session: ``turns`` requests, each with the whole history so far."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the data folder."}]
    for t in range(turns):
        t0 = time.perf_counter()
        async with http.post(url, json={"model": model, "messages": msgs, "tools": TOOLS}) as r:
            out = await r.json()
        lat.append(time.perf_counter() - t0)
        assert r.status == 200, out
        msg = out["choices"][0]["message"]
        msgs.append(msg)
        call_id = msg["tool_calls"][0]["id"] if msg.get("tool_calls") else "none"
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": tool_output(t, observe)})


async def client_main() -> None:
    """``--client``: the agents, in their own process (as sandboxed agents are), so that their
    CPU and their objects are not the proxy's. Reads {"urls", "model", "turns", "observe"} on
    stdin, writes {"lat": [...]} on stdout."""
    job = json.loads(sys.stdin.read())
    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for urls in job["rounds"]:  # the sessions of a round run concurrently, rounds one after the other
            await asyncio.gather(*(agent(http, u, job["model"], job["turns"], lat, job["observe"]) for u in urls))
    sys.stdout.write(json.dumps({"lat": lat}))


async def run_clients(rounds: list[list[str]], model: str, turns: int, observe: int) -> list[float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate(json.dumps({"rounds": rounds, "model": model, "turns": turns, "observe": observe}).encode())
    if proc.returncode:
        raise RuntimeError(f"client process failed ({proc.returncode})")
    return json.loads(out)["lat"]


async def overhead(tok: Any, levels: list[int], requests: int, turns: int, observe: int) -> list[dict[str, float]]:
    from aiohttp import web

    from ferryman.client import ServerClient
    from ferryman.defaults.router import LocalRouter
    from ferryman.types import SamplingParams
    from ferryman_proxy import ProxyConfig, ProxyServer
    from ferryman_proxy.testing import ScriptedEngine, fixed_answer

    answer_ids = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    engine = ScriptedEngine(fixed_answer(answer_ids), record=False)
    client = ServerClient(LocalRouter(["e0"]), {"e0": engine}, partial_rollout=False)
    server = ProxyServer(tokenizer=tok, client=client, config=ProxyConfig())
    await server.start()

    canned: dict[str, Any] = {}

    async def bare(request: web.Request) -> web.Response:
        json.loads(await request.read())
        return web.json_response(canned)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/chat/completions", bare)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    bare_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/chat/completions"  # noqa: SLF001

    # the canned answer for the bare server: a real one
    warm = server.open_session("warm", SamplingParams(max_tokens=256))
    async with aiohttp.ClientSession() as http:
        async with http.post(warm.base_url + "/chat/completions", json={"model": warm.model_name, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}) as r:
            canned.update(await r.json())
    await server.close_session(warm)

    rows = []
    for level in levels:
        rounds = max(1, -(-requests // (level * turns)))
        server.overheads_s.clear()
        server.overhead_cpu_s.clear()
        server.encode_times_s.clear()
        sessions = [[server.open_session(f"r-{level}-{rnd}-{i}", SamplingParams(max_tokens=256)) for i in range(level)] for rnd in range(rounds)]
        t0 = time.perf_counter()
        lat = await run_clients([[s.base_url + "/chat/completions" for s in rnd] for rnd in sessions], server.config.model_name, turns, observe)
        wall = time.perf_counter() - t0  # includes starting the client process (about a second)
        for rnd in sessions:
            for s in rnd:
                res = await server.close_session(s)
                assert len(res.trajectories) == 1 and res.metrics["proxy/turns"] == turns, "every session stays one segment"
        over, over_cpu, enc = list(server.overheads_s), list(server.overhead_cpu_s), list(server.encode_times_s)
        blat = await run_clients([[bare_url] * level for _ in range(rounds)], "m", turns, observe)
        rows.append(
            {
                "sessions": level,
                "requests": len(over),
                "cpu_p50_ms": 1e3 * pct(over_cpu, 0.5),
                "cpu_p99_ms": 1e3 * pct(over_cpu, 0.99),
                "encode_p50_ms": 1e3 * pct(enc, 0.5),
                "proxy_p50_ms": 1e3 * pct(over, 0.5),
                "proxy_p99_ms": 1e3 * pct(over, 0.99),
                "rt_p50_ms": 1e3 * pct(lat, 0.5),
                "rt_p99_ms": 1e3 * pct(lat, 0.99),
                "bare_p50_ms": 1e3 * pct(blat, 0.5),
                "bare_p99_ms": 1e3 * pct(blat, 0.99),
                "req_per_s": len(lat) / wall,
            }
        )
    await server.stop()
    await runner.cleanup()
    return rows


# ----------------------------------------------------------------------------- part 2


def build_conversation(turns: int, target_tokens: int, tok: Any) -> tuple[list[dict[str, Any]], int]:
    """A ``turns``-answer agent conversation of about ``target_tokens`` tokens (tool calls and
    tool outputs), ending with a tool result (the prompt of turn ``turns``)."""
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the data folder."}]
    call_msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "run_shell", "arguments": {"command": "ls -la data", "timeout": 10}}}],
    }
    per_turn_probe = len(tok.apply_chat_template(base + [call_msg, {"role": "tool", "content": tool_output(0, 1000)}], tools=TOOLS, tokenize=True, return_dict=False)) - len(
        tok.apply_chat_template(base, tools=TOOLS, tokenize=True, return_dict=False)
    )
    head = len(tok.apply_chat_template(base, tools=TOOLS, tokenize=True, return_dict=False))
    # tokens per turn ~ a + b * chars: scale the tool output so that the whole is ~target
    call_only = len(tok.apply_chat_template(base + [call_msg, {"role": "tool", "content": ""}], tools=TOOLS, tokenize=True, return_dict=False)) - head
    per_char = (per_turn_probe - call_only) / 1000
    chars = max(1, int(((target_tokens - head) / turns - call_only) / per_char))
    # the task statement is as long as a turn's tool output, so that the first prompt (system,
    # tools, task) and a later turn's new messages are of a similar size
    task = ("Fix the failing test in the data loader. " * (chars // 40 + 1))[:chars]
    msgs = [base[0], {"role": "user", "content": task}]
    for t in range(turns - 1):
        msgs += [call_msg, {"role": "tool", "tool_call_id": "call_0", "content": tool_output(t, chars)}]
    return msgs, chars


def tokenization(tok: Any, turns: int, target_tokens: int, repeat: int) -> dict[str, Any]:
    from ferryman.types import SamplingParams
    from ferryman_proxy import ProxyConfig, ProxyServer
    from ferryman_proxy.messages import parse_chat_request
    from ferryman_proxy.testing import ScriptedEngine, fixed_answer

    msgs, chars = build_conversation(turns, target_tokens, tok)
    answer_ids = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    prompts = [i for i, m in enumerate(msgs) if m["role"] == "tool"]  # turn k's request ends at its tool result
    ends = [len(msgs[:2])] + [i + 1 for i in prompts]  # request sizes, turn 1..turns

    def wire(m: dict[str, Any]) -> dict[str, Any]:
        if "tool_calls" not in m:
            return m
        return {**m, "tool_calls": [{**c, "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}} for c in m["tool_calls"]]}

    bodies = [{"model": "ferryman-policy", "messages": [wire(m) for m in msgs[:e]], "tools": TOOLS} for e in ends]
    proxy_t: dict[int, list[float]] = {1: [], 2: [], turns: []}
    naive_t: dict[int, list[float]] = {1: [], 2: [], turns: []}
    total = 0

    async def one_session() -> None:
        nonlocal total
        engine = ScriptedEngine(fixed_answer(answer_ids), record=False)
        server = ProxyServer(tokenizer=tok, client=engine, config=ProxyConfig())
        server.url = "http://unused"  # sessions are driven directly, without HTTP
        sess = server.open_session("r", SamplingParams(max_tokens=256))
        for k, body in enumerate(bodies, start=1):
            # as the server does: validation against what the session already validated
            c0 = time.thread_time()
            req = parse_chat_request(body, "ferryman-policy", sess.known)
            parse_s = time.thread_time() - c0
            before = sess.counters["tokenize_cpu_s"]
            await sess.chat(req)
            if k in proxy_t:
                proxy_t[k].append(parse_s + sess.counters["tokenize_cpu_s"] - before)
        t = (await server.close_session(sess)).trajectories
        assert len(t) == 1
        total = len(t[0].prompt_ids) + len(t[0].response_ids)

    for _ in range(repeat):
        asyncio.run(one_session())
        for k in naive_t:
            m = msgs[: ends[k - 1]]
            t0 = time.thread_time()
            tok.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
            naive_t[k].append(time.thread_time() - t0)
    med = {f"{name}_{k}": 1e3 * statistics.median(v) for name, d in (("proxy", proxy_t), ("naive", naive_t)) for k, v in d.items()}
    prompt_1 = len(tok.apply_chat_template(msgs[:2], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))
    prompt_n = len(tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))
    return {"turns": turns, "tool_chars": chars, "prompt_tokens_turn1": prompt_1, "prompt_tokens_last": prompt_n, "final_tokens": total, **med}


# ----------------------------------------------------------------------------- main


def main() -> None:
    if "--client" in sys.argv:
        asyncio.run(client_main())
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,32,128")
    ap.add_argument("--requests", type=int, default=2000, help="requests per concurrency level (at least)")
    ap.add_argument("--turns", type=int, default=8, help="turns per agent session in part 1")
    ap.add_argument("--observe-chars", type=int, default=400, help="tool output characters per turn in part 1")
    ap.add_argument("--tok-turns", type=int, default=50)
    ap.add_argument("--tok-tokens", type=int, default=32_000)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from ferryman.tiny import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / "ferryman-bench-proxy-tiny")
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.model_max_length = 10**9  # the bench's conversation is far longer than the tiny model's 512 positions
    c0 = time.thread_time()
    for _ in range(2000):
        sum(range(1000))
    calib = (time.thread_time() - c0) / 2000 * 1e6
    print(f"# ferryman-proxy bench: python {sys.version.split()[0]}, cpus={os.cpu_count()}, loadavg={os.getloadavg()[0]:.1f}")
    print(f"# CPU speed calibration: sum(range(1000)) takes {calib:.1f} us of CPU here (about 8-10 us on an idle modern core)")

    # a long-running server's habit: objects alive after start-up (torch, transformers, the
    # tokenizer) are left out of the cyclic GC's scans, so a collection does not stall a request
    gc.collect()
    gc.freeze()
    rows = asyncio.run(overhead(tok, [int(x) for x in args.levels.split(",")], args.requests, args.turns, args.observe_chars))
    print(f"\n## 1. overhead per request, engine time excluded (zero-latency fake engine; {args.turns} turns/session, {args.observe_chars} chars of tool output/turn)")
    print(f"{'sessions':>8} {'requests':>8} | {'proxy cpu p50':>13} {'p99 ms':>7} | {'encode p50':>10} | {'proxy wall p50':>14} {'p99 ms':>7} | {'round trip p50':>14} {'p99 ms':>7} | {'bare HTTP p50':>13} {'p99 ms':>7} | {'rt/bare':>7} | {'req/s':>6}")
    for r in rows:
        print(
            f"{r['sessions']:>8} {r['requests']:>8} | {r['cpu_p50_ms']:>13.3f} {r['cpu_p99_ms']:>7.3f} | {r['encode_p50_ms']:>10.3f} | {r['proxy_p50_ms']:>14.3f} {r['proxy_p99_ms']:>7.3f} | "
            f"{r['rt_p50_ms']:>14.3f} {r['rt_p99_ms']:>7.3f} | {r['bare_p50_ms']:>13.3f} {r['bare_p99_ms']:>7.3f} | {r['rt_p50_ms'] / r['bare_p50_ms']:>6.2f}x | {r['req_per_s']:>6.0f}"
        )
    print("# proxy cpu / wall: inside the server, from the request body in hand to the response ready, less the engine await,")
    print("#   in CPU time of the event loop's thread (what the proxy costs; immune to other processes on a shared machine)")
    print("#   and in wall time (includes being descheduled); encode: of which the tokenizer encoding the turn's new text")
    print("#   (~300 tokens of tool output and template glue; any server tokenizes it)")
    print("# round trip: as the agent sees it (agents in a separate client process; at 32/128 sessions this includes queueing")
    print("#   behind the other sessions on the proxy's one event loop)")
    print("# bare HTTP: same client and bodies against an aiohttp handler that only decodes the JSON and returns a canned answer")
    print("# req/s: requests over the level's wall time, start of the client process included")

    t = tokenization(tok, args.tok_turns, args.tok_tokens, args.repeat)
    n = t["turns"]
    print(f"\n## 2. tokenization per turn, CPU ms ({n}-turn conversation, {t['final_tokens']} tokens at the end; prompt {t['prompt_tokens_turn1']} tokens at turn 1, {t['prompt_tokens_last']} at turn {n}; median of {args.repeat})")
    print(f"{'':>28} {'turn 1 ms':>10} {'turn 2 ms':>10} {f'turn {n} ms':>11} {f'turn {n}/turn 1':>14}")
    for name, label in (("proxy", "proxy (incremental)"), ("naive", "naive (full re-tokenization)")):
        print(f"{label:>28} {t[f'{name}_1']:>10.3f} {t[f'{name}_2']:>10.3f} {t[f'{name}_{n}']:>11.3f} {t[f'{name}_{n}'] / t[f'{name}_1']:>13.2f}x")
    print(f"# at turn {n} the naive way costs {t[f'naive_{n}'] / t[f'proxy_{n}']:.1f}x the proxy's")


if __name__ == "__main__":
    main()
