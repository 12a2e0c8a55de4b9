"""`stacx serve` under load: many parallel clients for a while, and a client beside 64 idle sockets.

    python bench/serve_load.py [--clients 32 --seconds 60 --idle-sockets 64 --new-tokens 4]

On a tiny model (the HTTP layer is what is measured, not the model), in one process:
  baseline  one client sends /generate back to back for a tenth of --seconds
  load      --clients clients (threads, each its own keep-alive session) do the same for --seconds;
            every answer that is not a 200 and every connection error counts as a failure
  idle      --idle-sockets sockets are opened from this process (half never send a byte, half
            finish one request and stay open); then a second client's /health and /generate
            latency, against the same requests with no idle sockets
Prints requests, failures, requests/s and the ratio load / baseline, and the idle ratio.
Writes bench/results/serve_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time

import requests


def hammer(url: str, num_clients: int, seconds: float, new_tokens: int) -> dict:
    ok, failures, errors = [0] * num_clients, [0] * num_clients, []
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        body = {"input_ids": [4, 5 + index % 7], "sampling_params": {"max_new_tokens": new_tokens}}
        with requests.Session() as session:
            while time.monotonic() < deadline:
                try:
                    reply = session.post(url + "/generate", json=body, timeout=60)
                    if reply.status_code == 200:
                        ok[index] += 1
                    else:
                        failures[index] += 1
                        errors.append(f"HTTP {reply.status_code}: {reply.text[:200]}")
                except requests.RequestException as err:
                    failures[index] += 1
                    errors.append(repr(err)[:200])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(num_clients)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    return {"clients": num_clients, "seconds": round(elapsed, 1), "requests": sum(ok) + sum(failures),
            "failures": sum(failures), "requests_per_s": round(sum(ok) / elapsed, 1), "first_errors": errors[:5]}


def second_client_latency_s(url: str, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        with requests.Session() as session:
            start = time.monotonic()
            session.get(url + "/health", timeout=60).raise_for_status()
            session.post(url + "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}},
                         timeout=60).raise_for_status()
            times.append(time.monotonic() - start)
    return statistics.median(times)


def idle_sockets_probe(url: str, port: int, num_sockets: int) -> dict:
    quiet = second_client_latency_s(url)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(num_sockets)]
    try:
        for sock in idle[: num_sockets // 2]:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.recv(65536)
        busy = second_client_latency_s(url)
    finally:
        for sock in idle:
            sock.close()
    return {"idle_sockets": num_sockets, "latency_quiet_s": round(quiet, 4), "latency_beside_idle_s": round(busy, 4),
            "ratio": round(busy / quiet, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--idle-sockets", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "serve_load.json"))
    args = parser.parse_args(argv)

    from stacx.serving.cpu_engine import CpuEngine, ensure_single_process_layout
    from stacx.serving.server import EngineHttpServer
    from stacx.tasks import write_tiny_checkpoint

    ensure_single_process_layout()
    with tempfile.TemporaryDirectory() as folder:
        engine = CpuEngine.from_hf_checkpoint(write_tiny_checkpoint(os.path.join(folder, "tiny"), "sorting", seed=0))
    with EngineHttpServer(engine) as server:
        baseline = hammer(server.url, 1, max(1.0, args.seconds / 10), args.new_tokens)
        load = hammer(server.url, args.clients, args.seconds, args.new_tokens)
        idle = idle_sockets_probe(server.url, server.port, args.idle_sockets)
    result = {"baseline": baseline, "load": load, "idle": idle,
              "throughput_ratio_load_over_one_client": round(load["requests_per_s"] / baseline["requests_per_s"], 2)}
    print(f"one client:   {baseline['requests']} requests in {baseline['seconds']} s, "
          f"{baseline['requests_per_s']}/s, {baseline['failures']} failed")
    print(f"{args.clients} clients:   {load['requests']} requests in {load['seconds']} s, "
          f"{load['requests_per_s']}/s, {load['failures']} failed; "
          f"ratio to one client {result['throughput_ratio_load_over_one_client']}x")
    print(f"beside {args.idle_sockets} idle sockets: a second client's /health + /generate took "
          f"{idle['latency_beside_idle_s']} s (alone: {idle['latency_quiet_s']} s, ratio {idle['ratio']}x)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(result, out, indent=2)
    return 0 if load["failures"] == 0 and baseline["failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
