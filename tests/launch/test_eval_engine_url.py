"""`stacx eval --engine-url`: the same evaluation against a running server as with the CPU engine
in-process, batch by batch with a progress bar."""

from __future__ import annotations

import json

import pytest

from stacx.launch.cli import main
from stacx.tasks import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("eval_url") / "ckpt"), "addition")


@pytest.fixture
def server(checkpoint):
    """A `stacx serve`-equivalent server in a thread; yields (url, list of request counts per /generate)."""
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer

    engine = CpuEngine.from_hf_checkpoint(checkpoint, seed=0)
    calls: list[int] = []
    generate = engine.generate

    def counting_generate(requests, **options):  # options: the server's abort hook (should_stop)
        calls.append(len(requests))
        return generate(requests, **options)

    engine.generate = counting_generate
    http_server = EngineHttpServer(engine, port=0, model_path=checkpoint).start()
    yield http_server.url, calls
    http_server.stop()


def _eval(checkpoint, out, *flags) -> dict:
    assert main(["eval", "--hf-checkpoint", checkpoint, "--task", "addition", "--num-prompts", "6",
                 "--n-samples", "2", "--out", str(out), *flags]) == 0
    with open(out) as handle:
        return json.load(handle)


TOY_ENGINE = "tests/launch/toy_engine.py"
"""A toy engine kind registered from a --custom-module file (docs/adding-an-engine.md)."""


def test_a_server_gives_the_cpu_engines_numbers_in_batches_with_a_progress_bar(checkpoint, server, tmp_path, capsys,
                                                                                monkeypatch):
    url, calls = server
    local = _eval(checkpoint, tmp_path / "local.json", "--batch-size", "100", "--no-progress-bar")
    assert "stacx eval:" not in capsys.readouterr().err  # no bar when asked for none
    remote = _eval(checkpoint, tmp_path / "remote.json", "--engine-url", url, "--batch-size", "4")
    assert calls == [8, 4]  # two batches (4 + 2 prompts) x 2 samples, all through the server
    assert "6/6" in capsys.readouterr().err  # the progress bar counted every prompt
    assert remote["engine"] == url and local["engine"] == "cpu"
    assert remote["metrics"] == local["metrics"]  # greedy, same weights, same seeds
    assert [s["response"] for s in remote["samples"]] == [s["response"] for s in local["samples"]]
    # The client of an engine kind a --custom-module file registers talks to the server just the same.
    monkeypatch.setenv("STACX_TEST_TOY_ENGINE_LOG", str(tmp_path / "toy.log"))
    toy = _eval(checkpoint, tmp_path / "toy.json", "--engine-url", url, "--batch-size", "4", "--no-progress-bar",
                "--custom-module", TOY_ENGINE, "--engine-kind", "toy")
    assert calls == [8, 4, 8, 4] and toy["metrics"] == local["metrics"]
    assert (tmp_path / "toy.log").read_text().split()[::2] == ["generate", "generate"]


def test_engine_url_mistakes_are_named(checkpoint, tmp_path, capsys):
    cases = [
        (["--engine-url", "127.0.0.1:1"], "--engine-url '127.0.0.1:1': give an http:// or https:// URL"),
        (["--engine-url", "http://127.0.0.1:9"], "--engine-url http://127.0.0.1:9: the server does not answer /health"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--engine-kind", "http"], "--engine-kind http names the client of a running server; add --engine-url"),
        (["--engine-url", "http://127.0.0.1:9", "--engine-kind", "sglan"],
         "--engine-kind 'sglan' is not a registered engine kind; did you mean 'sglang'?"),
    ]
    for flags, message in cases:
        assert main(["eval", "--hf-checkpoint", checkpoint, "--task", "addition", "--out",
                     str(tmp_path / "x.json"), *flags]) == 2
        assert message in capsys.readouterr().err, flags
    assert main(["eval", "--load", str(tmp_path), "--task", "addition", "--engine-url", "http://127.0.0.1:9"]) == 2
    assert "--engine-url evaluates the model a server already runs" in capsys.readouterr().err
