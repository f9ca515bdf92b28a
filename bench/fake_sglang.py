"""A scripted SGLang-API backend that answers ``/generate`` at once (for proxy benchmarks).

``python bench/fake_sglang.py --port N [--tokens 100,101,102] [--eos 2]``: every request
gets the given tokens followed by EOS, with log-probs, as SGLang's native API returns them.
A bare ASGI app, so that the benchmark measures the proxy, not this peer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal.proxy.asgi import Request


class FakeSGLang:
    def __init__(self, tokens: list[int], eos: int):
        self.output = [*tokens, eos]
        self.logprobs = [[-0.1 * (i + 1), t, None] for i, t in enumerate(self.output)]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = await Request(scope, receive).body()
        if scope["path"] == "/generate":
            request = orjson.loads(body)
            budget = request.get("sampling_params", {}).get("max_new_tokens", len(self.output))
            n = min(budget, len(self.output))
            payload = {
                "text": "",
                "output_ids": self.output[:n],
                "meta_info": {
                    "id": request.get("rid", ""),
                    "finish_reason": {"type": "stop", "matched": self.output[-1]}
                    if n == len(self.output)
                    else {"type": "length", "length": n},
                    "prompt_tokens": len(request.get("input_ids", [])),
                    "completion_tokens": n,
                    "output_token_logprobs": self.logprobs[:n],
                },
            }
            status = 200
        elif scope["path"] in ("/health", "/health_generate"):
            payload, status = {"status": "ok"}, 200
        else:
            payload, status = {"success": True}, 200
        data = orjson.dumps(payload)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", default="100,101,102", help="comma-separated output token ids")
    parser.add_argument("--eos", type=int, default=2)
    args = parser.parse_args()
    app = FakeSGLang([int(t) for t in args.tokens.split(",")], args.eos)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=4096,
    )


if __name__ == "__main__":
    main()
