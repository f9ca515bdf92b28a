"""``python -m areal.engine.sglang_launch FLAGS``: SGLang's launch_server, API key from the env.

SGLang takes its key only as ``--api-key`` on the command line, where every local user can
read it (``/proc/<pid>/cmdline``, ``ps``). This launcher reads the key from
``AREAL_INFERENCE_API_KEY`` (and drops it from the environment), then runs SGLang's own
``python -m sglang.launch_server`` entry point in this process with the same FLAGS, setting
``api_key`` on the ``ServerArgs`` that SGLang's ``prepare_server_args`` parsed from them.
So SGLang's ``__main__`` (plugins, warnings, process-tree cleanup) runs as it would, and
its argv, its recorded launch command and its ``server_args`` log line never hold the key:
the last is masked for every log record of this process.

Checked against SGLang 0.5.10.post1 through 0.5.23: ``sglang/launch_server.py`` imports
``prepare_server_args`` from ``sglang.srt.server_args`` at module level and calls it on
``sys.argv[1:]`` under ``__main__``, before anything reads ``api_key``.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

from areal.inference.auth import API_KEY_ENV
from areal.utils.secrets import REDACTED, refuse_printed_form

__all__ = ["main"]


def _mask_in_log_records(secret: str) -> None:
    """Replace ``secret`` in the message of every log record made in this process.

    A record factory, unlike a handler filter, survives SGLang reconfiguring logging.
    """
    make_record = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed call: logging reports it when the record is emitted
            return record
        if secret in message:
            record.msg, record.args = message.replace(secret, REDACTED), None
        return record

    logging.setLogRecordFactory(factory)


def _usage_error(message: str) -> None:
    print(f"areal.engine.sglang_launch: error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    api_key = os.environ.pop(API_KEY_ENV, "").strip()
    if not api_key:
        _usage_error(
            f"set {API_KEY_ENV} (the inference server's API key is never taken from the "
            "command line)"
        )
    try:
        refuse_printed_form(api_key, API_KEY_ENV)
    except ValueError as e:
        _usage_error(str(e))
    import sglang.srt.server_args as server_args_module

    parse = server_args_module.prepare_server_args

    def prepare_server_args(argv: list[str]) -> Any:
        server_args = parse(argv)
        if getattr(server_args, "api_key", None):
            _usage_error(
                f"--api-key on the command line is readable by every local user; put the "
                f"key in {API_KEY_ENV} instead"
            )
        server_args.api_key = api_key
        return server_args

    server_args_module.prepare_server_args = prepare_server_args
    _mask_in_log_records(api_key)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
