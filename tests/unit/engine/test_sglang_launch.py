"""SGLang servers get their API key through the environment, never through argv.

SGLang cannot be installed here, so a stand-in ``sglang`` package with the structure that
``python -m sglang.launch_server`` has in every release from 0.5.10.post1 to 0.5.23 (a
module-level ``from sglang.srt.server_args import prepare_server_args``, called on
``sys.argv[1:]`` under ``__main__``; ``ServerArgs.api_key``; the key checked as
``Authorization: Bearer``; ``server_args`` logged at info) runs behind the real launcher.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_backend import SGLangBackend
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra import workflow_context

REPO = Path(__file__).resolve().parents[3]
KEY_ENV = "AREAL_INFERENCE_API_KEY"

STAND_IN = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/server_args.py": """
        import argparse
        import dataclasses


        @dataclasses.dataclass
        class ServerArgs:
            model_path: str = ""
            host: str = "127.0.0.1"
            port: int = 30000
            api_key: str | None = None


        def prepare_server_args(argv):
            parser = argparse.ArgumentParser(prog="sglang serve")
            for field in dataclasses.fields(ServerArgs):
                kind = int if field.type is int else str
                parser.add_argument("--" + field.name.replace("_", "-"), type=kind)
            parsed = parser.parse_args(argv)
            return ServerArgs(**{k: v for k, v in vars(parsed).items() if v is not None})
    """,
    "sglang/launch_server.py": """
        import http.server
        import json
        import logging
        import os
        import sys

        from sglang.srt.server_args import prepare_server_args


        def run_server(server_args):
            logging.basicConfig(level=logging.INFO, force=True)
            logging.getLogger("sglang").info(f"{server_args=}")
            with open(os.environ["STAND_IN_RECORD"], "w") as f:
                json.dump({"api_key": server_args.api_key, "argv": sys.argv[1:],
                           "env_key": os.environ.get("AREAL_INFERENCE_API_KEY")}, f)

            class Handler(http.server.BaseHTTPRequestHandler):
                def answer(self, status, body):
                    data = json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

                def authorized(self):
                    scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                    return scheme.lower() == "bearer" and token == server_args.api_key

                def do_GET(self):
                    if self.path.startswith("/health"):
                        return self.answer(200, {})
                    if not self.authorized():
                        return self.answer(401, {"error": "Unauthorized"})
                    return self.answer(200, {"model_path": server_args.model_path})

                def do_POST(self):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    if not self.authorized():
                        return self.answer(401, {"error": "Unauthorized"})
                    n = body["sampling_params"]["max_new_tokens"]
                    self.answer(200, {"output_ids": [3] * n, "meta_info": {
                        "finish_reason": {"type": "length", "length": n},
                        "output_token_logprobs": [[-1.0, 3, None]] * n}})

                def log_message(self, *args):
                    pass

            http.server.HTTPServer((server_args.host, server_args.port), Handler).serve_forever()


        if __name__ == "__main__":
            run_server(prepare_server_args(sys.argv[1:]))
    """,
}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    root = tmp_path / "stand-in"
    for name, text in STAND_IN.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), str(REPO)]))
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    monkeypatch.delenv(KEY_ENV, raising=False)
    return record


def test_an_sglang_server_gets_the_key_from_the_environment(stand_in, capfd):
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", setup_timeout=60))
    info = engine.launch_server({"model_path": "/models/m", "host": "127.0.0.1"})
    try:
        engine.initialize()  # /health is open; the key is checked on /get_model_info

        async def generate():
            try:
                g = GenerationHyperparameters(greedy=True, max_new_tokens=3, max_tokens=100)
                return await engine.agenerate(ModelRequest(input_ids=[1, 2], gconfig=g))
            finally:
                await workflow_context.close_clients()

        assert asyncio.run(generate()).output_tokens == [3, 3, 3]
        key = engine.api_key.reveal()
        argv = Path(f"/proc/{info.process.pid}/cmdline").read_bytes()
        assert b"areal.engine.sglang_launch" in argv and key.encode() not in argv
    finally:
        engine.destroy()
    record = json.loads(stand_in.read_text())
    assert record["api_key"] == key  # on SGLang's parsed arguments
    assert key not in " ".join(record["argv"]) and record["env_key"] is None
    err = capfd.readouterr().err
    assert "server_args=ServerArgs(" in err and "api_key='<redacted>'" in err and key not in err


def launcher(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal.engine.sglang_launch", "--model-path", "/m", *flags],
        env={**os.environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_launcher_refuses_a_key_on_argv_or_no_key(stand_in):
    on_argv = launcher({KEY_ENV: "from-env-123456"}, "--api-key", "visible-secret")
    assert on_argv.returncode == 2 and KEY_ENV in on_argv.stderr
    assert "visible-secret" not in on_argv.stderr + on_argv.stdout
    assert not stand_in.exists()  # SGLang's server never started
    missing = launcher({})
    assert missing.returncode == 2 and KEY_ENV in missing.stderr


def test_launch_commands_keep_the_key_out_of_argv():
    args = {"model_path": "/m", "host": "h", "port": 1}
    assert SGLangBackend().launch_command(args)[1:3] == ["-m", "sglang.launch_server"]
    assert SGLangBackend().launch_command(args, api_key_from_env=True)[1:3] == [
        "-m",
        "areal.engine.sglang_launch",
    ]
    with pytest.raises(ValueError, match=KEY_ENV):
        RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1")).launch_server(
            {**args, "api_key": "k"}
        )
