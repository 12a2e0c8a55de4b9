"""A toy engine kind (docs/adding-an-engine.md): the CPU engine's `stacx serve` under another name,
whose launcher and client note each call in the file named by STACX_TEST_TOY_ENGINE_LOG, if set."""

import os

from stacx.rollout.engines.http import HttpEngine
from stacx.rollout.engines.launchers import launch_cpu_server
from stacx.rollout.engines.registry import register_engine


def note(event):
    path = os.environ.get("STACX_TEST_TOY_ENGINE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(f"{event} {os.getpid()}\n")


def launch_toy_servers(launch):
    note("launch")
    return launch_cpu_server(launch)


@register_engine("toy", launcher=launch_toy_servers, starts_beside_workers=True)
class ToyEngineClient(HttpEngine):
    def generate(self, requests):
        note("generate")
        return super().generate(requests)

    def update_weights(self, buckets, *, version):
        note(f"update_weights_{version}")
        super().update_weights(buckets, version=version)
