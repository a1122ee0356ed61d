"""The client-side half of the soak's connection failures, without vLLM: httpcore's pool closing a
connection it has already handed to a request (encode/httpcore#1110, open in httpcore 1.0.9).

A local HTTP/1.1 server that never closes a keep-alive connection answers each request after a
random 0-30 ms. 32 tasks share one httpx pool (36 connections) with keep-alive expiry SECONDS
(negative: nothing pooled, max_keepalive_connections=0), and a task blocks the event loop for up
to 30 ms now and then, as a busy soak client does. Every request error is counted by the
innermost exception of its chain, and one chain per kind is printed.

    python benchmarks/pool_race.py DURATION_S KEEPALIVE_EXPIRY_S
"""
import asyncio, random, sys, time
from collections import Counter
import httpx

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(random.uniform(0, 0.03))
            body = b"ok"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

def chain(e):
    out = []
    while e is not None and e not in out:
        out.append(e); e = e.__cause__ or e.__context__
    return " <- ".join(f"{type(x).__name__}: {x}" for x in out)

async def main(seconds, expiry):
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = (httpx.Limits(max_connections=36, max_keepalive_connections=0) if expiry < 0 else
              httpx.Limits(max_connections=36, max_keepalive_connections=36, keepalive_expiry=expiry))
    errors, ok = Counter(), 0
    examples = {}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def worker():
            nonlocal ok
            while time.monotonic() < deadline:
                try:
                    r = await client.get(f"http://127.0.0.1:{port}/")
                    ok += r.status_code == 200
                except Exception as e:
                    c = chain(e); key = c.split(" <- ")[-1][:80]
                    errors[key] += 1; examples.setdefault(key, c)
                await asyncio.sleep(random.uniform(0, 0.01))
        async def lag():
            while time.monotonic() < deadline:
                await asyncio.sleep(random.uniform(0, 0.05))
                time.sleep(random.uniform(0, 0.03))   # a busy loop: nothing runs meanwhile
        await asyncio.gather(lag(), *(worker() for _ in range(32)))
    server.close()
    print({"seconds": seconds, "keepalive_expiry": expiry, "ok": ok, "errors": dict(errors)})
    for k, c in examples.items():
        print("  ", c[:300])

asyncio.run(main(float(sys.argv[1]), float(sys.argv[2])))
