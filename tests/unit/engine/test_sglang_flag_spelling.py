"""Renamed SGLang flags are spelled for the SGLang where the server launches."""

from __future__ import annotations

import pytest

from areal.api.config.inference import spell_for_sglang
from areal.engine.sglang_backend import SGLangBackend


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.5.10.post1", {"cuda_graph_max_bs": 64, "cuda_graph_bs": [1, 8]}),
        ("0.5.13", {"cuda_graph_max_bs": 64, "cuda_graph_bs": [1, 8]}),
        ("0.5.14", {"cuda_graph_max_bs_decode": 64, "cuda_graph_bs_decode": [1, 8]}),
        ("0.5.23", {"cuda_graph_max_bs_decode": 64, "cuda_graph_bs_decode": [1, 8]}),
    ],
)
def test_either_spelling_is_respelled_for_the_target(version, expected):
    old = {"cuda_graph_max_bs": 64, "cuda_graph_bs": [1, 8], "tp_size": 2}
    new = {"cuda_graph_max_bs_decode": 64, "cuda_graph_bs_decode": [1, 8], "tp_size": 2}
    for args in (old, new):  # a controller may have built them for another version
        assert spell_for_sglang(args, version) == {**expected, "tp_size": 2}


def test_the_launch_command_uses_the_sglang_installed_where_it_runs(monkeypatch):
    from areal.api.config import inference

    monkeypatch.setattr(inference, "target_sglang_version", lambda: "0.5.23")
    argv = SGLangBackend().launch_command({"cuda_graph_max_bs": 16, "port": 1})
    assert "--cuda-graph-max-bs-decode" in argv and "--cuda-graph-max-bs" not in argv
    monkeypatch.setattr(inference, "target_sglang_version", lambda: "0.5.10.post1")
    argv = SGLangBackend().launch_command({"cuda_graph_max_bs_decode": 16, "port": 1})
    assert "--cuda-graph-max-bs" in argv and "--cuda-graph-max-bs-decode" not in argv
