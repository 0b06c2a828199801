"""A loopback adapter through which `vllm bench serve` drives mlx-lm's server (mlx-lm 0.32).

    python -m bench.sse_adapter --upstream http://127.0.0.1:8080 --port 8081 --eos 2

It bridges exactly three differences of POST /v1/completions, and passes all else unchanged:
- the client sends "logprobs": null; mlx-lm validates it as a bool and answers HTTP 400: the
  key is dropped;
- while it prefills, mlx-lm streams ": keepalive N/M" SSE comments; the client strips every
  chunk it receives, so a comment and the next event run together with no blank line between
  them and it never finds a valid chunk: comments are dropped, each event goes on as it comes;
- the client's --ignore-eos sends vLLM's "ignore_eos", which mlx-lm does not know: it becomes
  a logit bias against the end-of-sequence ids, so both servers generate as many tokens.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

EOS_BIAS = -1e9


def adapt(body: dict, eos_ids: list[int]) -> dict:
    body = {k: v for k, v in body.items() if not (k == "logprobs" and v is None)}
    if body.pop("ignore_eos", False):
        body["logit_bias"] = {**body.get("logit_bias", {}), **{str(t): EOS_BIAS for t in eos_ids}}
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = adapt(await request.json(), app["eos_ids"])
    async with app["session"].post(app["upstream"] + request.path, json=body) as upstream:
        if upstream.content_type != "text/event-stream":
            return web.Response(status=upstream.status, body=await upstream.read(),
                                content_type=upstream.content_type)
        out = web.StreamResponse(status=upstream.status,
                                 headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        event: list[str] = []
        async for raw in upstream.content:
            line = raw.decode().rstrip("\r\n")
            if line and not line.startswith(":"):
                event.append(line)
            elif not line and event:
                await out.write(("\n".join(event) + "\n\n").encode())
                event = []
        if event:
            await out.write(("\n".join(event) + "\n\n").encode())
        await out.write_eof()
        return out


async def _session(app: web.Application):
    app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None,
                                                                         sock_read=600))
    yield
    await app["session"].close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="mlx-lm server, http://127.0.0.1:PORT")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--eos", type=int, nargs="+", required=True, help="end-of-sequence ids")
    args = p.parse_args(argv)
    if not args.upstream.startswith("http://127.0.0.1:"):
        raise ValueError(f"--upstream: expected http://127.0.0.1:PORT, got {args.upstream!r}")
    app = web.Application(client_max_size=64 << 20)
    app.update(upstream=args.upstream, eos_ids=args.eos)
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
