"""A minimal fake Arena for client benchmarks: dataset paging, task launch and polling.

Run as a server: ``python bench/fake_arena.py --port 18080 --rows 100000 --polls 3``.
It is a bare ASGI app (no framework) so that the benchmark measures the client, not the
fake. Every task reports RUNNING for ``--polls - 1`` polls, then DONE with a score.
"""

from __future__ import annotations

import argparse
import json
import re
from itertools import count
from urllib.parse import parse_qs

_DATASET = re.compile(r"^/openapi/v1/streams/([^/]+)/dataset$")
_LAUNCH = re.compile(r"^/openapi/v1/streams/([^/]+)/launch_one_task$")
_RESULT = re.compile(r"^/openapi/v1/tasks/([^/]+)/result$")


class FakeArena:
    def __init__(self, rows: int, polls: int):
        self.rows = rows
        self.polls = polls
        self.task_polls: dict[str, int] = {}
        self._ids = count()

    def dataset_page(self, query: dict[str, list[str]]) -> dict:
        limit = int(query.get("limit", ["1"])[0])
        offset = int(query.get("offset", ["0"])[0])
        ids = [f"row-{i}" for i in range(offset, min(self.rows, offset + limit))]
        return {
            "total": self.rows,
            "offset": offset,
            "limit": limit,
            "count": len(ids),
            "data_ids": ids,
            "items": [{"data_id": i, "tags": ["domain:swe", "level:easy"]} for i in ids],
        }

    def launch(self) -> dict:
        task_id = f"task-{next(self._ids)}"
        self.task_polls[task_id] = 0
        return {"task_id": task_id, "status": "PENDING"}

    def result(self, task_id: str) -> tuple[int, dict]:
        if task_id not in self.task_polls:
            return 404, {"error": "unknown task"}
        self.task_polls[task_id] += 1
        if self.task_polls[task_id] < self.polls:
            return 200, {"task_id": task_id, "status": "RUNNING"}
        return 200, {"task_id": task_id, "status": "DONE", "score": 0.75, "raw": {"tests": 4}}

    def route(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, dict]:
        if method == "POST" and _DATASET.match(path):
            return 200, self.dataset_page(query)
        if method == "POST" and _LAUNCH.match(path):
            return 202, self.launch()
        match = _RESULT.match(path)
        if method == "GET" and match:
            return self.result(match.group(1))
        return 404, {"error": f"no route {method} {path}"}

    async def __call__(self, scope, receive, send) -> None:
        more = True
        while more:  # drain the request body
            more = (await receive()).get("more_body", False)
        query = parse_qs(scope.get("query_string", b"").decode())
        status, payload = self.route(scope["method"], scope["path"], query)
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--polls", type=int, default=3)
    args = parser.parse_args()
    uvicorn.run(
        FakeArena(args.rows, args.polls),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        backlog=4096,
        lifespan="off",
        timeout_keep_alive=60,
    )


if __name__ == "__main__":
    main()
